"""A mixture of experts through the commands users run, on real text: trained, exported to
Qwen3MoeForCausalLM (greedy generation equal to transformers', with and without the KV
cache, through `python -m pytrain.sample`), evaluated by `python -m pytrain.eval`; a run
balanced by the bias is refused export in one line; `--init_from` a Qwen3-MoE directory
made by transformers starts the run with its logits and balances as Qwen3 does."""

from __future__ import annotations

import math

import pytest
import torch
from test_hf import text_datasets, train  # noqa: F401  (a fixture, used by name)
from test_trainer import small_cfg

from pytrain.export import export
from pytrain.export import main as export_main
from pytrain.model.load import load
from pytrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

MOE = ("--model.family", "moe", "--model.experts", "8", "--model.top_k", "2",
       "--model.expert_hidden", "32", "--model.qk_norm", "true", "--model.dense_layers", "1",
       "--no-model.tie_embeddings")  # fmt: skip
QWEN3_BALANCE = ("--model.balance_rate", "0", "--model.aux_loss", "0.001")


def test_a_qwen3_balanced_run_exports_samples_and_evaluates(text_datasets, tmp_path, capsys):  # noqa: F811
    from pytrain.eval import main as eval_main
    from pytrain.sample import main as sample_main

    t, result = train(text_datasets, tmp_path, *MOE, *QWEN3_BALANCE)
    assert all(math.isfinite(x) for x in result["losses"])
    out = export(tmp_path / "run", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "import os\nimport sys\n\ndef main("
    ids = tok(prompt, return_tensors="pt").input_ids
    hf = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    gpt = load(tmp_path / "run").gpt
    with torch.no_grad():
        assert (gpt(ids) - model(ids).logits).abs().max().item() < 1e-4
    cached = gpt.generate(ids, 16, temperature=0)
    assert cached.tolist() == gpt.generate(ids, 16, temperature=0, use_cache=False).tolist()
    assert cached.tolist() == hf.tolist()
    capsys.readouterr()
    args = ["--prompt", prompt, "--max_new_tokens", "16", "--temperature", "0"]
    assert sample_main([str(tmp_path / "run"), *args]) == 0
    want = tok.decode([i for i in hf[0].tolist() if i != tok.eos_token_id])
    assert capsys.readouterr().out.rstrip("\n").endswith(want)
    assert (
        eval_main([str(tmp_path / "run"), "--data", str(text_datasets[1]), "--batches", "3"]) == 0
    )
    assert f"loss {result['val_loss']:.4f}" in capsys.readouterr().out


def test_a_bias_balanced_run_is_refused_export_in_one_line(text_datasets, tmp_path, capsys):  # noqa: F811
    train(text_datasets, tmp_path, *MOE, "--model.balance_rate", "0.01")
    capsys.readouterr()
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expert_bias is nonzero" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def qwen3_moe_dir(tmp_path):
    """A small Qwen3MoeForCausalLM made and saved by transformers (random weights)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        tie_word_embeddings=False, router_aux_loss_coef=0.002, rope_theta=1e6,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    out = tmp_path / "qwen3"
    model.save_pretrained(out)
    return model, out


def test_init_from_a_qwen3_moe_directory_starts_with_its_logits(small_corpus, tmp_path):
    hf, path = qwen3_moe_dir(tmp_path)
    t = Trainer(small_cfg(small_corpus, tmp_path, "--init_from", str(path), "--max_steps", "2"))
    cfg = t.gpt.cfg
    assert (cfg.family, cfg.experts, cfg.top_k, cfg.head_dim, cfg.qk_norm) == (
        "moe",
        8,
        2,
        32,
        True,
    )
    # Balanced as Qwen3 balances (its aux loss's weight, no bias), so its export stays exact.
    assert (cfg.balance_rate, cfg.aux_loss) == (0.0, 0.002)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    t.gpt.eval()
    with torch.no_grad():
        diff = (t.gpt(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    t.gpt.train()
    losses = t.fit()["losses"]
    t.close()
    assert all(math.isfinite(x) for x in losses)
    assert not load(tmp_path / "runs" / "t").gpt.moe_layers()[0].expert_bias.any()
