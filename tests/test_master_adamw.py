"""pytrain.optim.master_adamw: AdamW over fp32 masters of bf16 parameters. The torch path
against torch.optim.AdamW on fp32 parameters (clipping, weight-decay groups, a skipped
step), the Triton kernels against the torch path through Triton's interpreter (in a
subprocess: TRITON_INTERPRET is read at import), and the trainer with master weights on
CPU (exact resume with accumulation, fp32 weights in the checkpoint)."""

import textwrap

import pytest
import torch

from pytrain.optim import adamw as optim
from pytrain.optim.master_adamw import MasterAdamW
from pytrain.train import checkpoint
from pytrain.train.checkpoint import CheckpointMismatch
from tests.test_trainer import small_cfg
from tests.triton_interpreter import assert_passes_in_interpreter

SHAPES = [(40, 30), (3000,), (7,)]


def setup(seed=0, use_triton=False, state_dtype=torch.float32):
    """bf16-exact initial values, so the masters and the fp32 reference start equal."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).bfloat16().float() for s in SHAPES]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    groups = [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0},
    ]
    opt = MasterAdamW(
        groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, use_triton=use_triton, state_dtype=state_dtype
    )
    return params, init, opt


def step_grads(step: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).bfloat16() for s in SHAPES]


def test_parameters_become_bf16_views_of_one_buffer_with_fp32_masters():
    params, init, opt = setup()
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(p.untyped_storage().data_ptr() == opt.flat_param.data_ptr() for p in params)
    torch.testing.assert_close(opt.master, torch.cat([x.flatten() for x in init]), rtol=0, atol=0)


@pytest.mark.parametrize("grad_scale", [0.01, 30.0])  # below and above the clip
def test_step_equals_torch_adamw_with_clipping_groups_and_a_skip(grad_scale):
    params, init, opt = setup()
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    ref_opt = torch.optim.AdamW(
        [
            {"params": ref[:2], "weight_decay": 0.1},
            {"params": ref[2:], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step in range(5):
        grads = step_grads(step, grad_scale)
        skip = step == 2
        for p, r, g in zip(params, ref, grads, strict=True):
            p.grad, r.grad = g.clone(), g.float()
        norm = opt.grad_norm()
        torch.testing.assert_close(norm, torch.nn.utils.get_total_norm([r.grad for r in ref]))
        optim.fused_step(opt, torch.tensor(skip), norm, max_norm=1.0)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        if not skip:
            ref_opt.step()
    want = torch.cat([r.detach().flatten() for r in ref])
    torch.testing.assert_close(opt.master, want, rtol=1e-5, atol=1e-6)
    assert float(opt.step_t) == 4.0  # the skipped step is not counted
    # The bf16 parameters are the masters, rounded.
    torch.testing.assert_close(opt.flat_param, opt.master.bfloat16(), rtol=0, atol=0)
    moved = (opt.master - torch.cat([x.flatten() for x in init])).abs().max()
    assert float(moved) > 1e-3


def test_accumulation_sums_micro_batches_in_fp32_and_drops_their_grads():
    params, _, opt = setup()
    micro = [step_grads(s) for s in range(3)]
    for grads in micro:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.accumulate()
        assert all(p.grad is None for p in params)
    want = sum(torch.cat([g.float().flatten() for g in grads]) for grads in micro)
    torch.testing.assert_close(opt.flat_grad, want, rtol=0, atol=0)
    torch.testing.assert_close(opt.grad_norm(), torch.linalg.vector_norm(want))


def test_state_round_trip_and_masters_in_the_model_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied, as the GPT's embedding and head
    groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    opt = MasterAdamW(groups, lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state, masters = opt.state_dict(), opt.master_state(model)
    assert masters["1.weight"].dtype == torch.float32
    assert masters["0.weight"].data_ptr() == masters["1.weight"].data_ptr()
    fresh_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fresh_model[1].weight = fresh_model[0].weight
    fresh = MasterAdamW([{"params": list(fresh_model.parameters()), "weight_decay": 0.0}], lr=0.1)
    fresh.load_state_dict(state)
    fresh.load_masters(fresh_model, masters)
    for a, b in ((fresh.master, opt.master), (fresh.exp_avg_sq, opt.exp_avg_sq)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(fresh.step_t) == 1.0
    other = MasterAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0}], lr=1)
    with pytest.raises(ValueError, match="does not match the model"):
        other.load_state_dict(state)


def test_master_weights_option_is_checked():
    cpu = torch.device("cpu")
    cuda = torch.device("cuda")
    assert optim.use_master_weights("on", cpu, torch.bfloat16, False)
    assert not optim.use_master_weights("auto", cpu, torch.bfloat16, False)  # CUDA only
    assert optim.use_master_weights("auto", cuda, torch.bfloat16, False)
    assert not optim.use_master_weights("auto", cuda, torch.bfloat16, True)  # FSDP2's own
    with pytest.raises(ValueError, match="needs precision bf16 and no FSDP2"):
        optim.use_master_weights("on", cpu, None, False)
    with pytest.raises(ValueError, match="needs precision bf16 and no FSDP2"):
        optim.use_master_weights("on", cpu, torch.bfloat16, True)
    with pytest.raises(ValueError, match="expected auto, on or off"):
        optim.use_master_weights("yes", cpu, torch.bfloat16, False)


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from tests.test_master_adamw import setup, step_grads
    from pytrain.optim import adamw as optim
    runs = []
    for use_triton in (False, True):
        params, _, opt = setup(use_triton=use_triton, state_dtype=STATE)
        for step in range(4):
            micro = 2 if step == 1 else 1
            for _ in range(micro):
                for p, g in zip(params, step_grads(step)):
                    p.grad = g.clone()
                if micro > 1:
                    opt.accumulate()
            optim.fused_step(opt, torch.tensor(step == 2), opt.grad_norm(), 1.0)
        runs.append((opt.master.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone(), opt.step_t.clone()))
        # The interpreter truncates to bf16 where the GPU rounds (tests/test_gpu.py: equal).
        torch.testing.assert_close(opt.flat_param, opt.master.bfloat16(), rtol=2**-7, atol=0)
    assert runs[1][1].dtype == STATE
    # bf16 moments: the interpreter truncates where torch rounds, one bf16 step apart.
    tol = {"rtol": 1e-5, "atol": 1e-7} if STATE == torch.float32 else {"rtol": 2**-6, "atol": 2e-4}
    for a, b in zip(*runs):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    print("kernel ok")
    """
)


@pytest.mark.parametrize("state", ["float32", "bfloat16"])
def test_triton_kernels_match_the_torch_path_in_the_interpreter(state):
    assert_passes_in_interpreter(f"import torch\nSTATE = torch.{state}\n" + KERNEL_CHECK)


def test_bf16_moments_follow_fp32_moments():
    """optim.state_dtype=bf16: the moments are stored in bf16 (half their memory), the
    update computes in fp32; 30 steps move the masters as fp32 moments do, within a few
    percent of the distance they travel."""
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params, init, opt = setup(state_dtype=dtype)
        for step in range(30):
            for p, g in zip(params, step_grads(step), strict=True):
                p.grad = g.clone()
            optim.fused_step(opt, torch.tensor(False), opt.grad_norm(), 1.0)
        assert opt.exp_avg.dtype == opt.exp_avg_sq.dtype == dtype
        assert opt.state_dict()["exp_avg"].dtype == dtype
        runs[dtype] = opt.master.clone()
    start = torch.cat([x.flatten() for x in init])
    travelled = (runs[torch.float32] - start).abs().max().item()
    apart = (runs[torch.bfloat16] - runs[torch.float32]).abs().max().item()
    assert travelled > 0.2 and apart < 0.03 * travelled, (travelled, apart)


def test_trainer_with_master_weights_resumes_exactly_and_saves_fp32_weights(small_corpus, tmp_path):
    from pytrain.train.trainer import Trainer

    extra = ("--precision", "bf16", "--optim.master_weights", "on", "--optim.grad_accum", "2")
    full = Trainer(small_cfg(small_corpus, tmp_path / "a", *extra))
    assert all(p.dtype == torch.bfloat16 for p in full.gpt.parameters())
    want = full.fit()["losses"]
    full.close()
    assert len(want) == 12 and want[-1] < want[0]
    first = Trainer(small_cfg(small_corpus, tmp_path / "b", *extra, "--halt_after", "5"))
    got = first.fit()["losses"]
    first.close()
    second = Trainer(small_cfg(small_corpus, tmp_path / "b", *extra))
    assert second.step == 5
    got += second.fit()["losses"]
    second.close()
    assert got == want  # bit for bit
    ckpt = checkpoint.read(sorted((tmp_path / "b" / "runs" / "t").glob("ckpt-*.pt"))[-1])
    weights = [v for k, v in ckpt["model"].items() if k.endswith("weight")]
    assert weights and all(v.dtype == torch.float32 for v in weights)
    # bf16 moments (optim.state_dtype): the same exact resume, the moments saved in bf16.
    bf16 = (*extra, "--optim.state_dtype", "bf16")
    losses = []
    for where, more in (("c", ()), ("d", ("--halt_after", "5")), ("d", ())):
        t = Trainer(small_cfg(small_corpus, tmp_path / where, *bf16, *more))
        losses.append(t.fit()["losses"])
        t.close()
    assert losses[1] + losses[2] == losses[0]
    saved = checkpoint.read(sorted((tmp_path / "d" / "runs" / "t").glob("ckpt-*.pt"))[-1])
    assert saved["optimizer"]["exp_avg"].dtype == torch.bfloat16
    # Without master weights (fp32 parameters) CompactAdamW keeps the bf16 moments.
    compact = Trainer(small_cfg(small_corpus, tmp_path / "e", "--optim.state_dtype", "bf16"))
    assert type(compact.optimizer).__name__ == "CompactAdamW"
    compact.close()
    # The optimizer state differs between the modes: resuming in the other one is refused.
    other = [a if a != "on" else "off" for a in extra]
    with pytest.raises(CheckpointMismatch, match="resume it with --optim.master_weights on"):
        Trainer(small_cfg(small_corpus, tmp_path / "b", *other))
