"""pytrain.model.fused_gelu: the GELU MLP with its activation inside the matmuls. On CPU the
ops run their torch form (what the GPU's cuBLASLt epilogues are compared against in
tests/test_gpu.py); here: the ops' schemas and fake layouts, the MLP's gradients against
plain autograd, and where the model uses it."""

import pytest
import torch
import torch.nn.functional as F

from pytrain.model import fused_gelu
from pytrain.model.gpt import GPT, ModelConfig


def weights(n=40, c=16, h=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n // 2, c, generator=g, dtype=dtype)
    w_up = torch.randn(h, c, generator=g, dtype=dtype) / c**0.5
    w_down = torch.randn(c, h, generator=g, dtype=dtype) / h**0.5
    return x, w_up, w_down


def grads(fn, x, w_up, w_down, dy):
    x, w_up, w_down = (t.detach().requires_grad_() for t in (x, w_up, w_down))
    y = fn(x, w_up, w_down)
    y.backward(dy)
    return y.detach(), x.grad, w_up.grad, w_down.grad


def test_ops_pass_opcheck_with_their_column_major_outputs():
    """Schemas, fake tensors (shapes and the column-major strides the real ops return) and
    autograd registration, as torch.compile relies on them."""
    x, w_up, w_down = weights()
    x = x.flatten(0, 1)
    g, h = torch.ops.pytrain.gelu_up(x, w_up)
    assert g.shape == h.shape == (40, 64) and g.stride() == h.stride() == (1, 40)
    torch.library.opcheck(torch.ops.pytrain.gelu_up, (x, w_up))
    dy = torch.randn(40, 16)
    torch.library.opcheck(torch.ops.pytrain.dgelu_down, (dy, w_down, h))
    assert torch.ops.pytrain.dgelu_down(dy, w_down, h).stride() == (1, 40)


def test_mlp_equals_autograd_through_tanh_gelu():
    """Output and all three gradients equal those of down(gelu_tanh(up(x))) by autograd."""
    x, w_up, w_down = weights()
    dy = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(1))

    def plain(x, w_up, w_down):
        return F.gelu(x @ w_up.t(), approximate="tanh") @ w_down.t()

    want = grads(plain, x, w_up, w_down, dy)
    got = grads(lambda *a: fused_gelu.mlp(*a, torch.float32), x, w_up, w_down, dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mlp_in_bf16_returns_gradients_in_the_weights_dtype():
    """fp32 weights, bf16 compute (autocast's case): bf16 output, fp32 weight gradients
    close to the fp32 computation."""
    x, w_up, w_down = weights()
    dy = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(1))
    want = grads(lambda *a: fused_gelu.mlp(*a, torch.float32), x, w_up, w_down, dy)
    got = grads(lambda *a: fused_gelu.mlp(*a, torch.bfloat16), x, w_up, w_down, dy)
    assert got[0].dtype == torch.bfloat16
    assert got[2].dtype == got[3].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        assert float((a.float() - b).norm() / b.norm()) < 2e-2


def model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, mlp="gelu", **kw))


def test_model_trains_through_it_where_on_and_evaluates_with_erf_gelu(monkeypatch):
    """fused_gelu=on: training forwards call the fused MLP (gradients within tanh-vs-erf
    rounding of the plain model's); evaluation and no-grad forwards keep F.gelu."""
    calls = []
    real = fused_gelu.mlp
    monkeypatch.setattr(fused_gelu, "mlp", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    losses, grad_sets = [], []
    for choice in ("off", "on"):
        gpt = model(fused_gelu=choice).train()
        loss = gpt(ids[:, :-1]).logsumexp(-1).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        grad_sets.append([p.grad for p in gpt.parameters()])
    assert len(calls) == 2  # one per block, in the 'on' model only
    assert abs(losses[0] - losses[1]) < 1e-4
    for a, b in zip(*grad_sets, strict=True):
        assert float((a - b).norm() / b.norm().clamp(min=1e-12)) < 1e-2
    gpt.eval()
    with torch.no_grad():
        gpt(ids[:, :-1])
    gpt.train()
    with torch.no_grad():
        gpt(ids[:, :-1])
    assert len(calls) == 2


def test_where_auto_uses_it(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = ModelConfig(mlp="gelu", fused_gelu="auto")
    assert not fused_gelu.used(cfg, cpu, torch.bfloat16)  # no nvmath on CPU
    monkeypatch.setattr(fused_gelu, "_nvmath", lambda: True)
    monkeypatch.setattr(fused_gelu, "_check", lambda device: "")
    assert fused_gelu.used(cfg, cuda, torch.bfloat16)
    assert not fused_gelu.used(cfg, cuda, torch.float32)  # TF32 matmuls are faster
    fp8_blocks = ModelConfig(mlp="gelu", float8="tensorwise", fused_gelu="auto")
    assert not fused_gelu.used(fp8_blocks, cuda, torch.bfloat16)
    assert not fused_gelu.used(ModelConfig(mlp="swiglu", fused_gelu="auto"), cuda, torch.bfloat16)
    assert fused_gelu.used(ModelConfig(mlp="gelu", fused_gelu="on"), cpu, torch.float32)


@pytest.mark.parametrize("kw", [{"mlp": "swiglu"}, {"mlp": "gelu", "float8": "tensorwise"}])
def test_on_where_it_cannot_run_is_refused(kw):
    with pytest.raises(ValueError, match="model.fused_gelu=on needs model.mlp=gelu"):
        GPT(ModelConfig(fused_gelu="on", **kw))


def test_auto_runs_unfused_where_the_library_fails_and_says_why(monkeypatch):
    """nvmath-python importing but its cuBLASLt call failing (the library not loading; on a
    machine without CUDA the tiny matmul's tensors fail first) turns `auto` off for that
    device with the reason, instead of failing in the step."""
    cuda = torch.device("cuda", 0)
    cfg = ModelConfig(mlp="gelu", fused_gelu="auto")
    monkeypatch.setattr(fused_gelu, "_nvmath", lambda: False)
    assert "nvmath-python is not installed" in fused_gelu.why_not(cfg, cuda, torch.bfloat16)
    fp8_blocks = ModelConfig(mlp="gelu", float8="tensorwise", fused_gelu="auto")
    assert fused_gelu.why_not(fp8_blocks, cuda, torch.bfloat16) == ""  # not asked for there
    monkeypatch.setattr(fused_gelu, "_nvmath", lambda: True)
    monkeypatch.setattr(fused_gelu, "_checked", {})
    boom = RuntimeError("libcublasLt.so.13: cannot open shared object file")
    monkeypatch.setattr(fused_gelu, "_run", lambda *a, **k: (_ for _ in ()).throw(boom))
    assert not fused_gelu.used(cfg, cuda, torch.bfloat16)
    assert "cuBLASLt through nvmath-python failed here" in fused_gelu.why_not(
        cfg, cuda, torch.bfloat16
    )


def test_the_traced_path_asks_without_an_lru_cache_warning():
    """The model's forward asks `used` inside the compiled trace: the memo it reads must
    not be functools' (Dynamo warned, with a stack, in every run of the GPT-2 preset)."""
    import warnings

    fused_gelu._nvmath()  # known before the trace, as the trainer's start asks

    def step(x):
        return x * 2 if fused_gelu._nvmath() else x + 1

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.compile(step, backend="eager")(torch.ones(3))
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message) for w in seen]
