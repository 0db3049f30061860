"""The optimizer step the trainer uses with a fused AdamW: clipping folded into the
kernel's grad_scale and the guard's skip as found_inf (pytrain.optim.adamw.fused_step). CPU
torch has a fused AdamW with the same arguments, so this runs everywhere."""

import pytest
import torch

from pytrain.optim import adamw as optim


def params_and_grads(seed: int, grad_scale: float):
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (16,), (8, 8, 4)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [[torch.randn(s, generator=g) * grad_scale for s in shapes] for _ in range(4)]
    return params, grads


def run(folded: bool, max_norm: float, grad_scale: float, skip_at: int = -1):
    params, grads = params_and_grads(0, grad_scale)
    # A large eps makes the update depend on the gradient's scale, so clipping shows.
    opt = torch.optim.AdamW(params, lr=0.1, eps=1.0, weight_decay=0.1, fused=True)
    norms = []
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        skip = torch.tensor(i == skip_at)
        if folded:
            norm = optim.grad_norm(opt)
            optim.fused_step(opt, skip, norm, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if not bool(skip):
                opt.step()
        norms.append(float(norm))
    return [p.detach().clone() for p in params], norms, opt


@pytest.mark.parametrize("grad_scale", [0.01, 30.0])  # below and above the clip
def test_fused_step_equals_clip_grad_norm_then_step(grad_scale):
    want, want_norms, _ = run(folded=False, max_norm=1.0, grad_scale=grad_scale)
    got, got_norms, _ = run(folded=True, max_norm=1.0, grad_scale=grad_scale)
    assert got_norms == pytest.approx(want_norms, rel=1e-6)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_clipping_changes_the_update_here():
    """The comparison above can fail: without clipping, the same gradients move the
    weights elsewhere (so a fused step that ignored grad_scale would be caught)."""
    clipped, _, _ = run(folded=True, max_norm=1.0, grad_scale=30.0)
    unclipped, _, _ = run(folded=False, max_norm=float("inf"), grad_scale=30.0)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(clipped, unclipped, strict=True))


def test_fused_step_skip_leaves_weights_moments_and_step_count():
    skipped, _, opt = run(folded=True, max_norm=1.0, grad_scale=30.0, skip_at=3)
    applied, _, _ = run(folded=True, max_norm=1.0, grad_scale=30.0, skip_at=-1)
    # Step 3 skipped: weights and optimizer state equal a run of steps 0-2 only.
    three, _, opt3 = run_steps(3)
    for a, b in zip(skipped, three, strict=True):
        assert torch.equal(a, b)
    for p3, p in zip(opt3.param_groups[0]["params"], opt.param_groups[0]["params"], strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt3.state[p3][k], opt.state[p][k]), k
    assert any(not torch.equal(a, b) for a, b in zip(skipped, applied, strict=True))


def run_steps(n: int):
    params, grads = params_and_grads(0, 30.0)
    opt = torch.optim.AdamW(params, lr=0.1, eps=1.0, weight_decay=0.1, fused=True)
    for step_grads in grads[:n]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optim.fused_step(opt, torch.tensor(False), optim.grad_norm(opt), 1.0)
    return [p.detach().clone() for p in params], None, opt


def test_fused_step_refuses_an_unfused_optimizer():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="fused=True"):
        optim.fused_step(torch.optim.AdamW([p]), torch.tensor(False), torch.tensor(1.0), 1.0)
