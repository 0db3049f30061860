"""Our downstream scores equal lm-evaluation-harness's: a tiny model trained on real text
with a real BPE tokenizer, exported, is scored by lm-evaluation-harness (its Python API, the
`hf` model, local task definitions over the same files) and by `python -m pytrain.eval
--tasks`. Every request's log-likelihood agrees within 1e-4 and acc, acc_norm and acc_bytes
are identical, over items with multi-byte UTF-8 choices, contexts that end in a space, an
empty context, and contexts longer than the model's window (cut from the left by both)."""

from __future__ import annotations

import json

import pytest
from conftest import stdlib_texts

from pytrain.config import parse_args
from pytrain.data.shards import PackOptions, pack
from pytrain.eval import main as eval_main
from pytrain.eval import score_tasks
from pytrain.export import export
from pytrain.train.trainer import Trainer

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

WINDOW = 48
LONG = "def f(x):\n    return x + 1\n" * 12  # about 200 tokens: longer than the window

MC = [
    {"context": "import os\nimport", "choices": [" sys", " os", " café", " 日本語"], "gold": 0},
    {"context": "def main(", "choices": ["self):", "):", "x, y):"], "gold": 1},
    {"context": "for i in ", "choices": ["range(10):", "x:", "ñandú:"], "gold": 0},
    {"context": "return ", "choices": ["None", "NotImplemented", "€"], "gold": 0},
    {"context": "", "choices": ["import os", "import ∂"], "gold": 0},
    {"context": LONG, "choices": ["def g(y):", "class Z:"], "gold": 1},
    {"context": "class Foo(object):\n    def __init__(self", "choices": ["):", ", *args):", " ü):"], "gold": 1},
    {"context": "if __name__ == '__main__':\n    ", "choices": ["main()", "sys.exit(main())"], "gold": 1},
]  # fmt: skip
SCHEMA = [
    {"contexts": ["x = 1\ny = x", "x = 1\ny = z"], "continuation": "+ 1", "gold": 0},
    {"contexts": ["import os ", "import ß"], "continuation": "as o", "gold": 0},
    {"contexts": [LONG + "a", LONG + "b"], "continuation": "= 2", "gold": 1},
]
LM = [
    {"context": "import", "continuation": "os"},
    {"context": "def __init__(self", "continuation": "):"},
    {"context": "return ", "continuation": "None"},
    {"context": LONG, "continuation": "def"},
    {"context": "print(", "continuation": "'héllo')"},
]

TASKS = {  # our file's items, and lm-evaluation-harness's definition of the task
    "pt_mc": (MC, {"output_type": "multiple_choice", "doc_to_text": "context",
                   "doc_to_choice": "choices", "doc_to_target": "gold"}),
    "pt_schema": (SCHEMA, {"output_type": "multiple_choice", "doc_to_text": "gold",
                           "doc_to_choice": "contexts", "doc_to_target": "continuation"}),
    # A loglikelihood task's target carries its own delimiter (LAMBADA's " {{word}}").
    "pt_lm": (LM, {"output_type": "loglikelihood", "doc_to_text": "context",
                   "doc_to_target": " {{continuation}}"}),
}  # fmt: skip
METRICS = {"pt_mc": ("acc", "acc_norm", "acc_bytes"), "pt_schema": ("acc", "acc_norm", "acc_bytes"),
           "pt_lm": ("acc",)}  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory, bpe_tokenizer_file):
    d = tmp_path_factory.mktemp("parity")
    texts = stdlib_texts(150_000)
    opts = PackOptions(tokenizer=str(bpe_tokenizer_file), frame_mib=0.05, shard_mib=0.2)
    pack(((f"t{i}", t) for i, t in enumerate(texts)), d / "train", opts)
    cfg = parse_args([
        "--data.path", str(d / "train"), "--out_dir", str(d), "--name", "run",
        "--model.n_layer", "2", "--model.n_head", "4", "--model.d_model", "64",
        "--model.max_seq_len", str(WINDOW), "--data.seq_len", str(WINDOW),
        "--data.bucket_lengths", str(WINDOW),
        "--data.batch_size", "8", "--max_steps", "20", "--eval_every", "0", "--ckpt_every", "0",
        "--samples", "0", "--no-progress", "--no-tensorboard", "--optim.lr", "3e-3",
        "--optim.warmup_steps", "5",
    ])  # fmt: skip
    t = Trainer(cfg)
    t.fit()
    t.close()
    export(d / "run", d / "hf")
    return d / "hf"


def lm_eval_results(tmp_path, files: dict):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for name, (_, definition) in TASKS.items():
        spec = {"task": name, "dataset_path": "json", "test_split": "test",
                "dataset_kwargs": {"data_files": {"test": str(files[name])}},
                "target_delimiter": " ",
                "metric_list": [{"metric": m} for m in METRICS[name]], **definition}  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(json.dumps(spec))  # JSON is YAML
    return simple_evaluate(
        model="hf", model_args=f"pretrained={files['model']},dtype=float32", tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tmp_path)), device="cpu", batch_size=4,
        log_samples=True,
    )  # fmt: skip


@pytest.mark.slow
def test_loglikelihoods_and_accuracies_equal_lm_evaluation_harness(
    exported, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = {"model": exported}
    for name, (items, _) in TASKS.items():
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items))
    (tmp_path / "defs").mkdir()
    theirs = lm_eval_results(tmp_path / "defs", files)
    ours = score_tasks(str(exported), [str(files[n]) for n in TASKS], batch_rows=3, packed=True)
    by_name = {r.name: r for r in ours.tasks}
    truncated = 0
    for name in TASKS:
        samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        their_ll = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
        if name == "pt_lm":  # loglikelihood tasks keep (ll, is_greedy) per doc
            their_ll = [float(s["filtered_resps"][0][0]) for s in samples]
        assert by_name[name].loglik == pytest.approx(their_ll, abs=1e-4), name
        for metric in METRICS[name]:
            assert getattr(by_name[name], metric) == theirs["results"][name][f"{metric},none"], (
                name,
                metric,
            )
        truncated += by_name[name].truncated
    assert truncated == 2 + 2 + 1  # the long contexts: cut by both, and counted by us
    assert 0 < by_name["pt_mc"].acc < 1  # the items tell a trained model from chance
    # The command line prints the same numbers.
    assert eval_main([str(exported), "--tasks", str(files["pt_mc"]), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["tasks"]["tasks"]["pt_mc"]
    assert printed["acc_norm"] == by_name["pt_mc"].acc_norm and printed["truncated"] == 2
