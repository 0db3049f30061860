"""pytrain.model.fused_swiglu: the op's gradient, the model with it on against off, and its
Triton kernels against the torch path under Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess: the variable is read at import)."""

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pytrain.config import ConfigError
from pytrain.model import fused_swiglu, quack_swiglu
from pytrain.model.config import ModelConfig
from tests.model_grads import assert_same_loss_and_grads, loss_and_grads
from tests.triton_interpreter import assert_passes_in_interpreter


def unfused(u):
    a, b = u.chunk(2, dim=-1)
    return F.silu(a) * b


def test_swiglu_gradient_is_exact_in_fp64():
    u = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused_swiglu.swiglu, (u,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_silu_times_up_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(0)
    u = (torch.randn(4, 7, 2 * 40, generator=g) * 3).to(dtype)
    grad = torch.randn(4, 7, 40, generator=g).to(dtype)
    ua, ub = u.clone().requires_grad_(), u.clone().requires_grad_()
    want, got = unfused(ua.float()), fused_swiglu.swiglu(ub)
    want.backward(grad.float())
    got.backward(grad)
    assert got.dtype == dtype and ub.grad is not None and ub.grad.dtype == dtype
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(ub.grad.float(), ua.grad.float(), **tol)


def test_swiglu_compiles_as_one_graph():
    """Dynamo traces the op and its backward without a graph break."""
    u = torch.randn(6, 24)
    ua, ub = u.clone().requires_grad_(), u.clone().requires_grad_()
    compiled = torch.compile(fused_swiglu.swiglu, backend="aot_eager", fullgraph=True)
    (compiled(ub) ** 2).sum().backward()
    (unfused(ua) ** 2).sum().backward()
    torch.testing.assert_close(ub.grad, ua.grad)


def test_gpt_loss_and_gradients_are_the_same_fused_or_not(monkeypatch):
    """A SwiGLU model's loss and every parameter's gradient with fused_swiglu on equal those
    with it off (fp32 on CPU), and 'on' went through the op once per layer."""
    calls = []
    real = fused_swiglu.swiglu
    monkeypatch.setattr(fused_swiglu, "swiglu", lambda u: calls.append(1) or real(u))
    out = {choice: loss_and_grads(mlp="swiglu", fused_swiglu=choice) for choice in ("off", "on")}
    assert len(calls) == 2  # "on": one call per layer; "off": none
    assert_same_loss_and_grads(out["on"], out["off"])


def test_fused_swiglu_under_activation_checkpointing(monkeypatch):
    """The Llama presets recompute blocks (llama-3b: full) with the fused op on: the
    recomputed forward goes through the op again, and loss and gradients equal the model's
    without checkpointing and without the op."""
    calls = []
    real = fused_swiglu.swiglu
    monkeypatch.setattr(fused_swiglu, "swiglu", lambda u: calls.append(1) or real(u))
    got = loss_and_grads(checkpoint_every=1, mlp="swiglu", fused_swiglu="on")
    assert len(calls) == 4  # two layers, each run in the forward and again in the backward
    assert_same_loss_and_grads(got, loss_and_grads(mlp="swiglu", fused_swiglu="off"))


def test_fused_swiglu_choices():
    """'auto' stays off on the CPU, 'on' needs a SwiGLU MLP, and evaluation never uses it."""
    cpu = torch.device("cpu")
    assert not fused_swiglu.used(ModelConfig(mlp="swiglu", fused_swiglu="auto"), cpu)
    assert fused_swiglu.used(ModelConfig(mlp="swiglu", fused_swiglu="on"), cpu)
    assert not fused_swiglu.used(ModelConfig(mlp="gelu", fused_swiglu="auto"), cpu)
    with pytest.raises(ValueError, match="fused_swiglu=on needs model.mlp=swiglu"):
        ModelConfig(mlp="gelu", fused_swiglu="on").check()
    with pytest.raises(ValueError, match="model.fused_swiglu is 'yes'"):
        ModelConfig(fused_swiglu="yes").check()
    with pytest.raises(ValueError, match="odd"):
        fused_swiglu.swiglu(torch.randn(2, 5))


def test_quack_swiglu_choices(monkeypatch):
    """'quack' runs only on CUDA, needs a SwiGLU MLP and plain linear layers, and where it
    cannot run the trainer's check says why in one line; 'auto' takes it where it runs, in
    bf16/fp16 with float8 off, and inside a trace only where the check ran before."""
    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda", 0), torch.bfloat16
    cfg = ModelConfig(mlp="swiglu", fused_swiglu="quack")
    cfg.check()
    assert not fused_swiglu.used(cfg, cpu) and not fused_swiglu.used(cfg, cuda)
    assert quack_swiglu.used(cfg, cuda, bf16) and not quack_swiglu.used(cfg, cpu, bf16)
    with pytest.raises(
        ConfigError, match=r"^model.fused_swiglu=quack needs a CUDA GPU \(here cpu\)"
    ):
        quack_swiglu.check(cfg, cpu, bf16)
    with pytest.raises(ValueError, match="fused_swiglu=quack needs model.mlp=swiglu"):
        ModelConfig(mlp="gelu", fused_swiglu="quack").check()
    with pytest.raises(ValueError, match="fused_swiglu=quack needs model.float8=off"):
        ModelConfig(mlp="swiglu", fused_swiglu="quack", float8="rowwise").check()
    # 'auto': a GPU where quack runs (device 0 known to run it) and one where it does not.
    auto = ModelConfig(mlp="swiglu", fused_swiglu="auto")
    assert quack_swiglu.check(auto, cpu, torch.float32) is False
    monkeypatch.setattr(quack_swiglu, "_why", {0: "", 1: "quack-kernels does not import"})
    assert quack_swiglu.check(auto, cuda, bf16) is True
    assert not quack_swiglu.used(auto, torch.device("cuda", 1), bf16)
    assert not quack_swiglu.used(auto, cuda, torch.float32)
    fp8 = ModelConfig(mlp="swiglu", fused_swiglu="auto", float8="tensorwise")
    assert not quack_swiglu.used(fp8, cuda, bf16)
    assert not quack_swiglu.used(ModelConfig(mlp="swiglu", fused_swiglu="on"), cuda, bf16)
    odd = ModelConfig(mlp="swiglu", fused_swiglu="auto", d_model=100, n_head=4)
    assert not quack_swiglu.used(odd, cuda, bf16)  # quack's rows need 16 bytes
    odd.fused_swiglu = "quack"
    with pytest.raises(ConfigError, match="needs model.d_model a multiple of 8 \\(here 100\\)"):
        quack_swiglu.check(odd, cuda, bf16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert quack_swiglu.used(auto, cuda, bf16)  # checked before the trace
    assert not quack_swiglu.used(auto, torch.device("cuda", 2), bf16)  # never checked


@pytest.mark.parametrize("where, runs", [("lib/python3.12/site-packages", True),
                                         ("usr/lib/python3/dist-packages", True),
                                         ("opt/gpu-wheels", False)])  # fmt: skip
def test_quack_needs_the_cute_dsl_where_pip_installs_it(tmp_path, monkeypatch, where, runs):
    """quack keys the CuTe DSL as a library only under site-packages: installed elsewhere
    (pip --target DIR on PYTHONPATH) its MLP would stop the first step, so it is not taken,
    and the reason names the directory (here a `cutlass` package found, not imported)."""
    package = tmp_path / where / "cutlass"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('found, never imported')\n")
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / where))
    why = quack_swiglu.dsl_outside_site_packages()
    assert (why == "") is runs, why
    if not runs:
        assert why.startswith("needs the CuTe DSL installed under a site-packages directory")
        assert f"(here {package})" in why
    # 'auto' says so at the start where quack imports (device 0 here), and nothing for the
    # GPU's or the config's own reasons (device 1), or where it was not asked for.
    auto = ModelConfig(mlp="swiglu", fused_swiglu="auto")
    monkeypatch.setattr(quack_swiglu, "_why", {0: why, 1: "needs a Hopper or Blackwell GPU"})
    assert quack_swiglu.auto_note(auto, torch.device("cuda", 0)) == why
    assert quack_swiglu.auto_note(auto, torch.device("cuda", 1)) == ""
    on = ModelConfig(mlp="swiglu", fused_swiglu="on")
    assert quack_swiglu.auto_note(on, torch.device("cuda", 0)) == ""


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from pytrain.model import fused_swiglu as fs
    g = torch.Generator().manual_seed(0)
    # H below, at and above one block (1024), so that the masked tail runs.
    for dtype, rows, hidden in ((torch.float32, 3, 40), (torch.float32, 2, 1030),
                                (torch.bfloat16, 5, 1024), (torch.bfloat16, 2, 1500)):
        u = (torch.randn(rows, 2 * hidden, generator=g) * 3).to(dtype)
        grad = torch.randn(rows, hidden, generator=g).to(dtype)
        # bf16: one rounding step apart at most (the interpreter rounds towards zero where
        # the GPU and torch round to nearest).
        tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
        h = fs._swiglu_triton(u)
        torch.testing.assert_close(h, fs._swiglu_torch(u), **tol)
        du = fs._swiglu_backward_triton(u, grad)
        torch.testing.assert_close(du, fs._swiglu_backward_torch(u, grad), **tol)
        # a (batch, time, 2 H) input keeps its leading dimensions
        h3 = fs._swiglu_triton(u.view(1, rows, 2 * hidden))
        assert h3.shape == (1, rows, hidden) and torch.equal(h3[0], h)
    print("kernel ok")
    """
)


def test_triton_kernels_match_the_torch_path_in_the_interpreter():
    assert_passes_in_interpreter(KERNEL_CHECK)
