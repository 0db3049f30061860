"""pytrain.model.fused_ce: the output layer + cross-entropy op against torch's own, on CPU
(the torch path), and its Triton kernel against the torch path through Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess: the variable is read at import)."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from pytrain.model import fused_ce
from pytrain.model.gpt import GPT, ModelConfig
from tests.triton_interpreter import assert_passes_in_interpreter


def reference(x, w, targets):
    return F.cross_entropy(x.float() @ w.float().t(), targets, ignore_index=-100, reduction="sum")


def inputs(n=48, c=24, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = torch.randn(v, c, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = fused_ce.IGNORE_INDEX
    return x, w, t


def grads(fn, x, w, t, scale):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(x, w, t)
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


def test_linear_cross_entropy_equals_torch_loss_and_gradients():
    x, w, t = inputs()
    want = grads(reference, x, w, t, scale=0.37)
    got = grads(fused_ce.linear_cross_entropy, x, w, t, scale=0.37)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(want[1][::7].abs().max()) == 0.0  # ignored rows get no gradient


def test_linear_cross_entropy_compiles_as_one_graph():
    """Dynamo traces the op without a graph break (fullgraph=True raises on one)."""
    x, w, t = inputs()
    compiled = torch.compile(fused_ce.linear_cross_entropy, backend="aot_eager", fullgraph=True)
    want = grads(reference, x, w, t, scale=1.0)
    got = grads(compiled, x, w, t, scale=1.0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gpt_training_loss_is_the_same_fused_or_not(monkeypatch):
    """The model's summed, masked loss and its parameter gradients with fused_ce on equal
    those with it off (fp32 on CPU)."""
    calls = []
    real = fused_ce.linear_cross_entropy
    monkeypatch.setattr(fused_ce, "linear_cross_entropy", lambda *a: calls.append(1) or real(*a))
    out = {}
    for choice in ("off", "on"):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=200, n_layer=2, n_head=2, d_model=32, fused_ce=choice)
        m = GPT(cfg).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 200, (2, 16), generator=g)
        targets = torch.randint(0, 200, (2, 16), generator=g)
        keep = torch.rand(2, 16, generator=g) > 0.2
        loss = m.loss_sum(ids, targets, None, keep, None)
        loss.backward()
        out[choice] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    assert len(calls) == 1  # "on" went through the fused op, "off" did not
    torch.testing.assert_close(out["on"][0], out["off"][0], rtol=1e-5, atol=1e-5)
    for name, grad in out["off"][1].items():
        torch.testing.assert_close(out["on"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ce_grad_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits"):
        fused_ce.ce_grad_(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        fused_ce.ce_grad_(torch.zeros(5, 4).t(), torch.zeros(4, dtype=torch.long))


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from pytrain.model import fused_ce
    g = torch.Generator().manual_seed(0)
    for dtype, v, block in ((torch.float32, 301, 0), (torch.float32, 1000, 256),
                            (torch.bfloat16, 1000, 128), (torch.bfloat16, 37, 0)):
        logits = (torch.randn(12, v, generator=g) * 4).to(dtype)
        t = torch.randint(0, v, (12,), generator=g)
        t[5] = fused_ce.IGNORE_INDEX
        a, b = logits.clone(), logits.clone()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        la = fused_ce._ce_grad_torch(a, t)
        lb = fused_ce._ce_grad_triton(b, t, block=block)
        ref = F.cross_entropy(logits.float(), t, ignore_index=-100, reduction="none")
        torch.testing.assert_close(lb, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=tol)
        assert float(b[5].float().abs().max()) == 0.0
    print("kernel ok")
    """
)


def test_triton_kernel_matches_the_torch_path_in_the_interpreter():
    assert_passes_in_interpreter(KERNEL_CHECK)
