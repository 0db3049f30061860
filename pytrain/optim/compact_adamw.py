"""AdamW over fp32 parameters with its two moments stored in bf16 (optim.state_dtype bf16
where the parameters are not bf16 with masters: FSDP2's shards, fp32 runs).

FSDP2 keeps each rank's shard of the parameters, their gradients and AdamW's two moments in
fp32: 16 bytes a parameter. Moments in bf16 make it 12 (the 8B over 4 GPUs: 7.5 GiB a GPU
less, and a checkpoint of 8 bytes a parameter instead of 12). The update computes in fp32
and rounds each moment once, to nearest, as pytrain.optim.master_adamw does (DeepSeek-V3
trains with bf16 moments so); parameters and gradients stay fp32.

torch's fused AdamW needs the moments in the parameters' dtype, so the update is a function
of its own: the same arithmetic as torch.optim.AdamW (decoupled weight decay, bias-corrected
moments) on each parameter's local tensors (a shard's, under FSDP2), compiled on CUDA into
one kernel a tensor that reads and writes it once, a call for each chunk of tensors of one
size (CHUNK). It takes the fused AdamW's two attributes, so the trainer's step is the same
for both (pytrain.optim.adamw.fused_step): `grad_scale` (the gradients are divided by it:
clipping) and `found_inf` (where it is 1, weights, moments and step counts are left alone:
the guard's skip, decided on the device).

Its state is torch's AdamW's (`step`, `exp_avg`, `exp_avg_sq` per parameter), so DCP
saves and reshards it as it does torch's, and a checkpoint of either optimizer resumes in
the other (the moments are cast on loading)."""

from __future__ import annotations

import itertools

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["CHUNK", "CompactAdamW", "adamw_update", "adamw_updates", "chunks"]


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


def adamw_updates(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hyper: torch.Tensor,
    scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """adamw_update for each tensor of a chunk (see CHUNK), in one call."""
    for i in range(len(ps)):
        adamw_update(ps[i], gs[i], ms[i], vs[i], steps[i], hyper, scale, skip)


CHUNK = 4
"""Tensors of one size that one compiled call updates. One call a tensor goes through
Dynamo's guards and wrappers each time, about 100-180 us of host time, for which the device
can wait; one graph of many tensors takes Inductor about as long again a tensor to compile
(its scheduler weighs fusions between them), so a chunk is a graph reused across the layers
(a graph for each (length, size) met). The 8B's shards over 4 GPUs (195 tensors,
benchmarks/optimizer.py, one H100): a call a tensor 23.8 ms a step, 20.5 of them the
host's, made in 6 s; chunks of 16: 16.8 ms, 9.4 on the host, made in 79 s. At 4: the two
embedding matrices, 8 chunks of each of the 4 matrices of its 32 blocks, 17 of the 65
norms: 50 calls a step, 7 graphs (23 tensors' worth of compiling against 83 at 16); on an
H200, 18.7 ms a step (16.4 on the host), made in 32 s, where torch's fused AdamW with fp32
moments took 20.8."""


def chunks(sizes: list[int]) -> list[list[int]]:
    """The indices of `sizes` in chunks of at most CHUNK, each of one size; in the order
    sizes first appear."""
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(n, []).append(i)
    return [idx[k : k + CHUNK] for idx in by_size.values() for k in range(0, len(idx), CHUNK)]


_compiled = None
_signatures: set[tuple[int, int, torch.dtype]] = set()
"""The (length, size, moments' dtype) of every chunk compiled in this process: a graph each,
all of one function, whose graphs Dynamo caps (8 by default; past that it runs the function
uncompiled)."""


def _update_fn(device: torch.device):
    """adamw_updates, compiled on CUDA, for static shapes: Inductor sizes each kernel for
    its tensor."""
    global _compiled
    if device.type != "cuda":
        return adamw_updates
    if _compiled is None:
        _compiled = torch.compile(adamw_updates, dynamic=False, fullgraph=True)
    return _compiled


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's local part (its shard under FSDP2), flat, as a plain tensor: torchao's
    float8 all-gather wraps each weight's shard in a subclass around the fp32 tensor
    (`_tensor`), which is the one to update (the compiled update takes plain tensors).
    Detached: a parameter's view still requires grad under no_grad, and Dynamo guards on
    that (the update is compiled on these views, at step() as when it was made)."""
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
        # The chunks of each list of parameters updated (by their ids): the same every step.
        self._chunks: dict[tuple[int, ...], list[list[int]]] = {}
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self.device = torch.device("cpu") if first is None else _local(first).device
        # The update is compiled here rather than at the first step: the trainer counts the
        # graphs its warm-up made, and one made later reads as a recompile.
        if _update_fn(self.device) is not adamw_updates:
            self._compile()

    def _compile(self) -> None:
        """Compiles the update of each chunk on its own tensors, with a skip: nothing
        changes. Zeros stand in for the gradients (a group's fp32 parameters' worth of
        memory for a moment, before training allocates anything, handed back to the driver
        after). Under no_grad, as step() calls it: Dynamo guards on the grad mode, and on
        which arguments are one tensor (the scale and the skip are two)."""
        from pytrain.train.compile_policy import ensure_graph_room

        _signatures.update((len(c), _local(g["params"][c[0]]).numel(), self.state_dtype)
                           for g in self.param_groups for c in self._chunks_of(g["params"]))  # fmt: skip
        ensure_graph_room(len(_signatures))
        scale, skip = (torch.ones((), device=self.device) for _ in range(2))
        with torch.no_grad():
            for i, group in enumerate(self.param_groups):
                zeros = [torch.zeros_like(_local(p)) for p in group["params"]]
                self._update(i, group, group["params"], zeros, scale, skip)
                del zeros
        torch.cuda.empty_cache()

    def _update(self, i: int, group: dict, params: list, grads: list, scale, skip) -> None:
        """Updates group i's `params` (with these gradients), a compiled call a chunk."""
        update = _update_fn(self.device)
        hyper = self._hyper_of(i, group)
        for c in self._chunks_of(params):
            states = [self.state[params[j]] for j in c]
            update(
                [_local(params[j]) for j in c],
                [_local(grads[j]) for j in c],
                [_local(st["exp_avg"]) for st in states],
                [_local(st["exp_avg_sq"]) for st in states],
                [st["step"] for st in states],
                hyper,
                scale,
                skip,
            )

    def _chunks_of(self, params: list) -> list[list[int]]:
        """chunks() of these parameters' local lengths, worked out once."""
        key = tuple(map(id, params))
        if key not in self._chunks:
            self._chunks[key] = chunks([_local(p).numel() for p in params])
        return self._chunks[key]

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
        scale = torch.ones((), device=device) if self.grad_scale is None else self.grad_scale
        skip = torch.zeros((), device=device) if self.found_inf is None else self.found_inf
        scale, skip = scale.float(), skip.float()
        for i, group in enumerate(self.param_groups):
            # Where some parameters have no gradient, their chunks may be other graphs
            # (compiled then): a model whose parameters all learn has none.
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(i, group, params, [p.grad for p in params], scale, skip)
        return None
