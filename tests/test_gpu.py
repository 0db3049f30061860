"""On a real GPU: a batch copied from a pinned slot to CUDA (tokens and doc ids only; the rest
derived there) equals the same batch prepared on the CPU, and the slot comes back once the
copy is done; `python -m pytrain.train` with evaluation, checkpoints and resume; the fused
output layer + loss (Triton) equals torch's; FlashAttention-4 (where installed) equals SDPA
with the document mask. Skipped without CUDA; on a CUDA machine,
`python -m pytest tests/test_gpu.py` runs them (each optional kernel's tests skip where its
library or GPU is missing)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pytrain import _loader, data
from pytrain.data import TokenLoader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fa4_available() -> bool:
    from pytrain.model import flash4

    return flash4.available()


needs_fa4 = pytest.mark.skipif(not fa4_available(), reason="needs flash-attn-4 on sm90/sm100")


@needs_cuda
def test_cuda_copy_equals_cpu_preparation(tmp_path: Path):
    path = tmp_path / "ds"
    # Zipf ids over a 50,257 vocabulary: uint16 slots, ids above 32,767 included.
    _loader.write_synthetic(str(path), 3000, mu=5.0, sigma=1.0, vocab=50257, seed=1)
    loader = TokenLoader(path, seq_len=511, batch_size=4, slots=2, threads=2, pin_memory=True)
    assert loader._slots[0][0].is_pinned() and loader._slots[0][0].dtype == torch.uint16
    seen_high = False
    for _ in range(20):
        hb = next(loader)
        want = {
            "input_ids": hb.tokens[:, :-1].to(torch.int64),
            "targets": hb.tokens[:, 1:].to(torch.int64),
            "position_ids": hb.position_ids[:, :-1],
            "doc_ids": hb.doc_ids[:, :-1].clone(),
            "loss_mask": hb.loss_mask[:, :-1],
        }
        loss_tokens = hb.loss_tokens
        seen_high |= bool((want["input_ids"] > 32767).any())
        db = hb.to("cuda")
        torch.cuda.synchronize()
        for k, v in want.items():
            got = getattr(db, k).cpu()
            assert torch.equal(got.to(v.dtype), v), k
        assert db.loss_tokens == loss_tokens == int(db.loss_mask.sum())
    assert loader.held_slots <= 1
    loader.close()
    assert loader.held_slots == 0
    assert seen_high


@needs_cuda
def test_fused_adamw_skips_a_step_the_guard_marks_bad_without_a_sync():
    """The trainer's skip on CUDA: StepGuard.check decides on the device and the fused
    AdamW, given that decision as found_inf, leaves weights, moments and step alone."""
    from pytrain.train.guard import StepGuard

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
    guard = StepGuard(spike_factor=3.0, max_bad=5, warmup=0)
    for loss_value, want_skip in ((1.0, False), (float("nan"), True), (10.0, True), (1.1, False)):
        w.grad = torch.randn_like(w)
        before = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
        loss = torch.tensor(loss_value, device="cuda")
        bad, _ = guard.check(1, loss, w.grad.norm())
        assert bad.device.type == "cuda"
        opt.found_inf = bad.float()
        opt.step()
        unchanged = torch.equal(w.detach(), before[0]) and all(
            torch.equal(v, opt.state[w][k]) for k, v in before[1].items()
        )
        assert unchanged == want_skip, (loss_value, unchanged)


def packed_doc_ids(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows of documents of random lengths with -1 padding at some row ends."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, width), -1, dtype=torch.int32)
    for r in range(rows):
        at, doc = 0, 0
        fill = width - int(torch.randint(0, 40, (1,), generator=g))
        while at < fill:
            n = int(torch.randint(1, 300, (1,), generator=g))
            out[r, at : min(fill, at + n)] = doc
            at, doc = at + n, doc + 1
    return out


@needs_fa4
def test_fa4_segments_equal_document_masked_sdpa():
    """FA4 over document segments against SDPA with the boolean document mask: outputs
    and q/k/v gradients agree to bf16 accuracy; so does plain causal FA4."""
    from pytrain.model import flash4
    from pytrain.model.gpt import document_mask

    B, T, H, D = 3, 1024, 4, 64
    doc = packed_doc_ids(B, T, seed=0)
    cu = torch.from_numpy(data.cu_seqlens(doc.numpy())).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for segments, mask in (
        (flash4.Segments(cu, T), document_mask(doc.cuda())),
        (None, None),
    ):
        x1 = qkv.clone().requires_grad_()
        y1 = flash4.attention(*x1.unbind(2), segments)
        (y1.float() * dout).sum().backward()
        x2 = qkv.float().requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in x2.unbind(2))
        kw = {"attn_mask": mask} if mask is not None else {"is_causal": True}
        y2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2)
        (y2 * dout).sum().backward()
        torch.testing.assert_close(y1.float(), y2, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(x1.grad.float(), x2.grad, atol=5e-2, rtol=5e-2)


@needs_fa4
def test_fa4_backward_repeats_bit_for_bit_in_deterministic_mode():
    """Under torch.use_deterministic_algorithms (the trainer's --deterministic) FA4's
    backward sums its gradients in a fixed order: two backward passes of the same inputs
    give identical gradients, over documents and grouped-query heads."""
    from pytrain.model import flash4

    B, T, H, KV, D = 2, 2048, 8, 2, 128
    cu = torch.tensor([0, 700, 2048, 3000, 4096], device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (H, KV, KV))  # fmt: skip
    dout = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            flash4.attention(*xs, flash4.Segments(cu, T)).backward(dout)
            grads.append([x.grad for x in xs])
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def compiled_matches_masked(attention: str, **model) -> None:
    """A 2-layer GPT (seed 0) with `attention` under torch.compile gives the loss and
    gradients of the same weights with the SDPA document mask (eager), on 4 x 512 tokens
    of packed documents."""
    from pytrain.data import loss_mask, position_ids
    from pytrain.model.gpt import GPT, ModelConfig

    torch.manual_seed(0)
    gpt = GPT(ModelConfig(vocab_size=512, n_layer=2, max_seq_len=512, **model)).cuda()
    B, T = 4, 512
    doc = packed_doc_ids(B, T + 1, seed=1)
    ids = torch.randint(0, 512, (B, T + 1), device="cuda")
    d = doc.cuda()
    args = (ids[:, :-1], ids[:, 1:], position_ids(d)[:, :-1], loss_mask(d)[:, :-1])
    cu = torch.from_numpy(data.cu_seqlens(doc[:, :-1].numpy())).cuda()
    mask = gpt.make_mask(d[:, :-1], attention, cu)
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args, mask)
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args, gpt.make_mask(d[:, :-1], "sdpa_mask"))
    # A kernel that attended across documents or dropped a segment would be off by far more.
    assert_same_loss_and_grads(gpt, got, want)


@needs_fa4
def test_fa4_model_compiles_and_matches_the_masked_model():
    compiled_matches_masked("fa4", n_head=4, d_model=256)


@needs_cuda
@pytest.mark.parametrize("attention", ["flex", "fa4"])
def test_gqa_model_compiles_and_matches_the_masked_model(attention):
    """Grouped-query attention: 8 query heads over 2 key/value heads."""
    if attention == "fa4" and not fa4_available():
        pytest.skip("needs flash-attn-4 on sm90/sm100")
    compiled_matches_masked(attention, n_head=8, n_kv_head=2, d_model=512)


def small_gpt_and_batch(masked: bool = True, **model):
    """A 2-layer GPT at GPT-2's vocabulary on the GPU (seed 0) and a loss_sum batch of 4 x 512
    tokens, 10% of them masked out of the loss unless `masked` is False."""
    from pytrain.model.gpt import GPT, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50304, n_layer=2, n_head=4, d_model=256, **model)
    gpt = GPT(cfg).cuda().train()
    ids = torch.randint(0, 50257, (4, 513), device="cuda")
    if masked:
        keep = torch.rand(4, 512, device="cuda") > 0.1
    else:
        keep = torch.ones(4, 512, dtype=torch.bool, device="cuda")
    return gpt, (ids[:, :-1], ids[:, 1:], None, keep, None)


def bf16_loss_and_grads(gpt, run, *args) -> tuple[float, list[torch.Tensor]]:
    """One bf16 forward and backward of `run(*args)`: the loss and every gradient."""
    gpt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = run(*args)
    loss.backward()
    return float(loss.detach()), [p.grad.float().clone() for p in gpt.parameters()]


def assert_same_loss_and_grads(gpt, got, want, loss_rtol=2e-3, grad_rtol=2e-2) -> None:
    """bf16 compiled against bf16 eager: the losses agree to 2e-3; single elements of
    summed gradients can differ by rounding, so each gradient is compared as a whole
    (relative Frobenius error below 2e-2). FP8 runs pass wider bounds."""
    assert abs(got[0] - want[0]) < loss_rtol * abs(want[0]), (got[0], want[0])
    for (name, _), a, b in zip(gpt.named_parameters(), got[1], want[1], strict=True):
        err = float((a - b).norm() / b.norm().clamp_min(1e-12))
        assert err < grad_rtol, (name, err)


@needs_cuda
def test_fused_ce_triton_kernel_equals_torch_path_at_gpt2_vocab():
    """The Triton kernel on the GPU against the torch path: per-token losses and the
    in-place gradient, bf16 logits of GPT-2's padded vocabulary."""
    from pytrain.model import fused_ce

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(512, 50304, device="cuda", generator=g).mul_(4).bfloat16()
    t = torch.randint(0, 50257, (512,), device="cuda", generator=g)
    t[::9] = fused_ce.IGNORE_INDEX
    a, b = logits.clone(), logits.clone()
    la = fused_ce.ce_grad_(a, t, use_triton=False)
    lb = fused_ce.ce_grad_(b, t, use_triton=True)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=2**-8)
    assert float(b[::9].float().abs().max()) == 0.0


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_ce_in_chunks_of_rows_on_the_gpu(monkeypatch, fp8):
    """The op over 4,096 tokens at Llama 3's vocabulary in 4 chunks of rows against one
    pass (cuBLAS, the Triton kernel): the same loss within float error and gradients within
    bf16's (the weight's gradient summed over the chunks in bf16), and the chunks' peak of
    memory below the single pass's by about the logits they no longer hold at once."""
    from pytrain.model import fused_ce

    if fp8 and not fp8_gpu():
        pytest.skip("needs an FP8 GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, c, v = 4096, 512, 128256
    x = torch.randn(n, c, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, c, device="cuda", generator=g) * 0.05).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    op = torch.ops.pytrain.linear_ce_fp8 if fp8 else torch.ops.pytrain.linear_ce
    out, peak = {}, {}
    for chunks in (1, 4):
        monkeypatch.setattr(fused_ce, "CHUNK_BYTES", n * v * 2 // chunks)
        assert len(fused_ce.row_chunks(n, v, 2)) == chunks
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[chunks] = op(x, w, t)
        peak[chunks] = torch.cuda.max_memory_allocated() - base
    torch.testing.assert_close(out[4][0], out[1][0], rtol=1e-5, atol=0)
    for a, b in zip(out[4][1:], out[1][1:], strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    logits = n * v * 2
    assert peak[1] - peak[4] > (0.4 if fp8 else 0.6) * logits, (peak, logits)


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not fp8_gpu(), reason="needs an FP8 GPU")
def test_fp8_head_kernel_rounds_to_nearest_and_matches_the_emulation():
    """The kernel's e5m2 gradient is torch's rounding of the exact one (the interpreter
    cannot check this: it truncates), and the FP8 op on cuBLAS equals its emulation."""
    from pytrain.model import fused_ce
    from tests.test_fused_ce import fp8_emulated

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(512, 50304, device="cuda", generator=g).mul_(4).bfloat16()
    t = torch.randint(0, 50257, (512,), device="cuda", generator=g)
    t[::9] = fused_ce.IGNORE_INDEX
    oa, ob = (torch.empty(logits.shape, dtype=torch.float8_e5m2, device="cuda") for _ in "ab")
    fused_ce.ce_grad_(logits.clone(), t, use_triton=False, out=oa, out_scale=fused_ce.G_SCALE)
    fused_ce.ce_grad_(logits.clone(), t, use_triton=True, out=ob, out_scale=fused_ce.G_SCALE)
    same = float((oa.float() == ob.float()).float().mean())
    assert same > 0.999, same  # exp() differs in the last bits: a few ties may round apart
    x = torch.randn(1024, 768, device="cuda", generator=g).bfloat16()
    w = torch.randn(50304, 768, device="cuda", generator=g) * 0.02
    got = torch.ops.pytrain.linear_ce_fp8(x, w, t.repeat(2))
    want = fp8_emulated(x, w, t.repeat(2))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=0)
    for a, b in zip(got[1:], want[1:], strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


@pytest.mark.skipif(not fp8_gpu(), reason="needs an FP8 GPU")
def test_compiled_model_with_float8_head_is_close_to_bf16():
    """--model.float8_head on: the compiled model's loss within 0.5% of the bf16 fused op's,
    each gradient within 5% (the output layer's weight gets e5m2 gradients)."""
    gpt, args = small_gpt_and_batch(masked=False, fused_ce="on")
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    gpt.cfg.float8_head = "on"
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    assert_same_loss_and_grads(gpt, got, want, loss_rtol=5e-3, grad_rtol=0.05)


@needs_cuda
def test_compiled_model_with_fused_ce_matches_unfused():
    """GPT's loss and gradients with the fused output layer + loss (compiled, bf16)
    against the unfused eager model."""
    gpt, args = small_gpt_and_batch(fused_ce="on")
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    gpt.cfg.fused_ce = "off"
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    assert_same_loss_and_grads(gpt, got, want)


@needs_cuda
def test_fused_swiglu_kernels_equal_the_torch_path_at_llama_1b_width():
    """The two Triton kernels on the GPU against the torch path, bf16, at Llama-3.2-1B's
    hidden width (8192): within one rounding step."""
    from pytrain.model import fused_swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(512, 2 * 8192, device="cuda", generator=g).mul_(3).bfloat16()
    grad = torch.randn(512, 8192, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(
        fused_swiglu._swiglu_triton(u), fused_swiglu._swiglu_torch(u), rtol=2**-7, atol=1e-5
    )
    torch.testing.assert_close(
        fused_swiglu._swiglu_backward_triton(u, grad),
        fused_swiglu._swiglu_backward_torch(u, grad),
        rtol=2**-7,
        atol=1e-5,
    )


@needs_cuda
def test_compiled_model_with_fused_swiglu_matches_unfused():
    """The SwiGLU model compiled with model.fused_swiglu=on against the eager unfused one:
    loss and gradients within bf16 compile bounds."""
    gpt, args = small_gpt_and_batch(mlp="swiglu")
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    gpt.cfg.fused_swiglu = "on"
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    assert_same_loss_and_grads(gpt, got, want)


def quack_available() -> bool:
    from pytrain.model import quack_swiglu

    return torch.cuda.is_available() and not quack_swiglu.why_not(torch.device("cuda"))


@pytest.mark.skipif(not quack_available(), reason="needs Hopper/Blackwell and quack-kernels")
@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_compiled_model_with_quack_swiglu_matches_unfused(checkpoint_every, monkeypatch):
    """The SwiGLU model compiled with model.fused_swiglu=auto, which takes quack's gated
    GEMMs here, against the eager unfused one: loss and gradients within bf16 compile
    bounds, the MLP traced through quack's ops, also with every block recomputed in the
    backward (llama-3b's activation checkpointing)."""
    from pytrain.model import quack_swiglu

    gpt, args = small_gpt_and_batch(mlp="swiglu")
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    gpt.cfg.fused_swiglu = "auto"
    gpt.set_activation_checkpointing(checkpoint_every)
    assert quack_swiglu.check(gpt.cfg, torch.device("cuda"), torch.bfloat16)
    calls = []
    real = quack_swiglu.mlp
    monkeypatch.setattr(quack_swiglu, "mlp", lambda *a: calls.append(1) or real(*a))
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    assert len(calls) >= gpt.cfg.n_layer  # traced once per layer (and per recompute)
    assert_same_loss_and_grads(gpt, got, want)


def nvmath_available() -> bool:
    from pytrain.model import fused_gelu

    return torch.cuda.is_available() and fused_gelu.available(torch.device("cuda"))


@pytest.mark.skipif(not nvmath_available(), reason="needs CUDA and nvmath-python")
def test_cublaslt_gelu_epilogues_equal_the_torch_form():
    """The ops through cuBLASLt against their torch form (what the CPU tests check against
    autograd), at the preset's layer shape: bf16 within rounding, the column-major layout
    the fake tensors declare; and in fp32 the epilogue's GELU is the tanh form (closer to it
    than to erf by far), as the module says."""
    from pytrain.model import fused_gelu

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    w_up = (torch.randn(3072, 768, device="cuda", generator=g) * 0.05).bfloat16()
    w_down = (torch.randn(768, 3072, device="cuda", generator=g) * 0.02).bfloat16()
    dy = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    got_g, got_h = torch.ops.pytrain.gelu_up(x, w_up)
    got_dh = torch.ops.pytrain.dgelu_down(dy, w_down, got_h)
    assert got_g.stride() == got_h.stride() == got_dh.stride() == (1, 4096)
    h = x.float() @ w_up.float().t()
    want_g = F.gelu(h, approximate="tanh")
    want_dh = torch.ops.aten.gelu_backward(dy.float() @ w_down.float(), h, approximate="tanh")
    for got, want in ((got_h, h), (got_g, want_g), (got_dh, want_dh)):
        assert float((got.float() - want).norm() / want.norm()) < 1e-2
    x32, w32 = x.float(), w_up.float()
    g32, h32 = fused_gelu._run("GELU_AUX", x32, w32.t())[0], x32 @ w32.t()
    tanh_err = float((g32 - F.gelu(h32, approximate="tanh")).abs().max())
    erf_err = float((g32 - F.gelu(h32)).abs().max())
    assert tanh_err < erf_err / 4, (tanh_err, erf_err)


@pytest.mark.skipif(not nvmath_available(), reason="needs CUDA and nvmath-python")
def test_compiled_model_with_fused_gelu_matches_unfused():
    """The GELU model compiled with model.fused_gelu=on against the eager unfused one (erf
    GELU): loss and gradients within bf16 compile bounds."""
    gpt, args = small_gpt_and_batch(mlp="gelu")
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    gpt.cfg.fused_gelu = "on"
    got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    assert_same_loss_and_grads(gpt, got, want)


@needs_cuda
def test_cuda_graphs_with_gradient_accumulation_match_default_compile(tmp_path: Path):
    """CUDA graphs (reduce-overhead) with 2 micro-batches per step: no fallback, and the
    losses of the default compile mode, with the GELU MLP as the GPT-2 preset has it (its
    cuBLASLt ops where nvmath-python is installed: CUDA graphs once refused them) (fp32 parameters: the gradients kept as tensors
    between micro-steps, see OptimizerStep.zero_grads, pytorch/pytorch#169545 without it; bf16
    parameters with fp32 masters: each micro-batch's gradients summed into fp32 at once)."""
    from pytrain.config import parse_args
    from pytrain.train.trainer import Trainer

    data = tmp_path / "ds"
    _loader.write_synthetic(str(data), 4000, mu=5.5, sigma=1.0, vocab=50257, seed=2)
    losses = {}
    runs = [("reduce-overhead", "off"), ("default", "off"), ("reduce-overhead", "on")]
    for mode, master in runs:
        cfg = parse_args(
            [
                "--data.path", str(data), "--out_dir", str(tmp_path / "runs"),
                "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "128",
                "--model.vocab_size", "50304", "--model.attention", "causal",
                "--model.mlp", "gelu", "--model.fused_gelu", "auto",
                "--data.seq_len", "256", "--data.batch_size", "4", "--optim.grad_accum", "2",
                "--max_steps", "6", "--eval_every", "0", "--ckpt_every", "0", "--samples", "0",
                "--no-progress", "--no-tensorboard", "--compile", "--compile.mode", mode,
                "--name", f"{mode}-{master}", "--optim.master_weights", master,
            ]
        )  # fmt: skip
        t = Trainer(cfg)
        losses[mode, master] = t.fit()["losses"]
        assert t.compiler.mode == mode and not t.compiler.fallbacks, (mode, t.compiler.fallbacks)
        assert t.fused_gelu == nvmath_available()
        t.close()
    want = losses["default", "off"]
    for run in runs[::2]:  # CUDA graphs with fp32 parameters, and with bf16 + fp32 masters
        got = losses[run]
        assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(got, want, strict=True)), (
            run,
            got,
            want,
        )


@needs_cuda
def test_master_adamw_kernels_equal_the_torch_path_on_the_gpu():
    for state in (torch.float32, torch.bfloat16):
        master_adamw_kernels_against_torch(state)


def master_adamw_kernels_against_torch(state: torch.dtype) -> None:
    """The Triton step and accumulation kernels against the same math in torch, at sizes
    of the 124M model's tensors (blocks of many tensors in one launch), over steps whose
    gradients move (the address table is rebuilt) and a skipped step; the bf16
    parameters are the fp32 masters rounded to nearest; with fp32 moments and with bf16
    ones (optim.state_dtype), both rounded to nearest as torch rounds."""
    from pytrain.optim import adamw as optim
    from pytrain.optim.master_adamw import MasterAdamW

    shapes = [(50304, 768), (768,), (3072, 768), (768, 2304), (5,)]
    runs = []
    for use_triton in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
        groups = [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
        ]
        opt = MasterAdamW(
            groups, lr=3e-3, betas=(0.9, 0.95), use_triton=use_triton, state_dtype=state
        )
        for step in range(4):
            for _ in range(2 if step == 3 else 1):  # the last step accumulates two
                for p in opt.params:
                    p.grad = torch.randn(p.shape, device="cuda", generator=g).bfloat16()
                if step == 3:
                    opt.accumulate()
            optim.fused_step(opt, torch.tensor(step == 1, device="cuda"), opt.grad_norm(), 1.0)
        assert torch.equal(opt.flat_param, opt.master.bfloat16())
        assert opt.exp_avg.dtype == opt.exp_avg_sq.dtype == state
        runs.append([opt.master, opt.exp_avg, opt.exp_avg_sq, opt.step_t])
    # bf16 moments: fp32 math in a different order (the gradient norm's sum too) may round a
    # value to its neighbour at any of the 4 steps, and a moment carries its neighbour into
    # the next step: up to 4 bf16 steps apart (2**-7 of the value each). Seen on an H100: one
    # element of 42.8M 3.5 steps apart (3.3e-6 at 1.7e-4).
    tol = {"rtol": 1e-5, "atol": 1e-7} if state == torch.float32 else {"rtol": 2**-5, "atol": 1e-6}
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert float(runs[1][3]) == 3.0


@needs_cuda
def test_compact_adamw_compiles_on_the_gpu_and_follows_torch_adamw():
    """CompactAdamW on CUDA (its update compiled, a graph a group, when it is made): with fp32
    moments it follows torch's fused AdamW through a clipped and a skipped step; with bf16
    moments it stores them in bf16 and stays near."""
    from pytrain.optim import adamw as optim
    from pytrain.optim.compact_adamw import CompactAdamW
    from pytrain.train.compile_policy import compiled_graphs

    shapes = [(4096, 1024), (1024,), (3000, 512), (7,)]
    runs = {}
    for name in ("torch", "fp32", "bf16"):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
        groups = [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
        ]
        opt = (
            torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), fused=True)
            if name == "torch"
            else CompactAdamW(groups, lr=3e-3, betas=(0.9, 0.95),
                              state_dtype=torch.float32 if name == "fp32" else torch.bfloat16)
        )  # fmt: skip
        graphs = compiled_graphs()  # CompactAdamW compiled its update when made
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            norm = optim.grad_norm(opt)
            optim.fused_step(opt, torch.tensor(step == 1, device="cuda"), norm, 1.0)
        assert compiled_graphs() == graphs  # no graph after those made with it
        runs[name] = (params, opt)
    for a, b in zip(runs["torch"][0], runs["fp32"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    params, opt = runs["bf16"]
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)
    for a, b in zip(runs["torch"][0], params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


@needs_cuda
def test_cli_run_with_evaluation_checkpoints_and_resume(tmp_path: Path):
    """The path users take: `python -m pytrain.train` on CUDA, compiled (FlexAttention
    document masking), evaluating three times with 2 loader slots (the first evaluation
    crashed with "all 2 slots are held"), checkpointing, then resuming. Every step has a
    line: those read at once (before an evaluation or a checkpoint, the last of each
    invocation) are timed like the rest, by the device's events (StepClock), so the last
    line's tokens/s is the run's, not a read between two host waits."""
    import re
    import subprocess

    for name, seed in (("train", 3), ("val", 4)):
        _loader.write_synthetic(
            str(tmp_path / name), 1500, mu=5.0, sigma=1.0, vocab=4096, seed=seed
        )
    cmd = [sys.executable, "-m", "pytrain.train", "--no-progress",
           "--data.path", str(tmp_path / "train"), "--data.val_path", str(tmp_path / "val"),
           "--out_dir", str(tmp_path / "runs"), "--model.n_layer", "2", "--model.d_model", "128",
           "--data.seq_len", "256", "--data.batch_size", "4", "--data.slots", "2",
           "--eval_every", "5", "--eval_batches", "3", "--ckpt_every", "10", "--samples", "1",
           "--max_steps", "20", "--halt_after", "10", "--log_every", "1"]  # fmt: skip
    outs = [subprocess.run(cmd, capture_output=True, text=True, timeout=900) for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "flex_attention called without torch.compile" not in r.stderr
    assert "resumed from" in outs[1].stdout and "at step 10" in outs[1].stdout
    log = (tmp_path / "runs" / "default" / "train.log").read_text()
    vals = re.findall(r"\bstep (\d+) val_loss (\S+)", log)
    assert [int(s) for s, _ in vals] == [5, 10, 15, 20], log
    assert "recompile(s) after warm-up" not in outs[0].stdout + outs[1].stdout
    from pytrain.train.metrics import read_step_lines

    steps = read_step_lines(log)  # the allocator's peaks on every line: held >= used > 0
    assert steps and all(x["reserved_gib"] >= x["allocated_gib"] > 0 for x in steps), steps
    assert [int(x["step"]) for x in steps] == list(range(1, 21)), log
    rates = {int(x["step"]): x["tok/s"] for x in steps if x["step"] not in (1, 11)}
    usual = sorted(rates.values())[len(rates) // 2]  # the first of each invocation aside
    read_at_once = (5, 10, 15, 20)
    assert all(usual / 3 < rates[k] < usual * 3 for k in read_at_once), (usual, rates)


@needs_cuda
def test_a_micro_batch_too_large_for_the_gpu_ends_in_one_line(tmp_path: Path):
    """256 rows of 2048 tokens at d_model 8192 need hundreds of GiB of activations: exit 5
    and one line naming the GPU's memory and the settings to lower, no traceback."""
    import subprocess

    _loader.write_synthetic(str(tmp_path / "train"), 6000, mu=7.0, sigma=1.0, vocab=4096, seed=5)
    cmd = [sys.executable, "-m", "pytrain.train", "--no-progress", "--no-compile",
           "--data.path", str(tmp_path / "train"), "--out_dir", str(tmp_path / "runs"),
           "--model.n_layer", "2", "--model.d_model", "8192", "--model.n_head", "64",
           "--data.seq_len", "2048", "--data.batch_size", "256", "--optim.grad_accum", "1",
           "--eval_every", "0", "--samples", "0", "--max_steps", "2"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("pytrain.train: error: out of GPU memory at step 1, micro-batches "
                           "of 256 x 2048 tokens (cuda:0 has"), line  # fmt: skip
    assert "a smaller --data.batch_size (now 256" in line
    # The trainer grows the allocator's segments in place already: not offered as a fix.
    assert "expandable_segments" not in line


@needs_cuda
def test_profile_names_the_kernel_of_each_matmul(tmp_path: Path):
    """--profile_steps on the GPU: every matmul shape of the summary names the kernel that
    ran it (cuBLAS's name carries the operands' layouts)."""
    import json

    from pytrain.config import parse_args
    from pytrain.train.trainer import Trainer

    _loader.write_synthetic(str(tmp_path / "ds"), 1500, mu=5.0, sigma=1.0, vocab=4096, seed=6)
    cfg = parse_args(
        [
            "--data.path", str(tmp_path / "ds"), "--out_dir", str(tmp_path / "runs"),
            "--model.n_layer", "2", "--model.d_model", "128", "--data.seq_len", "256",
            "--data.batch_size", "4", "--max_steps", "5", "--profile_steps", "2:4",
            "--eval_every", "0", "--ckpt_every", "0", "--samples", "0", "--no-progress",
            "--no-tensorboard", "--name", "prof",
        ]
    )  # fmt: skip
    t = Trainer(cfg)
    t.fit()
    t.close()
    summary = json.loads((tmp_path / "runs" / "prof" / "profile" / "summary.json").read_text())
    matmuls = summary["matmuls"]
    assert matmuls and all(m["kernel"] != "-" for m in matmuls), matmuls
    # Each matmul's time is its own kernels': the rows never sum to more than the matmul
    # kernels ran (the profiler's device_time_total once counted nested ops twice).
    rows, kernels = sum(m["ms"] for m in matmuls), summary["categories_ms"]["matmul"]
    assert 0 < rows <= kernels * 1.001 + 1e-3, (rows, kernels)
    md = (tmp_path / "runs" / "prof" / "profile" / "summary.md").read_text()
    assert f"rows above: {rows:.3f} ms per step of the matmul kernels' {kernels:.3f}" in md


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def unmasked_batch(rows: int, tokens: int, vocab: int) -> tuple:
    """loss_sum's arguments for `rows` rows of `tokens` random ids below `vocab` on the GPU,
    every token in the loss."""
    ids = torch.randint(0, vocab, (rows, tokens + 1), device="cuda")
    keep = torch.ones(rows, tokens, dtype=torch.bool, device="cuda")
    return ids[:, :-1], ids[:, 1:], None, keep, None


@pytest.mark.skipif(not torchao_available(), reason="needs torchao and an FP8 GPU")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_blocks_keep_the_loss_and_gradients_close(recipe):
    """--model.float8: the compiled model's loss within 1% of bf16's, gradients within 20%
    (FP8 has 3 mantissa bits; this checks wiring, not convergence; the first norm's weight
    gradient measured 10.0% on the H100 in tensorwise), under the 8B preset's selective
    checkpointing: rowwise, compiled so, went to NaN before it emulated eager's casts
    (pytorch/pytorch#150859)."""
    import torch._inductor.config as inductor_config

    from pytrain.model import float8
    from pytrain.model.gpt import GPT, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50304, n_layer=2, n_head=4, d_model=256)
    gpt = GPT(cfg).cuda().train()
    args = unmasked_batch(4, 512, 50257)
    want = bf16_loss_and_grads(gpt, gpt.loss_sum, *args)
    with inductor_config.patch(emulate_precision_casts=False):  # as it was, after the test
        assert float8.convert(gpt, recipe, torch.device("cuda")) == 2 * 4  # qkv, proj, up, down
        gpt.set_activation_checkpointing("selective", 0)
        got = bf16_loss_and_grads(gpt, torch.compile(gpt.loss_sum), *args)
    assert_same_loss_and_grads(gpt, got, want, loss_rtol=1e-2, grad_rtol=0.2)


@pytest.mark.skipif(not torchao_available(), reason="needs torchao and an FP8 GPU")
def test_float8_lean_blocks_hold_their_up_projections_less_memory():
    """--ac_lean_blocks under --model.float8, compiled as the trainer runs it: the peak of a
    forward and backward drops by the lean blocks' up projection outputs (bf16) but about one
    (the backward of a lean block holds its recomputed output): 114 MB of 4 x 45 MB on an
    H200. Lean blocks once recomputed only quack's and the fused GELU's GEMMs: 0 MB."""
    from pytrain.model import float8
    from pytrain.model.gpt import GPT, ModelConfig

    cfg = ModelConfig(vocab_size=4096, n_layer=4, n_head=8, d_model=1024, max_seq_len=4096)
    args = unmasked_batch(1, 4096, 4096)

    def peak(lean: int) -> tuple[int, int]:
        torch.manual_seed(0)
        gpt = GPT(cfg).cuda().train()
        float8.convert(gpt, "tensorwise", torch.device("cuda"))
        gpt.set_activation_checkpointing("selective", lean)
        run = torch.compile(gpt.loss_sum)
        bf16_loss_and_grads(gpt, run, *args)  # compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        bf16_loss_and_grads(gpt, run, *args)
        up = gpt.blocks[0].mlp.up.out_features
        return torch.cuda.max_memory_allocated() - base, up

    (plain, up), (lean, _) = peak(0), peak(4)
    one = 4096 * up * 2  # a block's up projection output: 4096 tokens, bf16
    assert 0.7 * 3 * one <= plain - lean <= 1.2 * 4 * one, (plain, lean, one)


@needs_cuda
def test_async_checkpoint_snapshot_of_device_tensors(tmp_path: Path):
    """The background writer copies device tensors to pinned memory on the stream at submit
    time: kernels queued afterwards (the next training step) do not reach the file."""
    from pytrain.train import checkpoint

    w = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
    want = w.cpu()
    writer = checkpoint.AsyncWriter()
    for step in (1, 2):  # the second reuses the pinned buffers
        writer.submit(tmp_path, step, {"model": {"w": w}, "step": step}, keep=3)
        w.mul_(2).add_(1)  # queued right behind the copy, no sync in between
        writer.wait()
        saved = checkpoint.read(checkpoint.ckpt_path(tmp_path, step))
        assert torch.equal(saved["model"]["w"], want), step
        want = w.cpu()


@needs_cuda
def test_a_background_save_holds_the_state_at_its_step_while_the_next_update_runs(tmp_path):
    """The sharded writer's copies into pinned host memory run on a stream of their own
    beside training; the next update waits for them on the device (before_update). Here
    the update follows the save at once and overwrites 1 GB of weights in place: the
    checkpoint holds the values at the save, not a mix (without the wait it would race)."""
    import torch.distributed as dist
    from conftest import PORTS

    from pytrain.train import sharded_checkpoint

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{next(PORTS)}", rank=0, world_size=1
    )
    try:
        model = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192, bias=False) for _ in range(4)))
        model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # the optimizer has its state: the host memory is made ahead
        writer = sharded_checkpoint.ShardedWriter(model, opt)
        writer.before_update()
        assert writer.host_memory() is not None and writer.host_memory().pinned
        saved = [p.detach().clone() for p in model.parameters()]
        writer.submit(tmp_path, 1, model, opt, {"step": 1}, True, dist.barrier, keep=1)
        writer.before_update()  # as OptimizerStep does before the update
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the update, in place, queued at once
        writer.wait()
        fresh = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192, bias=False) for _ in range(4)))
        sharded_checkpoint.load_model(tmp_path / "ckpt-00000001", fresh)
        for want, got in zip(saved, fresh.parameters(), strict=True):
            assert torch.equal(want.cpu(), got.detach()), "the checkpoint holds a later value"
    finally:
        dist.destroy_process_group()


@needs_cuda
def test_profile_memory_writes_the_allocators_history_over_the_profiled_steps(tmp_path):
    """`--profile_steps 3:5 --profile_memory`: profile/memory.pickle holds the caching
    allocator's segments and its trace of the window's allocations (what memory_viz reads),
    each with a Python stack, and memory.md what held the window's peak; the trainer's line
    names them."""
    import pickle
    import re
    import subprocess

    _loader.write_synthetic(str(tmp_path / "train"), 1500, mu=5.0, sigma=1.0, vocab=4096, seed=3)
    cmd = [sys.executable, "-m", "pytrain.train", "--no-progress", "--data.path", str(tmp_path / "train"),
           "--out_dir", str(tmp_path / "runs"), "--model.n_layer", "2", "--model.d_model", "128",
           "--data.seq_len", "256", "--data.batch_size", "4", "--samples", "0", "--max_steps", "6",
           "--profile_steps", "3:5", "--profile_memory"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = tmp_path / "runs" / "default" / "profile" / "memory.pickle"
    assert f"{path} (pytorch.org/memory_viz)" in r.stdout
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"], "no segment of the caching allocator"
    events = [e for trace in snapshot["device_traces"] for e in trace]
    allocs = [e for e in events if e["action"] == "alloc"]
    assert allocs and all(e["frames"] for e in allocs[:10])
    # memory.md: the window's peak, within the run's own peak (allocated, GB), and what held it
    from pytrain.train.cli import read_peak_memory

    table = (path.parent / "memory.md").read_text()
    window_gib = float(re.search(r"Peak allocated: ([\d.]+) GiB", table).group(1))
    run_gb = read_peak_memory(r.stdout)[0]  # printed to 0.1 GB: 0.05 either way
    assert 0.5 * run_gb - 0.05 <= window_gib * 2**30 / 1e9 <= run_gb + 0.06, (window_gib, run_gb)
    # Inductor's generated code is named with the model's line behind it
    assert "allocated before the profiled window" in table, table
    assert re.search(r"\.py:\d+ call < gpt\.py:\d+ forward", table), table
    # and what the allocator had reserved by stream, the compute stream's among them
    reserved = re.search(r"Reserved at the window's end: ([\d.]+) GiB", table)
    assert reserved and float(reserved.group(1)) >= window_gib and "| 0x0 |" in table, table


@needs_cuda
def test_a_compiled_moe_step_runs_without_a_host_sync(tmp_path: Path):
    """A mixture of experts' training step (router, grouped GEMMs, balancing bias, fused
    AdamW), compiled, queued under torch.cuda.set_sync_debug_mode("error"): any host sync
    raises, so the step could run under CUDA graphs. Its loss matches the loop reference's
    (one matmul an expert, eager) on the same weights and batch."""
    from pytrain.config import parse_args
    from pytrain.train.trainer import Trainer

    data = tmp_path / "ds"
    _loader.write_synthetic(str(data), 2000, mu=5.5, sigma=1.0, vocab=4096, seed=5)
    cfg = parse_args(
        [
            "--data.path", str(data), "--out_dir", str(tmp_path / "runs"),
            "--model.family", "moe", "--model.experts", "16", "--model.top_k", "4",
            "--model.expert_hidden", "128", "--model.qk_norm", "true", "--model.n_layer", "2",
            "--model.d_model", "128", "--model.n_head", "4", "--model.attention", "causal",
            "--data.seq_len", "256", "--data.batch_size", "4", "--max_steps", "4",
            "--eval_every", "0", "--ckpt_every", "0", "--samples", "0", "--no-progress",
            "--no-tensorboard", "--compile",
        ]
    )  # fmt: skip
    t = Trainer(cfg)
    t.warm_up()
    t.settle(t.train_step(t.feed.take(1)[0]))
    batches, _ = t.feed.take(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = t.train_step(batches)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert math.isfinite(t.settle(pending).loss) and not t.compiler.fallbacks
    bias = t.gpt.moe_layers()[0].expert_bias
    assert bias.any()  # moved twice on the device
    with torch.no_grad(), t.precision.autocast(t.device):
        b = batches[0]
        args = (b.input_ids, b.targets, b.position_ids, b.loss_mask, None)
        grouped = t.gpt.loss_sum(*args).float()
        for m in t.gpt.moe_layers():
            m.experts.kernel = "loop"
        loop = t.gpt.loss_sum(*args).float()
    assert abs(grouped.item() - loop.item()) <= 2e-3 * abs(loop.item())
    t.close()


@needs_cuda
def test_float8_experts_are_the_grouped_gemms_within_fp8_rounding():
    """model.moe_kernel float8: the experts' SwiGLU through torchao's FP8 rowwise grouped
    GEMMs, forward and backward, against the bf16 grouped GEMMs on the same tokens, with
    experts of uneven rows (not multiples of 16, one of none): within FP8's rounding (e4m3
    keeps 3 mantissa bits: a few percent of each tensor's norm)."""
    pytest.importorskip("torchao.prototype.moe_training")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 matmuls (Ada, Hopper or later)")
    from pytrain.model.moe import float8_grouped_mm, grouped_swiglu

    torch.manual_seed(0)
    E, d, h = 8, 256, 512
    counts = torch.tensor([37, 0, 128, 5, 300, 64, 17, 200], device="cuda")
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), d, device="cuda", dtype=torch.bfloat16)
    up = (0.02 * torch.randn(E, 2 * h, d, device="cuda")).bfloat16()
    down = (0.02 * torch.randn(E, d, h, device="cuda")).bfloat16()
    outs, grads = [], []
    for mm in (torch._grouped_mm, float8_grouped_mm):
        xs, us, ds = (t.detach().clone().requires_grad_() for t in (x, up, down))
        y = grouped_swiglu(xs, us, ds, offsets, mm)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append([t.grad.float() for t in (xs, us, ds)])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(outs[1], outs[0]) < 0.08, rel(outs[1], outs[0])
    for name, a, b in zip(("x", "up", "down"), grads[1], grads[0], strict=True):
        assert rel(a, b) < 0.15, (name, rel(a, b))
