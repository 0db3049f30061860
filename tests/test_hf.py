"""After training: export to a Hugging Face directory that transformers loads with no
custom code (logits equal to pytrain's, for each exportable variant), sampling with a KV
cache (same greedy text as transformers' generate), and the eval CLI (the trainer's
validation loss, to float precision)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import stdlib_texts

from pytrain.config import parse_args
from pytrain.data.shards import PackOptions, pack
from pytrain.export import export
from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT
from pytrain.model.hf import LOGITS_TOLERANCE, NotExportable, hf_config
from pytrain.model.load import load
from pytrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def text_datasets(tmp_path_factory, bpe_tokenizer_file):
    """(train, val) packed from standard-library sources with a real BPE tokenizer.json."""
    d = tmp_path_factory.mktemp("hfdata")
    texts = stdlib_texts(600_000)
    opts = PackOptions(tokenizer=str(bpe_tokenizer_file), frame_mib=0.05, shard_mib=0.2)
    out = []
    for name, part in (("train", texts[:-4]), ("val", texts[-4:])):
        pack(((f"{name}{i}", t) for i, t in enumerate(part)), d / name, opts)
        out.append(d / name)
    return out


def train(text_datasets, tmp_path, *extra: str) -> tuple[Trainer, dict]:
    train_ds, val_ds = text_datasets
    cfg = parse_args([
        "--data.path", str(train_ds), "--data.val_path", str(val_ds), "--out_dir", str(tmp_path),
        "--name", "run", "--model.n_layer", "2", "--model.n_head", "4", "--model.d_model", "64",
        "--data.seq_len", "64", "--data.batch_size", "4", "--max_steps", "6", "--eval_every", "0",
        "--eval_batches", "3", "--ckpt_every", "0", "--samples", "0", "--no-progress",
        "--no-tensorboard", "--deterministic", "--optim.lr", "3e-3", *extra,
    ])  # fmt: skip
    t = Trainer(cfg)
    result = t.fit()
    t.close()
    return t, result


VARIANTS = {
    "default": (),  # the CPU default: SwiGLU -> Llama
    "gpt2-124m architecture": (
        "--model.mlp",
        "gelu",
        "--model.residual",
        "compute",
        "--model.rope_base",
        "50000",
    ),  # fmt: skip
    "untied": ("--no-model.tie_embeddings",),
    # Llama-3.2's kind: grouped-query attention (2 key/value heads for 4 query heads),
    # Llama 3.1's RoPE scaling (a short original length, so that it changes the angles here).
    "llama gqa": (
        "--no-model.tie_embeddings",
        "--model.n_kv_head",
        "2",
        "--model.rope_base",
        "500000",
        "--model.rope_scaling",
        "llama3",
        "--model.rope_factor",
        "8",
        "--model.rope_original_len",
        "32",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers_with_equal_logits(text_datasets, tmp_path, variant):
    t, _ = train(text_datasets, tmp_path, *VARIANTS[variant])
    out = export(tmp_path / "run", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    want = {
        "default": "LlamaForCausalLM",
        "untied": "LlamaForCausalLM",
        "llama gqa": "LlamaForCausalLM",
    }.get(variant, "ArceeForCausalLM")
    assert type(model).__name__ == want
    ours = load(tmp_path / "run").gpt
    assert ours.vocab % 64 == 0 and model.config.vocab_size == ours.vocab  # padded vocabulary
    ids = torch.tensor([tok.encode("def walk(top, onerror=None):\n    return os.path.join(top)")])
    with torch.no_grad():
        diff = (model(ids).logits - ours(ids)).abs().max().item()
    assert diff < LOGITS_TOLERANCE, diff
    assert (
        tok.eos_token == "<|endoftext|>"
        and model.generation_config.eos_token_id == tok.eos_token_id
    )


@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_greedy_sample_equals_transformers_generate_and_the_cache_changes_nothing(
    text_datasets, tmp_path, capsys, heads
):
    from pytrain.sample import main as sample_main

    train(text_datasets, tmp_path, *(("--model.n_kv_head", "1") if heads == "gqa" else ()))
    out = export(tmp_path / "run", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "import os\nimport sys\n\ndef main("
    ids = tok(prompt, return_tensors="pt").input_ids
    hf = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    gpt = load(tmp_path / "run").gpt
    cached = gpt.generate(ids, 24, temperature=0)
    uncached = gpt.generate(ids, 24, temperature=0, use_cache=False)
    assert cached.tolist() == uncached.tolist() == hf.tolist()
    for src in (tmp_path / "run", out):  # from the checkpoint and from the exported dir
        assert (
            sample_main(
                [str(src), "--prompt", prompt, "--max_new_tokens", "24", "--temperature", "0"]
            )
            == 0
        )
        text = capsys.readouterr().out
        eos = tok.eos_token_id
        # (The run's own log lines may come first in the captured output.)
        want = tok.decode([i for i in hf[0].tolist() if i != eos])
        assert text.rstrip("\n")[-len(want) :] == want
    if heads == "mha":  # the KV cache's bound, said (a prompt past it gave 0 tokens, silently)
        context = gpt.cfg.max_seq_len
        assert sample_main([str(out), "--prompt", "def", "--max_new_tokens", str(context)]) == 0
        assert f"note: at most {context - 1} new tokens: the model's context is {context}" in (
            capsys.readouterr().err
        )
        long = " ".join(str(i) for i in range(context))
        assert len(tok(long).input_ids) > context
        assert sample_main([str(out), "--prompt", long, "--max_new_tokens", "2"]) == 2
        assert f"and the model's context {context}: shorten it" in capsys.readouterr().err


def test_eval_cli_equals_the_trainers_validation_loss(text_datasets, tmp_path, capsys):
    from pytrain.eval import evaluate
    from pytrain.eval import main as eval_main

    _, result = train(text_datasets, tmp_path)
    capsys.readouterr()
    r = evaluate(str(tmp_path / "run"), [str(text_datasets[1])], batches=3)
    assert math.isclose(r["loss"], result["val_loss"], rel_tol=1e-6), (
        r["loss"],
        result["val_loss"],
    )
    s = r["sets"]["val"]
    assert math.isclose(s["perplexity"], math.exp(s["loss"])) and 0 < s["bits_per_byte"] < s["loss"]
    assert (
        eval_main([str(tmp_path / "run"), "--data", str(text_datasets[1]), "--batches", "3"]) == 0
    )
    assert f"loss {result['val_loss']:.4f}" in capsys.readouterr().out
    # Without --data and --batches: the run's own validation set and eval_batches (3).
    own = evaluate(str(tmp_path / "run"), None, None)
    assert own["loss"] == r["loss"] and list(own["sets"]) == ["val"]  # the trainer's name
    assert eval_main([str(tmp_path / "run")]) == 0
    got = capsys.readouterr()
    assert f"loss {result['val_loss']:.4f}" in got.out and "note:" not in got.err
    assert own["notes"] == []  # the run's own tokenizer
    assert eval_main([str(tmp_path / "nope"), "--data", str(text_datasets[1])]) == 2
    # A dataset of the extension's synthetic writer (its manifest from the same one writer
    # as pack-shards': it has totals, and no input bytes to give bits per byte).
    from pytrain import _loader

    _loader.write_synthetic(str(tmp_path / "syn"), 300, vocab=256, seed=3)
    syn = evaluate(str(tmp_path / "run"), [str(tmp_path / "syn")], batches=2)
    assert syn["loss"] > 0 and "bits_per_byte" not in syn["sets"]["syn"]
    assert syn["notes"] == []  # no tokenizer recorded: nothing to compare
    # A set packed with another tokenizer (bytes): its ids are other tokens, said beside
    # the figures.
    pack((("t", stdlib_texts(20_000)[0]),), tmp_path / "bytes", PackOptions(tokenizer="byte"))
    other = evaluate(str(tmp_path / "run"), [str(tmp_path / "bytes")], batches=1)
    (note,) = other["notes"]  # the model's tokenizer: the training set's, here
    assert note.startswith(
        f"note: {tmp_path / 'bytes'} was packed with another tokenizer than "
        f"{text_datasets[0] / 'tokenizer.json'} (settings hash "
    ), note


def test_a_variant_without_a_transformers_class_is_refused_by_name():
    cfg = ModelConfig(mlp="relu2")
    with pytest.raises(
        NotExportable, match="'relu2'.*swiglu \\(LlamaForCausalLM\\), gelu \\(ArceeForCausalLM\\)"
    ):
        hf_config(cfg, 4096, 0, None)
    assert GPT(ModelConfig(n_layer=1, d_model=64, n_head=2)).vocab == 4096
    with pytest.raises(ValueError, match="model.mlp is 'relu2'; expected one of swiglu, gelu"):
        GPT(cfg)


def test_export_in_bf16_halves_the_file_and_keeps_the_logits_close(text_datasets, tmp_path):
    """`python -m pytrain.export --dtype bf16`: bf16 tensors, config.json says so, and
    transformers' logits stay within bf16's rounding of ours; a wrong dtype is one line."""
    from pytrain.export import main as export_main

    train(text_datasets, tmp_path)
    assert export_main([str(tmp_path / "run"), str(tmp_path / "fp32")]) == 0
    assert export_main([str(tmp_path / "run"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16")]
    assert sizes[1] < 0.55 * sizes[0], sizes
    config = (tmp_path / "bf16" / "config.json").read_text()
    assert '"torch_dtype": "bfloat16"' in config
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").float().eval()
    ours = load(tmp_path / "run").gpt
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, ours(ids)
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
    with pytest.raises(SystemExit):
        export_main([str(tmp_path / "run"), str(tmp_path / "x"), "--dtype", "fp8"])


def test_a_large_export_is_sharded_as_hugging_face_cuts_it(text_datasets, tmp_path, capsys):
    """Weights above --max_shard_size go into model-0000N-of-0000M.safetensors files with
    model.safetensors.index.json (an 8B in fp32 is 32 GB): transformers loads them with our
    logits, and pytrain's own loader (--init_from, eval) reads them back. Exporting again
    into the same directory in one file leaves no shard or index of the first behind."""
    import json

    from pytrain.export import main as export_main

    train(text_datasets, tmp_path, "--no-model.tie_embeddings")
    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "run"), str(out), "--max_shard_size", "100KB"]) == 0
    shards = sorted(f.name for f in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load(tmp_path / "run").gpt
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - ours(ids)).abs().max().item() < LOGITS_TOLERANCE
        assert torch.equal(load(out).gpt(ids), ours(ids))
    assert export_main([str(tmp_path / "run"), str(out)]) == 0
    assert sorted(f.name for f in out.glob("model*.safetensors*")) == ["model.safetensors"]
    # A wrong size is one line, before the checkpoint is read (here a directory without one).
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), str(out), "--max_shard_size", "lots"]) == 2
    assert capsys.readouterr().err.startswith("pytrain.export: error: --max_shard_size 'lots': ")


def test_metas_llama_3_1_8b_config_reads_as_the_8b_preset():
    """Llama-3.1-8B's config.json as Meta published it, read by from_hf, is the
    configs/llama-8b.toml architecture at Llama 3's vocabulary (Llama 3.1's RoPE scaling
    included), and both models have Llama-3.1-8B's 8,030,261,248 parameters (built on the
    meta device: shapes only)."""
    from pathlib import Path

    from test_init_from import LLAMA_3_2_1B

    from pytrain.model.hf import from_hf

    # Llama-3.1-8B's config.json, as Meta published it, differs from Llama-3.2-1B's in these
    # (its head size, 128, it leaves to hidden_size / num_attention_heads).
    config = {**LLAMA_3_2_1B, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "tie_word_embeddings": False,
              "rope_scaling": {**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0}}  # fmt: skip
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    cfg, state = from_hf(config, theirs.state_dict())
    preset = Path(__file__).resolve().parent.parent / "configs" / "llama-8b.toml"
    ours = parse_args(["--config", str(preset), "--model.vocab_size", "128256"]).model
    assert cfg.architecture() == ours.architecture()
    assert state["head.weight"] is not state["embed.weight"]  # untied
    with torch.device("meta"):
        gpt = GPT(ours)
    counts = [sum(p.numel() for p in m.parameters()) for m in (gpt, theirs)]
    assert counts == [8_030_261_248] * 2
