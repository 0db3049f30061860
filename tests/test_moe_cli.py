"""A mixture of experts through the commands users run, on real text: trained, exported to
Qwen3MoeForCausalLM (greedy generation equal to transformers', with and without the KV
cache, through `python -m pytrain.sample`), evaluated by `python -m pytrain.eval`; a run
balanced by the bias over sigmoid scores (the 1.8B preset's) exports to Glm4MoeForCausalLM
with equal logits, one with softmax scores and a bias (the default) is refused export in one
line;
`--init_from` a Qwen3-MoE, GLM-4.5-style or OLMoE directory made by transformers starts the
run with its logits, balances as its authors' class does and says so in its log."""

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
QWEN3_BALANCE = ("--model.router_score", "softmax", "--model.balance_rate", "0",
                 "--model.aux_loss", "0.001")  # fmt: skip


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


def test_a_bias_balanced_run_exports_as_glm4_moe_with_equal_logits(text_datasets, tmp_path):  # noqa: F811
    """DeepSeek-V3's balancing (the bias over sigmoid scores, the 1.8B preset's) leaves the
    framework: its bias, moved by training, is GLM-4.5's e_score_correction_bias."""
    train(text_datasets, tmp_path, *MOE, "--model.router_score", "sigmoid",
          "--model.balance_rate", "0.01", "--model.shared_experts", "1")  # fmt: skip
    gpt = load(tmp_path / "run").gpt
    assert gpt.cfg.router_score == "sigmoid"
    assert all(m.expert_bias.any() for m in gpt.moe_layers())  # training moved it
    out = export(tmp_path / "run", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (gpt(ids) - model(ids).logits).abs().max().item() < 1e-4


def test_softmax_scores_with_a_bias_are_refused_export_in_one_line(text_datasets, tmp_path, capsys):  # noqa: F811
    train(text_datasets, tmp_path, *MOE, "--model.router_score", "softmax",
          "--model.balance_rate", "0.01")  # fmt: skip
    capsys.readouterr()
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expert_bias is nonzero" in err and "Traceback" not in err
    assert "router_score sigmoid" in err  # what to train with instead
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def moe_dir(tmp_path, arch: str):
    """A small Qwen3MoeForCausalLM, Glm4MoeForCausalLM (sigmoid, a shared expert, a moved
    bias) or OlmoeForCausalLM made and saved by transformers (random weights)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                 tie_word_embeddings=False, eos_token_id=None, pad_token_id=None)  # fmt: skip
    if arch == "glm4":
        cfg = transformers.Glm4MoeConfig(
            **shape, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
            partial_rotary_factor=1.0, routed_scaling_factor=2.0,
        )  # fmt: skip
        model = transformers.Glm4MoeForCausalLM(cfg)
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(std=0.1)
    elif arch == "qwen3":
        cfg = transformers.Qwen3MoeConfig(
            **{**shape, "num_attention_heads": 2}, intermediate_size=128,
            moe_intermediate_size=32, head_dim=32, num_experts=8, norm_topk_prob=True,
            router_aux_loss_coef=0.002, rope_theta=1e6,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.OlmoeConfig(**shape, intermediate_size=32, num_experts=8)
        model = transformers.OlmoeForCausalLM(cfg)
    out = tmp_path / arch
    model.eval().save_pretrained(out)
    return model, out


@pytest.mark.parametrize("arch", ["qwen3", "glm4", "olmoe"])
def test_init_from_a_moe_directory_starts_with_its_logits(small_corpus, tmp_path, arch):
    hf, path = moe_dir(tmp_path, arch)
    said: list[str] = []
    cfg_args = small_cfg(small_corpus, tmp_path, "--init_from", str(path), "--max_steps", "2")
    t = Trainer(cfg_args, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    cfg = t.gpt.cfg
    if arch == "glm4":  # balanced by its bias, as GLM-4.5 is
        assert (cfg.router_score, cfg.shared_experts, cfg.route_scale) == ("sigmoid", 1, 2.0)
        assert (cfg.balance_rate, cfg.aux_loss) == (1e-3, 0.0)
    elif arch == "qwen3":  # its loss, pooled as transformers computes it, so that its
        # export stays exact
        assert (cfg.experts, cfg.top_k, cfg.head_dim, cfg.qk_norm_scope) == (8, 2, 32, "head")
        assert (cfg.balance_rate, cfg.aux_loss, cfg.aux_loss_scope) == (0.0, 0.002, "model")
    else:  # OLMoE's loss, pooled as transformers computes it
        assert (cfg.qk_norm_scope, cfg.norm_topk) == ("projection", False)
        assert (cfg.balance_rate, cfg.aux_loss, cfg.aux_loss_scope) == (0.0, 0.01, "model")
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    t.gpt.eval()
    with torch.no_grad():
        diff = (t.gpt(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    t.gpt.train()
    losses = t.fit()["losses"]
    t.close()
    assert all(math.isfinite(x) for x in losses)
    log = "\n".join(said)
    expected = ("bias moved 0.001 a step" if arch == "glm4" else
                f"aux loss {cfg.aux_loss:g}, its statistics pooled over the MoE layers "
                "(transformers' form)")  # fmt: skip
    assert f"{path.name} balances its experts as its authors trained it: {expected}" in log
    bias = load(tmp_path / "runs" / "t").gpt.moe_layers()[0].expert_bias
    assert bias.any() == (arch == "glm4")  # the others have none, and keep none
