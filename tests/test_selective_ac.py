"""activation_checkpointing 'selective' (pytrain.model.selective_ac): every block recomputed in
the backward, its attention and matmul outputs kept. On CPU: the same loss and gradients as
without checkpointing, less memory kept for the backward than without it and more than
'full', the ops the policy keeps, and the setting's words."""

import functools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from pytrain.config import ConfigError, TrainConfig, check_choices, checkpoint_every
from pytrain.model import selective_ac
from pytrain.model.gpt import GPT, ModelConfig

aten = torch.ops.aten


class KeptBytes(TorchDispatchMode):
    """The bytes of the storages that ops create inside it and that are still alive when
    read (`bytes()`), other than those of `existing` tensors (parameters, inputs).

    Read after the forward, with the loss (and so its graph) alive: what the forward leaves
    for the backward, wherever it is held. saved_tensors_hooks around the forward would not
    see it: a checkpointed block packs its saves through checkpoint's own hooks (the
    innermost win), keeps its inputs in the recompute's closure, and selective
    checkpointing keeps its ops' outputs in a cache of its own."""

    def __init__(self, existing):
        super().__init__()
        self.existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                known = self.made.get(ref.cdata)
                if ref.cdata not in self.existing and (known is None or known[0].expired()):
                    self.made[ref.cdata] = (ref, s.nbytes())
        return out

    def bytes(self) -> int:
        return sum(n for ref, n in self.made.values() if not ref.expired())


def small_gpt(policy: str, lean: int = 0, float8: bool = False, **model) -> GPT:
    """The tests' 2-layer GPT (seed 0, vocabulary 200, d_model 64) in training mode under
    `policy` with `lean` lean blocks (ac_lean_blocks); with `float8`, the blocks' linear
    layers torchao's (tensorwise)."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=200, n_layer=2, n_head=4, d_model=64, **model)).train()
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            m,
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."),
        )
    m.set_activation_checkpointing(policy, lean)
    return m


def run(policy: str, mask: bool = False, lean: int = 0, float8: bool = False, **model):
    """Loss, gradients and bytes kept for the backward of small_gpt(policy, lean, float8,
    **model) on one batch of 2 x 32 tokens with about a fifth masked out of the loss (seed
    1); with `mask`, two documents a row (SDPA with a boolean mask)."""
    m = small_gpt(policy, lean, float8, **model)
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 200, (2, 2, 32), generator=g)
    keep = torch.rand(2, 32, generator=g) > 0.2
    docs = torch.arange(32).div(16, rounding_mode="floor").expand(2, 32) if mask else None
    attn_mask = m.make_mask(docs, "sdpa_mask")
    existing = [*m.parameters(), *m.buffers(), ids, targets, keep]
    existing += [] if attn_mask is None else [attn_mask]
    with KeptBytes(existing) as kept:
        loss = m.loss_sum(ids, targets, None, keep, attn_mask)
    kept_bytes = kept.bytes()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, kept_bytes


MODELS = {
    "swiglu": {},
    "swiglu, documents, grouped-query": {"mask": True, "n_kv_head": 2},
    "fused swiglu": {"fused_swiglu": "on"},  # pytrain::swiglu, recomputed
    "fused gelu": {"mlp": "gelu", "fused_gelu": "on"},  # pytrain::gelu_up, kept
}


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_selective_equals_no_checkpointing_and_keeps_less(model):
    """The loss and every gradient equal the model's without checkpointing (fp32, to
    rounding); the forward keeps fewer bytes for the backward than without checkpointing
    (a policy that kept every op would not) and more than 'full' (one that kept nothing
    would not)."""
    off, selective, full = (run(p, **model) for p in ("off", "selective", "full"))
    torch.testing.assert_close(selective[0], off[0], rtol=1e-6, atol=0)
    assert selective[1].keys() == off[1].keys()
    for name, grad in off[1].items():
        torch.testing.assert_close(selective[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert full[2] < selective[2] < off[2], (full[2], selective[2], off[2])


def test_the_policy_keeps_attention_matmuls_and_collectives():
    """What is kept, by op: attention (this CPU's SDPA, FlexAttention's operator, FA4's op),
    matmuls (the fused GELU's up projection and a mixture's grouped GEMMs too), collectives; not elementwise ops, nor
    SwiGLU's op, nor an op that writes into its arguments (eager would skip the write on
    recompute)."""
    import pytrain.model.fused_gelu  # noqa: F401  (registers pytrain::gelu_up)

    kept = [
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        torch.ops.higher_order.flex_attention,
        torch.ops.pytrain.fa4_fwd.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten._grouped_mm.default,  # a mixture's experts
        aten._scaled_grouped_mm.default,
        torch.ops.pytrain.gelu_up.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    ]
    recomputed = [
        aten.mul.Tensor,
        aten.rsqrt.default,
        aten.silu.default,
        aten._to_copy.default,
        aten.cat.default,
        torch.ops.pytrain.swiglu.default,
        aten.mm.out,
        torch.ops._c10d_functional.all_reduce_.default,
    ]
    assert [op for op in kept if not selective_ac.kept(op)] == []
    assert [op for op in recomputed if selective_ac.kept(op)] == []


@torch.library.custom_op("pytrain_test::gated_out", mutates_args=("pre", "post"))
def _gated_out(x: torch.Tensor, w: torch.Tensor, pre: torch.Tensor, post: torch.Tensor) -> None:
    """quack's gemm_gated_out in small: a matmul writing its output and its SwiGLU into
    buffers it is given; counts its calls."""
    _gated_out.calls += 1
    pre.copy_(x @ w)
    g, u = pre.chunk(2, dim=-1)
    post.copy_(torch.nn.functional.silu(g) * u)


_gated_out.calls = 0


class _Gated(torch.autograd.Function):
    """As quack's linear_gated_func: the op above in the forward, both outputs saved."""

    @staticmethod
    def forward(ctx, x, w):
        pre, post = x.new_empty(x.shape[0], w.shape[1]), x.new_empty(x.shape[0], w.shape[1] // 2)
        torch.ops.pytrain_test.gated_out(x, w, pre, post)
        ctx.save_for_backward(x, w, pre)
        return post

    @staticmethod
    def backward(ctx, dpost):
        x, w, pre = ctx.saved_tensors
        g, u = pre.chunk(2, dim=-1)
        sg = torch.sigmoid(g)
        dpre = torch.cat([dpost * u * sg * (1 + g * (1 - sg)), dpost * g * sg], dim=-1)
        return dpre @ w.T, x.T @ dpre


def _gated_block(x, w, w2):
    return (_Gated.apply(x, w) @ w2).sum()


def _checkpointed_gated(x, w, w2):
    return torch.utils.checkpoint.checkpoint(
        _gated_block, x, w, w2, use_reentrant=False, context_fn=selective_ac.context
    )


def test_a_kept_op_that_writes_its_arguments_runs_once_when_compiled(monkeypatch):
    """An op that writes into its arguments (quack's SwiGLU up projection) is kept where
    its block is traced for compiling: under a proxy dispatch mode, as AOTAutograd traces,
    even where torch.compiler.is_compiling() is False (make_fx). Compiled, the op runs once
    for a forward and backward; not listed, the backward runs it again; in eager it is
    recomputed (the write would be skipped)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    op = torch.ops.pytrain_test.gated_out.default
    monkeypatch.setattr(selective_ac, "KEPT", selective_ac.KEPT | {"pytrain_test::gated_out"})
    monkeypatch.setattr(selective_ac, "_facts", {})
    assert not selective_ac.kept(op)  # eager
    seen = []
    make_fx(lambda t: seen.append(selective_ac.kept(op)) or t * 2)(torch.randn(2))
    assert seen == [True]  # AOTAutograd's kind of tracing

    g = torch.Generator().manual_seed(0)
    x, w, w2 = (
        torch.randn(*s, generator=g, requires_grad=True) for s in ((16, 8), (8, 16), (8, 4))
    )
    want = torch.autograd.grad(_gated_block(x, w, w2), (x, w, w2))
    counts = []
    for listed in (True, False):
        if not listed:
            monkeypatch.setattr(
                selective_ac, "KEPT", selective_ac.KEPT - {"pytrain_test::gated_out"}
            )
            monkeypatch.setattr(selective_ac, "_facts", {})
        torch._dynamo.reset()
        _gated_out.calls = 0
        got = torch.autograd.grad(
            torch.compile(_checkpointed_gated, backend="aot_eager")(x, w, w2), (x, w, w2)
        )
        counts.append(_gated_out.calls)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert counts == [1, 2]


def test_a_lean_block_recomputes_its_up_projection_and_keeps_the_rest(monkeypatch):
    """lean_policy (ac_lean_blocks): the MLP's up projection with its activation (quack's
    gated GEMM, an op that writes its arguments, here the small stand-in above) is
    recomputed even where it is traced: compiled, it runs twice (forward, backward's
    recompute) where the plain policy runs it once, with the same gradients; every other
    op is as under the plain policy."""
    import pytrain.model.fused_gelu  # noqa: F401  (registers pytrain::gelu_up)

    lean_policy = selective_ac.lean_policy(16)
    for op in (aten.mm.default, aten._scaled_mm.default, torch.ops.pytrain.fa4_fwd.default):
        assert lean_policy(None, op) == selective_ac.policy(None, op)
    gelu_up = torch.ops.pytrain.gelu_up.default
    assert selective_ac.policy(None, gelu_up) == CheckpointPolicy.MUST_SAVE
    assert lean_policy(None, gelu_up) == CheckpointPolicy.PREFER_RECOMPUTE

    name = "pytrain_test::gated_out"
    monkeypatch.setattr(selective_ac, "KEPT", selective_ac.KEPT | {name})
    monkeypatch.setattr(selective_ac, "UP_PROJECTIONS", selective_ac.UP_PROJECTIONS | {name})
    monkeypatch.setattr(selective_ac, "_facts", {})
    g = torch.Generator().manual_seed(0)
    x, w, w2 = (
        torch.randn(*s, generator=g, requires_grad=True) for s in ((16, 8), (8, 16), (8, 4))
    )
    want = torch.autograd.grad(_gated_block(x, w, w2), (x, w, w2))
    counts = []
    for context in (selective_ac.context, functools.partial(selective_ac.lean_context, 16)):

        def block(x, w, w2, context=context):
            return torch.utils.checkpoint.checkpoint(
                _gated_block, x, w, w2, use_reentrant=False, context_fn=context
            )

        torch._dynamo.reset()
        _gated_out.calls = 0
        got = torch.autograd.grad(torch.compile(block, backend="aot_eager")(x, w, w2), (x, w, w2))
        counts.append(_gated_out.calls)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert counts == [1, 2]


@pytest.mark.parametrize("float8", [False, True], ids=["linear", "float8"])
def test_lean_blocks_keep_less_by_their_up_projections_whatever_runs_them(float8):
    """ac_lean_blocks through the model's own layers: the up projection as nn.Linear's
    matmul (aten::mm) or torchao's float8 one (aten::_scaled_mm: lean blocks did nothing
    under --model.float8, the 8B's float8 run held the same memory with 6 of them). Each
    lean block keeps exactly its up projection's output less, with the same loss and
    gradients as the plain policy's."""
    if float8:
        pytest.importorskip("torchao.float8")
    plain, one, both = (run("selective", lean=n, float8=float8) for n in (0, 1, 2))
    m = GPT(ModelConfig(vocab_size=200, n_layer=2, n_head=4, d_model=64))
    up_bytes = 2 * 32 * m.blocks[0].mlp.up.out_features * 4  # 2 x 32 tokens, fp32
    assert (plain[2] - one[2], plain[2] - both[2]) == (up_bytes, 2 * up_bytes)
    for lean in (one, both):
        torch.testing.assert_close(lean[0], plain[0], rtol=0, atol=0)
        for name, grad in plain[1].items():
            torch.testing.assert_close(lean[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def compiled_saves(lean: int, float8: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """What the compiled training loss of run()'s model (its batch, 'selective' with `lean`
    lean blocks) saves for its backward, by node name: (the op that made it, its value).
    AOTAutograd's partitioner as Inductor runs it, without Inductor's code generation
    (backend aot_eager's graphs)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forwards, backwards = [], []

    def keeping(graphs):
        def compiler(gm, inputs):
            graphs.append(gm.graph)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keeping(forwards), bw_compiler=keeping(backwards),
                           partition_fn=min_cut_rematerialization_partition)  # fmt: skip
    m = small_gpt("selective", lean, float8)
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 200, (2, 2, 32), generator=g)
    keep = torch.ones(2, 32, dtype=torch.bool)
    torch._dynamo.reset()
    torch.compile(m.loss_sum, backend=backend)(ids, targets, None, keep, None).backward()
    read = {n.name for graph in backwards for n in graph.find_nodes(op="placeholder")}
    return {n.name: (str(n.target), n.meta["val"]) for graph in forwards
            for n in graph.output_node().args[0]
            if isinstance(n, torch.fx.Node) and n.name in read}  # fmt: skip


@pytest.mark.parametrize("float8", [False, True], ids=["linear", "float8"])
def test_compiled_lean_blocks_save_no_up_projection_and_nothing_in_its_place(float8):
    """The same through torch.compile, where the policy tags the traced graph and the
    partitioner decides what the backward reads: the plain policy saves each block's up
    projection (a matmul as wide as it), a lean block none, and the lean blocks save
    nothing that the plain policy does not."""
    if float8:
        pytest.importorskip("torchao.float8")
    up = GPT(ModelConfig(vocab_size=200, n_layer=2, n_head=4, d_model=64)).blocks[0].mlp.up
    matmul = "aten._scaled_mm.default" if float8 else "aten.mm.default"

    def up_projections(saves):
        return [
            n for n, (op, v) in saves.items() if op == matmul and v.shape[-1] == up.out_features
        ]

    plain, lean = compiled_saves(0, float8), compiled_saves(2, float8)
    assert len(up_projections(plain)) == 2 and up_projections(lean) == []
    assert set(lean) <= set(plain) - set(up_projections(plain))  # float8: nor their scales


def test_selective_is_a_setting_and_a_typo_is_one_line_naming_the_choices():
    assert checkpoint_every("selective") == checkpoint_every("full") == 1
    cfg = TrainConfig(activation_checkpointing="selective")
    check_choices(cfg)
    cfg.activation_checkpointing = "selektive"
    with pytest.raises(ConfigError) as e:
        check_choices(cfg)
    line = str(e.value)
    assert "\n" not in line
    assert line == (
        "activation_checkpointing is 'selektive'; expected off, full, selective or every-N (N >= 1)"
    )
    # lean blocks: only under selective
    check_choices(TrainConfig(activation_checkpointing="selective", ac_lean_blocks=99))
    with pytest.raises(ConfigError) as e:
        check_choices(TrainConfig(activation_checkpointing="full", ac_lean_blocks=2))
    assert str(e.value) == (
        "ac_lean_blocks 2 makes blocks of 'selective' checkpointing leaner: it needs "
        "--activation_checkpointing selective (now full)"
    )


def test_compiled_selective_saves_only_kept_ops_with_a_hook_on_each_block():
    """torch.compile of the training loss under 'selective', each block carrying a forward
    hook that Dynamo does not trace (as FSDP2's): the checkpointed blocks are traced (a hook
    inside the checkpointed region made Dynamo run it eagerly), the compiled forward saves
    no output the policy leaves to recompute and some it keeps, and the loss and gradients
    equal eager's. Backend aot_eager: AOTAutograd's partitioner, as Inductor uses it, without
    Inductor's code generation (about 20 s more on a cold cache, with the same results)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import CheckpointPolicy

    traced, forwards, backwards = [], [], []

    def keeping(graphs):
        def compiler(gm, inputs):
            graphs.append(gm.graph)
            return make_boxed_func(gm.forward)

        return compiler

    aot = aot_autograd(
        fw_compiler=keeping(forwards),
        bw_compiler=keeping(backwards),
        partition_fn=min_cut_rematerialization_partition,
    )

    def backend(gm, inputs):
        traced.append({str(n.target) for n in gm.graph.nodes})
        return aot(gm, inputs)

    def loss_and_grads(compiled: bool):
        torch.manual_seed(0)
        m = GPT(ModelConfig(vocab_size=200, n_layer=2, n_head=4, d_model=64)).train()
        m.set_activation_checkpointing("selective")
        for block in m.blocks:
            block.register_forward_pre_hook(torch._dynamo.disable(lambda module, args: None))
        g = torch.Generator().manual_seed(1)
        ids, targets = torch.randint(0, 200, (2, 2, 32), generator=g)
        keep = torch.rand(2, 32, generator=g) > 0.2
        loss_sum = torch.compile(m.loss_sum, backend=backend) if compiled else m.loss_sum
        loss = loss_sum(ids, targets, None, keep, None)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    eager, compiled = loss_and_grads(False), loss_and_grads(True)
    assert any("tag_activation_checkpoint" in targets for targets in traced)
    # What a forward saves: its outputs that its backward reads (by name), not its result.
    read = {n.name for graph in backwards for n in graph.find_nodes(op="placeholder")}
    outputs = [n for graph in forwards for n in graph.output_node().args[0]]
    saved = [n for n in outputs if isinstance(n, torch.fx.Node) and n.name in read]
    policies = [n.meta.get("recompute") for n in saved]
    assert CheckpointPolicy.PREFER_RECOMPUTE not in policies
    assert CheckpointPolicy.MUST_SAVE in policies
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_trainer_gives_every_block_the_policy(small_corpus, tmp_path):
    """--activation_checkpointing selective reaches every block of the trainer's model, and
    the compile policy hears that blocks are checkpointed (no CUDA graphs)."""
    from pytrain.config import parse_args
    from pytrain.train.trainer import Trainer

    train, val = small_corpus
    t = Trainer(parse_args([
        "--data.path", str(train), "--data.val_path", str(val),
        "--out_dir", str(tmp_path / "runs"), "--name", "t", "--no-progress",
        "--no-tensorboard", "--model.n_layer", "3", "--model.n_head", "2",
        "--model.d_model", "64", "--data.seq_len", "64", "--data.batch_size", "2",
        "--activation_checkpointing", "selective",
    ]))  # fmt: skip
    assert [b.recompute for b in t.gpt.blocks] == [{"context_fn": selective_ac.context}] * 3
    assert t.ckpt_every == 1

    def kinds():  # each block's context: a lean one names the up projection's width
        fns = [(b.recompute or {}).get("context_fn") for b in t.gpt.blocks]
        return [(f.func, f.args) if isinstance(f, functools.partial) else f for f in fns]

    t.gpt.set_activation_checkpointing("selective", lean=2)  # --ac_lean_blocks 2
    lean = (selective_ac.lean_context, (t.gpt.blocks[0].mlp.up.out_features,))
    assert kinds() == [lean, lean, selective_ac.context]
    t.gpt.set_activation_checkpointing("selective", lean=9)  # more than the blocks: all
    assert kinds() == [lean] * 3
    t.gpt.set_activation_checkpointing("full", lean=2)  # lean only makes selective leaner
    assert [b.recompute for b in t.gpt.blocks] == [{}] * 3


def test_torch_compiles_in_place_warning_is_dropped_and_nothing_else():
    import logging

    wrap = logging.getLogger("torch._higher_order_ops.wrap")  # filtered on selective_ac's import
    assert selective_ac.KEPT

    def passes(msg: str) -> bool:
        record = wrap.makeRecord(wrap.name, logging.WARNING, __file__, 1, msg, None, None)
        return all(f.filter(record) for f in wrap.filters)

    assert not passes("\nDetected that context_fn is passed to torch.utils.checkpoint under "
                      "torch.compile.\nPlease make sure ...")  # fmt: skip
    assert passes("another warning of the same module")
