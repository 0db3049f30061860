"""`--init_from`: a run that starts from weights someone else made. A Llama checkpoint
written by transformers itself (sharded safetensors, grouped-query attention, Llama 3.1's
RoPE scaling, RMSNorm eps 1e-5) gives the trainer's model its logits before the first step;
another run's directory gives its weights; a source the model cannot take is one line
naming what and where."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import small_cfg

from pytrain.config import ConfigError, parse_args
from pytrain.model.hf import from_hf
from pytrain.model.load import load
from pytrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}  # fmt: skip


def llama_dir(tmp_path, **overrides):
    """A small LlamaForCausalLM made and saved by transformers (random weights, sharded)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "tie_word_embeddings": True, "rope_parameters": ROPE,
        **overrides,
    })  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = tmp_path / "llama"
    model.save_pretrained(out, max_shard_size="100KB")
    return model, out


def test_a_transformers_llama_starts_the_run_with_its_logits(small_corpus, tmp_path):
    hf, path = llama_dir(tmp_path)
    assert (path / "model.safetensors.index.json").is_file()  # sharded, as large models are
    t = Trainer(small_cfg(small_corpus, tmp_path, "--init_from", str(path), "--max_steps", "3"))
    cfg = t.gpt.cfg
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.mlp_hidden) == (
        2,
        64,
        4,
        2,
        192,
    )
    assert (cfg.norm_eps, cfg.rope_scaling, cfg.rope_factor, cfg.vocab_size) == (
        1e-5,
        "llama3",
        8.0,
        320,
    )
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    t.gpt.eval()
    with torch.no_grad():
        diff = (t.gpt(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    with torch.no_grad():  # pytrain.sample and pytrain.eval read it the same way
        diff = (load(path).gpt(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    t.gpt.train()
    t.fit()
    t.close()
    # Exported again after training: Llama's settings (eps 1e-5 included) and our logits.
    from pytrain.export import export

    out = export(tmp_path / "runs" / "t", tmp_path / "again")
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-5
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        diff = (back(ids).logits - load(tmp_path / "runs" / "t").gpt(ids)).abs().max().item()
    assert diff < 1e-4, diff
    # Resuming that run continues from its own checkpoint, not from the source again.
    again = Trainer(small_cfg(small_corpus, tmp_path, "--init_from", str(path), "--max_steps", "4"))
    assert again.step == 3
    start = {k: v for k, v in hf.state_dict().items()}
    assert not torch.equal(again.gpt.embed.weight, start["model.embed_tokens.weight"])
    again.close()


def test_another_runs_directory_gives_its_weights(small_corpus, tmp_path):
    first = Trainer(small_cfg(small_corpus, tmp_path, "--max_steps", "2", "--model.n_kv_head", "1"))
    first.fit()
    first.close()
    t = Trainer(small_cfg(small_corpus, tmp_path, "--name", "next", "--init_from",
                          str(tmp_path / "runs" / "t"), "--model.n_kv_head", "2"))  # fmt: skip
    assert t.step == 0 and t.gpt.cfg.n_kv_head == 1  # the source's architecture wins
    got = t.gpt.state_dict()
    assert got.keys() == first.gpt.state_dict().keys()
    for name, a in first.gpt.state_dict().items():
        assert torch.equal(a.cpu(), got[name].cpu()), name
    t.close()


def bad_sources(tmp_path):
    _, gqa = llama_dir(tmp_path / "a")
    _, small_vocab = llama_dir(tmp_path / "b", vocab_size=128)
    _, bias = llama_dir(tmp_path / "c", attention_bias=True)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    ).save_pretrained(gpt2)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((gqa / "config.json").read_text())
    torch.save({}, pickled / "pytorch_model.bin")
    index = json.loads((gqa / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (gqa / shard).unlink()
    return {
        gqa: f"{shard}, a shard its model.safetensors.index.json names, is missing",
        small_vocab: "the dataset's vocabulary (256) is larger than the model's (128)",
        bias: "LlamaForCausalLM with attention_bias True: pytrain's GPT computes False",
        gpt2: "GPT2LMHeadModel is not a class pytrain reads",
        pickled: "weights are read from safetensors only",
        tmp_path / "nowhere": "no such file or directory",
    }  # fmt: skip


@pytest.mark.slow
def test_sources_it_cannot_take_are_one_line_each(small_corpus, tmp_path):
    for path, message in bad_sources(tmp_path).items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Trainer(small_cfg(small_corpus, tmp_path / "runs-x", "--init_from", str(path)))
    # The command line prints it as one line, without a traceback.
    train, val = small_corpus
    r = subprocess.run([sys.executable, "-m", "pytrain.train", "--data.path", str(train),
                        "--out_dir", str(tmp_path / "cli"), "--no-progress",
                        "--init_from", str(tmp_path / "gpt2")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "GPT2LMHeadModel is not a class pytrain reads" in r.stderr + r.stdout


LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
"""Llama-3.2-1B's config.json as Meta published it."""


def test_metas_llama_3_2_1b_config_reads_as_the_1b_preset():
    """Llama-3.2-1B's config.json as Meta published it (weights as shapes only)."""
    config = LLAMA_3_2_1B
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(16) for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")
    ]  # fmt: skip
    weights = {n: torch.empty(1, 1, device="meta") for n in names}
    cfg, state = from_hf(config, weights)
    preset = parse_args(["--config", str(ROOT / "configs" / "llama-1b.toml")]).model
    want = {**preset.architecture(), "vocab_size": 128256, "norm_eps": 1e-5}
    assert cfg.architecture() == want
    assert state["head.weight"] is state["embed.weight"]  # tied


@pytest.mark.slow
def test_fsdp2_ranks_start_from_the_source(small_corpus, tmp_path):
    """Two gloo ranks under FSDP2 (torchrun): each shards the source's weights. One step at
    a learning rate of 1e-12 leaves them as they were, so the run's export gives
    transformers' logits of the source."""
    from conftest import PORTS
    from test_ddp import torchrun_train

    from pytrain.export import export

    hf, path = llama_dir(tmp_path)
    torchrun_train(small_corpus, tmp_path, "fsdp", next(PORTS), "--init_from", str(path),
                   "--max_steps", "1", "--optim.lr", "1e-12", "--optim.warmup_steps", "0")  # fmt: skip
    out = export(tmp_path / "runs" / "fsdp", tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        diff = (theirs(ids).logits - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_a_dataset_packed_with_another_tokenizer_gets_a_note(
    small_corpus, tmp_path, bpe_tokenizer_file, capsys
):
    """The source's tokenizer.json against the dataset's manifest: the synthetic test corpus
    names none of it (a note), a dataset packed with that very file matches (no note)."""
    from pytrain.data.shards import PackOptions, pack
    from pytrain.train.initial_weights import tokenizer_notes

    _, path = llama_dir(tmp_path, vocab_size=1024)
    (path / "tokenizer.json").write_bytes(bpe_tokenizer_file.read_bytes())
    Trainer(small_cfg(small_corpus, tmp_path, "--init_from", str(path))).close()
    out = capsys.readouterr().out
    assert f"note: {small_corpus[0]} was packed with another tokenizer than {path}" in out, out
    same = tmp_path / "same"
    pack([("a", "def f(x):\n    return x + 1\n" * 50)], same,
         PackOptions(tokenizer=str(bpe_tokenizer_file)))  # fmt: skip
    assert tokenizer_notes(path / "tokenizer.json", (str(same),)) == []
    assert len(tokenizer_notes(path / "tokenizer.json", (str(same), str(small_corpus[0])))) == 1
