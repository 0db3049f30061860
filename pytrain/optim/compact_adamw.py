"""AdamW over fp32 parameters with its two moments stored in bf16 (optim.state_dtype bf16
where the parameters are not bf16 with masters: FSDP2's shards, fp32 runs).

FSDP2 keeps each rank's shard of the parameters, their gradients and AdamW's two moments in
fp32: 16 bytes a parameter. Moments in bf16 make it 12 (the 8B over 4 GPUs: 7.5 GiB a GPU
less, and a checkpoint of 8 bytes a parameter instead of 12). The update computes in fp32
and rounds each moment once, to nearest, as pytrain.optim.master_adamw does (DeepSeek-V3
trains with bf16 moments so); parameters and gradients stay fp32.

torch's fused AdamW needs the moments in the parameters' dtype, so the update is a function
of its own: the same arithmetic as torch.optim.AdamW (decoupled weight decay, bias-corrected
moments), one call per parameter on its local tensors (a shard's, under FSDP2), compiled on
CUDA into one kernel that reads and writes each tensor once (one graph for every size). It
takes the fused AdamW's two attributes, so the trainer's step is the same for both
(pytrain.optim.adamw.fused_step): `grad_scale` (the gradients are divided by it: clipping)
and `found_inf` (where it is 1, weights, moments and step counts are left alone: the
guard's skip, decided on the device).

Its state is torch's AdamW's (`step`, `exp_avg`, `exp_avg_sq` per parameter), so DCP
saves and reshards it as it does torch's, and a checkpoint of either optimizer resumes in
the other (the moments are cast on loading)."""

from __future__ import annotations

import itertools

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["CompactAdamW", "adamw_update", "scratch_args"]


def adamw_update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    hyper: torch.Tensor,
    scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """One AdamW update of `p` in place (1-D views). `hyper`: lr, weight decay, beta1,
    beta2, eps (a tensor, so a new learning rate is not a new compiled graph); `step` is
    counted here; where `skip` is nonzero nothing changes."""
    lr, decay, beta1, beta2, eps = hyper.unbind()
    keep = skip == 0
    t = step + keep.to(step.dtype)
    g = g.float() / scale
    m0, v0 = m.float(), v.float()
    m1 = m0 + (1.0 - beta1) * (g - m0)
    v1 = v0 * beta2 + (1.0 - beta2) * g * g
    bias1 = 1.0 - beta1**t
    bias2_sqrt = (1.0 - beta2**t).sqrt()
    p1 = p * (1.0 - lr * decay) - (lr / bias1) * m1 / (v1.sqrt() / bias2_sqrt + eps)
    p.copy_(torch.where(keep, p1, p))
    m.copy_(torch.where(keep, m1, m0))
    v.copy_(torch.where(keep, v1, v0))
    step.copy_(t)


_compiled = None


def _update_fn(device: torch.device):
    """adamw_update, compiled on CUDA (one graph for any size: dynamic shapes); as it is
    elsewhere."""
    global _compiled
    if device.type != "cuda":
        return adamw_update
    if _compiled is None:
        _compiled = torch.compile(adamw_update, dynamic=True, fullgraph=True)
    return _compiled


SCRATCH_NUMEL = 1 << 20
"""The scratch arguments' length. Inductor sizes the compiled kernel's blocks by the sizes it
was compiled at (their hints, under dynamic shapes), and keeps them for every later size: a
block is capped at that length, and reaches 1024 elements from 128 x 1024 on. Compiled on 16
elements, its blocks were capped at 16: 76 ms a step for the 8B's 2.0B-parameter shards (4
H100s; 40 GB read and written, a sixth of HBM's bandwidth), where torch's fused AdamW over
fp32 moments took 25 (tests/test_gpu.py checks the compiled kernel's hint)."""


def scratch_args(device: torch.device, state_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Arguments for adamw_update that compile the graph every step then reuses:
    SCRATCH_NUMEL elements (12 MB, freed once compiled), each argument a tensor of its own,
    as at a step (Dynamo guards on which arguments alias)."""
    p, g = (torch.zeros(SCRATCH_NUMEL, device=device) for _ in range(2))
    m, v = (torch.zeros(SCRATCH_NUMEL, dtype=state_dtype, device=device) for _ in range(2))
    step, scale, skip = (torch.zeros((), device=device), torch.ones((), device=device),
                         torch.zeros((), device=device))  # fmt: skip
    hyper = torch.tensor([0.0, 0.0, 0.9, 0.95, 1e-8], device=device)
    return p, g, m, v, step, hyper, scale, skip


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's local part (its shard under FSDP2), flat, as a plain tensor: torchao's
    float8 all-gather wraps each weight's shard in a subclass around the fp32 tensor
    (`_tensor`), which is the one to update (the compiled update takes plain tensors).
    Detached: a parameter's view still requires grad under no_grad, and Dynamo guards on
    that (the scratch tensors the update is compiled on do not)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    inner = getattr(local, "_tensor", None)
    if is_traceable_wrapper_subclass(local) and isinstance(inner, torch.Tensor):
        local = inner
    return local.detach().view(-1)


class CompactAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with the moments stored in `state_dtype` (see the module)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
    ):
        # "fused": clipping and the skip are taken as grad_scale and found_inf (fused_step).
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "fused": True}  # fmt: skip
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        # The state exists from the start, in its dtype: the checkpoint's size is known
        # before the first step (pytrain.train.disk), and DCP need not make it by a step.
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=_local(p).device),
                    "exp_avg": torch.zeros_like(p, dtype=state_dtype),
                    "exp_avg_sq": torch.zeros_like(p, dtype=state_dtype),
                }
        # Per group: its hyperparameters as last sent to the device, and that tensor.
        self._hyper: dict[int, tuple[tuple[float, ...], torch.Tensor]] = {}
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self.device = torch.device("cpu") if first is None else _local(first).device
        # The update is compiled here, on scratch tensors, rather than at the first step:
        # the trainer counts the graphs its warm-up made, and one made later reads as a
        # recompile. Under no_grad, as step() calls it: Dynamo guards on the grad mode.
        update = _update_fn(self.device)
        if update is not adamw_update:
            with torch.no_grad():
                update(*scratch_args(self.device, state_dtype))

    def _hyper_of(self, i: int, group: dict) -> torch.Tensor:
        """Group i's lr, weight decay, betas and eps on the device. A copy from the host
        could wait for the device (pageable memory), so it is made once; a new learning
        rate (every step, under the schedule) is written by a fill, a kernel that takes it
        as its argument."""
        values = (group["lr"], group["weight_decay"], *group["betas"], group["eps"])
        sent = self._hyper.get(i)
        if sent is None or sent[0][1:] != values[1:]:
            sent = (values, torch.tensor(values, dtype=torch.float32).to(self.device))
        elif sent[0][0] != values[0]:
            sent[1][0].fill_(values[0])
            sent = (values, sent[1])
        self._hyper[i] = sent
        return sent[1]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading would cast every moment to the parameters' dtype (fp32) before
        this optimizer could cast them back: 8 bytes a parameter at once, more than a GPU
        holding its shards of the 8B has to spare on a resume. So torch loads all but the
        moments (the groups' hyperparameters; the step counts, which it puts on the
        parameters' device as for any optimizer marked fused), and the moments are put
        back here in this optimizer's dtype one at a time. A moment already in that dtype
        and on that device is kept as it is: where DCP read the checkpoint in place, it
        is this optimizer's own tensor."""
        moments = ("exp_avg", "exp_avg_sq")
        rest = {i: {k: v for k, v in st.items() if k not in moments}
                for i, st in state_dict["state"].items()}  # fmt: skip
        super().load_state_dict({**state_dict, "state": rest})
        # The saved ids follow the groups' order, as torch maps them.
        saved = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for i, p in zip(saved, params, strict=True):
            for k in moments:
                if k in state_dict["state"].get(i, {}):
                    moment = state_dict["state"][i][k]
                    self.state[p][k] = moment.to(device=p.device, dtype=self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CompactAdamW takes no closure")
        device = self.device
        update = _update_fn(device)
        scale = torch.ones((), device=device) if self.grad_scale is None else self.grad_scale
        skip = torch.zeros((), device=device) if self.found_inf is None else self.found_inf
        scale, skip = scale.float(), skip.float()
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            hyper = self._hyper_of(i, group)
            for p in params:
                st = self.state[p]
                update(_local(p), _local(p.grad), _local(st["exp_avg"]),
                       _local(st["exp_avg_sq"]), st["step"], hyper, scale, skip)  # fmt: skip
        return None
