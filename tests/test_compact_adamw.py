"""CompactAdamW (pytrain/optim/compact_adamw.py): AdamW over fp32 parameters with the moments
stored in bf16; against torch.optim.AdamW, through clipping and a skipped step, its state
loaded by either optimizer, and its compiled update equal to the eager one."""

from __future__ import annotations

import copy

import pytest
import torch

from pytrain.optim import compact_adamw
from pytrain.optim.compact_adamw import CHUNK, CompactAdamW, adamw_updates, chunks


def model_and_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 4)
    )
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(5)]
    return model, grads


def groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def set_lr(opt, i: int) -> None:
    """A schedule's learning rate for step i, as the trainer sets it each step."""
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (1 + i) / 5


def run(opt, model, grads, scales=None, skips=None):
    for i, gs in enumerate(grads):
        set_lr(opt, i)
        for p, g in zip(model.parameters(), gs, strict=True):
            p.grad = g.clone()
        if scales is not None:
            opt.grad_scale = torch.tensor(scales[i])
            opt.found_inf = torch.tensor(float(skips[i]))
        opt.step()


def test_fp32_moments_follow_torch_adamw_through_clipping_and_a_skip():
    ours_model, grads = model_and_grads()
    theirs_model = copy.deepcopy(ours_model)
    ours = CompactAdamW(groups(ours_model), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.float32)
    theirs = torch.optim.AdamW(groups(theirs_model), lr=1e-2, betas=(0.9, 0.95))
    scales, skips = [1.0, 2.5, 1.0, 4.0, 1.0], [0, 0, 1, 0, 0]
    run(ours, ours_model, grads, scales, skips)
    # torch's: the gradients divided by the scale, the skipped step not taken.
    for i, gs in enumerate(grads):
        if skips[i]:
            continue
        set_lr(theirs, i)
        for p, g in zip(theirs_model.parameters(), gs, strict=True):
            p.grad = g / scales[i]
        theirs.step()
    for a, b in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for p in ours_model.parameters():
        assert float(ours.state[p]["step"]) == 4.0  # the skip left the counts alone


def test_bf16_moments_are_stored_in_bf16_and_stay_near_fp32s():
    model, grads = model_and_grads(1)
    wide = copy.deepcopy(model)
    ours = CompactAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    ref = CompactAdamW(groups(wide), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.float32)
    run(ours, model, grads[:1])
    run(ref, wide, grads[:1])
    p0 = next(model.parameters())
    st, ref_st = ours.state[p0], ref.state[next(wide.parameters())]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    assert p0.dtype == torch.float32
    # After one step each moment is the fp32 one rounded to nearest once.
    assert torch.equal(st["exp_avg"], ref_st["exp_avg"].bfloat16())
    assert torch.equal(st["exp_avg_sq"], ref_st["exp_avg_sq"].bfloat16())
    run(ours, model, grads[1:])
    run(ref, wide, grads[1:])
    for a, b in zip(model.parameters(), wide.parameters(), strict=True):
        assert not torch.equal(a, b)  # the rounding shows ...
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # ... within a few steps' lr


def test_its_state_loads_into_torch_adamw_and_back():
    model, grads = model_and_grads(2)
    ours = CompactAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    run(ours, model, grads[:3])
    saved = copy.deepcopy(ours.state_dict())
    theirs = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    theirs.load_state_dict(saved)
    p0 = next(model.parameters())
    assert theirs.state[p0]["exp_avg"].dtype == torch.float32
    assert torch.equal(theirs.state[p0]["exp_avg"], ours.state[p0]["exp_avg"].float())
    back = CompactAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert back.state[p0]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(back.state[p0]["exp_avg_sq"], ours.state[p0]["exp_avg_sq"])
    assert float(back.state[p0]["step"]) == 3.0


def test_loading_keeps_the_moments_it_is_given_and_never_casts_them_all_to_fp32(monkeypatch):
    """A resume (DCP reads into the optimizer's own tensors, then set_state_dict loads them):
    the moments stay those very bf16 tensors, with no fp32 copy of them made on the way
    (torch's loading would cast every one to the parameters' dtype first: 8 bytes a
    parameter at once); the groups' hyperparameters and step counts load as torch loads
    them, and training goes on as the saved optimizer's would."""
    model, grads = model_and_grads(4)
    ours = CompactAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    run(ours, model, grads[:3])
    saved = copy.deepcopy(ours.state_dict())  # the tensors DCP would have read into
    saved["param_groups"][0]["lr"] = 0.5
    after = copy.deepcopy(model)
    back = CompactAdamW(groups(after), lr=1e-2, betas=(0.9, 0.95))
    upcasts = []
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):  # any cast of a bf16 tensor to fp32
        out = real_to(t, *args, **kwargs)
        if t.dtype == torch.bfloat16 and out.dtype == torch.float32:
            upcasts.append(t.shape)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    back.load_state_dict(saved)
    monkeypatch.undo()
    assert upcasts == []
    for g_saved, g in zip(saved["param_groups"], back.param_groups, strict=True):
        for i, p in zip(g_saved["params"], g["params"], strict=True):  # ids in the groups' order
            for k in ("exp_avg", "exp_avg_sq"):
                assert back.state[p][k] is saved["state"][i][k]
            assert float(back.state[p]["step"]) == 3.0
    assert back.param_groups[0]["lr"] == 0.5
    run(ours, model, grads[3:])
    run(back, after, grads[3:])
    for a, b in zip(model.parameters(), after.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_float8_all_gathered_weight_is_updated_in_its_fp32_tensor():
    """Under FSDP2 with float8 all-gathers, torchao wraps each weight's shard in a subclass
    around its fp32 tensor: the update lands there, as on a plain parameter."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    from torchao.float8.float8_training_tensor import LinearMMConfig

    torch.manual_seed(0)
    w, g = torch.randn(8, 4), torch.randn(8, 4)
    wrapped = fsdp_utils.WeightWithDynamicFloat8CastTensor(
        w.clone(), LinearMMConfig(), torch.float8_e4m3fn
    )
    params = [torch.nn.Parameter(wrapped), torch.nn.Parameter(w.clone())]
    for p in params:
        opt = CompactAdamW([p], lr=0.1)
        p.grad = g.clone()
        opt.step()
        assert float(opt.state[p]["step"]) == 1.0
    assert not torch.equal(wrapped._tensor, w)
    assert torch.equal(wrapped._tensor, params[1].data)
    # What the (compiled, on CUDA) update is given: the plain fp32 tensor itself.
    local = compact_adamw._local(params[0])
    assert type(local) is torch.Tensor and local.data_ptr() == wrapped._tensor.data_ptr()


@pytest.mark.slow  # Inductor compiles C++ kernels
def test_the_compiled_update_of_a_group_equals_the_eager_one():
    """The update of a group's tensors in one compiled call (each its own size) equals the
    eager update, a skipped step included."""
    compiled = torch.compile(adamw_updates, dynamic=False, fullgraph=True)
    hyper = torch.tensor([1e-2, 0.1, 0.9, 0.95, 1e-8])
    sizes = (1000, 37, 4096)
    for skip in (0.0, 1.0):
        torch.manual_seed(int(skip))
        args = [
            [torch.randn(n) for n in sizes],
            [torch.randn(n) for n in sizes],
            [(0.1 * torch.randn(n)).bfloat16() for n in sizes],
            [(0.1 * torch.rand(n)).bfloat16() for n in sizes],
            [torch.tensor(3.0) for _ in sizes],
        ]
        mine = [[t.clone() for t in ts] for ts in args]
        before = [t.clone() for t in args[0]]
        adamw_updates(*args, hyper, torch.tensor(2.0), torch.tensor(skip))
        compiled(*mine, hyper, torch.tensor(2.0), torch.tensor(skip))
        for ts, us in zip(args, mine, strict=True):
            for a, b in zip(ts, us, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert [float(t) for t in args[4]] == [3.0 if skip else 4.0] * len(sizes)
        assert all(torch.equal(a, b) for a, b in zip(args[0], before, strict=True)) == bool(skip)


def test_chunks_hold_tensors_of_one_size_chunk_at_most():
    sizes = [5, 7, 5, *[9] * (2 * CHUNK + 3), 7, 1]
    got = chunks(sizes)
    assert sorted(i for c in got for i in c) == list(range(len(sizes)))  # each once
    assert all(len({sizes[i] for i in c}) == 1 for c in got)
    assert [len(c) for c in got] == [2, 2, CHUNK, CHUNK, 3, 1]
    assert chunks([]) == []


def test_a_call_a_chunk_and_its_steps_make_no_graph_after_those_made_with_it(monkeypatch):
    """The update as step() calls it (under no_grad, on views of parameters that require
    grad) meets the guards of the graphs compiled when the optimizer is made: a graph more
    would read as a recompile after the trainer's warm-up. Each chunk of tensors of one
    size is one call at every step (one a tensor held the device waiting on the host).
    Dynamo's guards, not Inductor's code, decide this, so the eager backend stands in for
    CUDA's."""
    from pytrain.train.compile_policy import compiled_graphs

    torch._dynamo.reset()
    compiled = torch.compile(adamw_updates, dynamic=False, fullgraph=True, backend="eager")
    calls: list[int] = []

    def counted(*args):
        calls.append(len(args[0]))
        return compiled(*args)

    monkeypatch.setattr(compact_adamw, "_update_fn", lambda device: counted)
    for dtype in (torch.float32, torch.bfloat16):
        model, grads = model_and_grads()
        first = [p.detach().clone() for p in model.parameters()]
        opt = CompactAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), state_dtype=dtype)
        # Compiling changed nothing: the weights, the moments and the step counts.
        assert all(torch.equal(a, b) for a, b in zip(first, model.parameters(), strict=True))
        assert all(
            float(st["step"]) == 0.0 and not st["exp_avg"].any() for st in opt.state.values()
        )
        graphs = compiled_graphs()
        run(opt, model, grads, scales=[1.0, 2.0, 1.0, 1.0, 1.0], skips=[0, 0, 1, 0, 0])
        assert compiled_graphs() == graphs, dtype
        assert float(opt.state[next(model.parameters())]["step"]) == 4.0
        # weights of 240 and 80; biases and the norm's two vectors of 20, a bias of 4
        assert calls == [1, 1, 3, 1] * 6, calls  # when made, then at each of the 5 steps
        calls.clear()


def test_more_chunk_shapes_than_dynamos_default_of_8_graphs_all_stay_compiled(monkeypatch):
    """Each (length, size, moments' dtype) is a graph of one function, which Dynamo caps at
    8 by default and then runs uncompiled, silently: the optimizer makes room for them."""
    import torch._dynamo.config as dynamo_config

    from pytrain.train.compile_policy import compiled_graphs

    torch._dynamo.reset()
    monkeypatch.setattr(compact_adamw, "_signatures", set())
    compiled = torch.compile(adamw_updates, dynamic=False, fullgraph=True, backend="eager")
    monkeypatch.setattr(compact_adamw, "_update_fn", lambda device: compiled)
    params = [torch.nn.Parameter(torch.randn(n)) for n in range(3, 9)]  # six sizes
    graphs = compiled_graphs()
    # A config module's own patch: monkeypatch's undo would delete the setting.
    with dynamo_config.patch(recompile_limit=8):
        opts = [CompactAdamW(params, lr=1e-2, state_dtype=dtype)
                for dtype in (torch.bfloat16, torch.float32)]  # fmt: skip
        assert compiled_graphs() == graphs + 12
        for opt in opts:
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
        assert compiled_graphs() == graphs + 12  # every step met a graph compiled when made
    assert all(float(opts[1].state[p]["step"]) == 1.0 for p in params)


def test_the_8b_presets_shards_over_4_ranks_are_50_calls_of_7_graphs():
    """CHUNK's arithmetic for the 8B (its docstring), from the preset's own model on the meta
    device, split as FSDP2 splits it (benchmarks/optimizer.py, which times this step)."""
    from conftest import ROOT, load_script

    bench = load_script("benchmarks/optimizer.py", "optimizer_bench")
    sizes = bench.shard_sizes(ROOT / "configs/llama-8b.toml", 4)
    assert len(sizes) == 195 and sum(sizes) == 8_030_261_248 // 4
    got = chunks(sizes)
    assert len(got) == 50
    assert len({(len(c), sizes[c[0]]) for c in got}) == 7
