"""pack-shards: round trip with a real BPE on real text, determinism, standard zstd
frames, errors that name file and line, atomic output."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import stdlib_texts
from tokenizers import Tokenizer

from pytrain import _loader
from pytrain.data.documents import read_all_documents
from pytrain.data.shards import read_manifest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytrain.pack_shards", *args, "--no-progress"]
        if args[0] not in ("verify", "inspect")
        else [sys.executable, "-m", "pytrain.pack_shards", *args],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A slice of the standard library: .txt files (one document each) and a jsonl."""
    d = tmp_path_factory.mktemp("corpus")
    texts = stdlib_texts(1_500_000)
    for i, t in enumerate(texts[:40]):
        (d / f"doc{i:03d}.txt").write_text(t)
    with open(d / "more.jsonl", "w") as f:
        for t in texts[40:]:
            for chunk in t.split("\n\n"):
                f.write(json.dumps({"text": chunk}) + "\n")
    return d


def test_round_trip_matches_tokenizer_and_manifest(corpus, bpe_tokenizer_file, tmp_path):
    out = tmp_path / "ds"
    r = run_cli(
        str(corpus),
        "-o",
        str(out),
        "--tokenizer",
        str(bpe_tokenizer_file),
        "--frame-mib",
        "0.25",
        "--shard-mib",
        "0.1",
    )
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_file(str(bpe_tokenizer_file))
    eos = tok.token_to_id("<|endoftext|>")
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    texts += [json.loads(line)["text"] for line in open(corpus / "more.jsonl")]
    want = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts if t]
    got = read_all_documents(out)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == w
    m = read_manifest(out)
    assert len(m["shards"]) > 1 and m["totals"]["frames"] > len(m["shards"])
    assert m["totals"]["documents"] == len(want)
    assert m["totals"]["tokens"] == sum(len(w) for w in want)
    assert m["totals"]["skipped_empty"] == sum(1 for t in texts if not t)
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == tok.get_vocab_size()
    assert (out / "tokenizer.json").exists()
    assert run_cli("verify", str(out)).returncode == 0


def test_worker_count_does_not_change_a_byte(corpus, bpe_tokenizer_file, tmp_path):
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        r = run_cli(
            str(corpus),
            "-o",
            str(out),
            "--tokenizer",
            str(bpe_tokenizer_file),
            "--workers",
            str(workers),
            "--frame-mib",
            "0.25",
        )
        assert r.returncode == 0, r.stderr
        outs.append(out)
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == sorted(p.name for p in outs[1].iterdir())
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


@pytest.mark.parametrize("level", ["3", "-1"])
def test_frames_are_standard_zstd(corpus, tmp_path, level):
    # Negative levels (raw literals, faster decoding) are ordinary zstd frames too.
    out = tmp_path / "ds"
    args = ("-o", str(out), "--frame-mib", "0.1", "--zstd-level", level)
    assert run_cli(str(corpus / "more.jsonl"), *args).returncode == 0
    ds = _loader.Dataset(str(out))
    assert ds.n_frames > 3
    dctx = zstandard.ZstdDecompressor()
    docs = read_all_documents(out)
    flat = np.concatenate(docs)
    at = 0
    for f in range(ds.n_frames):
        shard, offset, length, n_tokens = ds.frame_location(f)
        raw = (out / shard).read_bytes()[offset : offset + length]
        tokens = np.frombuffer(dctx.decompress(raw), dtype="<u2")
        assert len(tokens) == n_tokens
        assert np.array_equal(tokens, flat[at : at + n_tokens])
        at += n_tokens
    assert at == flat.size


def test_compressed_inputs_and_parquet(tmp_path):
    rows = [{"body": f"document number {i} " * (i % 7)} for i in range(300)]
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"body": [r["body"] for r in rows]}), tmp_path / "c.parquet")
    out = tmp_path / "ds"
    r = run_cli(
        str(tmp_path / "a.jsonl.gz"),
        str(tmp_path / "b.jsonl.zst"),
        str(tmp_path / "c.parquet"),
        "-o",
        str(out),
        "--text-field",
        "body",
    )
    assert r.returncode == 0, r.stderr
    nonempty = sum(1 for r in rows if r["body"])
    m = read_manifest(out)
    assert m["totals"]["documents"] == 3 * nonempty
    assert m["totals"]["skipped_empty"] == 3 * (len(rows) - nonempty)
    docs = read_all_documents(out)
    assert rows[0]["body"] == ""  # skipped, so the first document is row 1
    assert bytes(docs[0][:-1].astype(np.uint8)).decode() == rows[1]["body"]


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:2: invalid JSON"),
        (b'{"text": "ok"}\n{"other": "x"}\n', "bad.jsonl:2: no field 'text'"),
        (b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff\xfe"}\n', "bad.jsonl:3: invalid UTF-8"),
        (b'{"text": 5}\n', "bad.jsonl:1: field 'text' is int"),
    ],
)
def test_bad_input_names_file_and_line_and_writes_nothing(tmp_path, content, needle):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    out = tmp_path / "ds"
    r = run_cli(str(src), "-o", str(out))
    assert r.returncode == 1
    assert needle in r.stderr
    assert not out.exists()
    assert not any(p.name.startswith(".ds.tmp") for p in tmp_path.iterdir())


def test_progress_bar_only_on_a_terminal_unless_asked(corpus, bpe_tokenizer_file, tmp_path):
    """stderr here is a pipe, as in a log file: no bar (its carriage returns would share
    lines with the messages) unless --progress asks for it."""
    base = [sys.executable, "-m", "pytrain.pack_shards", str(corpus),
            "--tokenizer", str(bpe_tokenizer_file)]  # fmt: skip
    auto = subprocess.run([*base, "-o", str(tmp_path / "a")], capture_output=True)
    asked = subprocess.run([*base, "-o", str(tmp_path / "b"), "--progress"], capture_output=True)
    assert auto.returncode == asked.returncode == 0, auto.stderr + asked.stderr
    assert b"\r" not in auto.stderr and b"packed " in auto.stdout
    assert b"\r" in asked.stderr


def test_zstd_level_out_of_range_is_a_usage_error(corpus, tmp_path):
    r = run_cli(str(corpus / "more.jsonl"), "-o", str(tmp_path / "ds"), "--zstd-level", "99")
    assert r.returncode == 2 and "--zstd-level 99 is outside" in r.stderr
    assert not (tmp_path / "ds").exists()


def test_missing_tokenizer_and_unreadable_input(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    r = run_cli(str(src), "-o", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "nope.json"))
    assert r.returncode == 1 and "tokenizer file not found" in r.stderr and "nope.json" in r.stderr
    r = run_cli(str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "ds"))
    assert r.returncode == 1 and "missing.jsonl" in r.stderr


def test_vocab_too_large_for_uint16(tmp_path):
    from tokenizers import models

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999")
    r = run_cli(
        str(tmp_path / "a.txt"),
        "-o",
        str(tmp_path / "ds"),
        "--tokenizer",
        str(tmp_path / "big.json"),
        "--dtype",
        "uint16",
        "--no-eos",
    )
    assert r.returncode == 1 and "does not fit uint16" in r.stderr
    r = run_cli(
        str(tmp_path / "a.txt"),
        "-o",
        str(tmp_path / "ds"),
        "--tokenizer",
        str(tmp_path / "big.json"),
        "--no-eos",
    )
    assert r.returncode == 0, r.stderr
    assert read_manifest(tmp_path / "ds")["dtype"] == "uint32"


def test_existing_output_is_refused_and_untouched(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    out = tmp_path / "ds"
    assert run_cli(str(tmp_path / "a.txt"), "-o", str(out)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "b.txt").write_text("second dataset")
    r = run_cli(str(tmp_path / "b.txt"), "-o", str(out))
    assert r.returncode == 3 and "--overwrite" in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # A failing overwrite leaves the old dataset as it was.
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert run_cli(str(tmp_path / "bad.jsonl"), "-o", str(out), "--overwrite").returncode == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run_cli(str(tmp_path / "b.txt"), "-o", str(out), "--overwrite").returncode == 0
    assert read_manifest(out)["totals"]["tokens"] == len("second dataset") + 1


def test_verify_catches_a_flipped_bit_and_inspect_plots(corpus, tmp_path):
    out = tmp_path / "ds"
    assert run_cli(str(corpus / "more.jsonl"), "-o", str(out), "--frame-mib", "0.1").returncode == 0
    r = run_cli("inspect", str(out), "--plot", str(tmp_path / "h.png"))
    assert r.returncode == 0 and "length histogram" in r.stdout
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    shard = out / "shard-00000.tks"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    r = run_cli("verify", str(out))
    assert r.returncode == 4
    assert "shard-00000.tks frame 0" in r.stderr and "checksum" in r.stderr
    # inspect of what is not a dataset: one line naming it, no traceback.
    r = run_cli("inspect", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (
        f"pack-shards inspect: error: {tmp_path / 'nowhere'}: not a readable dataset "
        f"({tmp_path / 'nowhere'}/manifest.json: no such file)"
    )
    # verify of a directory of raw files, and of no directory: an input error, not "FAILED"
    # (which says a dataset is damaged).
    for where, what in ((corpus, "not a dataset made by pack-shards (no manifest.json in it)"),
                        (tmp_path / "nowhere", "no such directory")):  # fmt: skip
        r = run_cli("verify", str(where))
        assert (
            r.returncode == 1 and r.stderr.strip() == f"pack-shards verify: error: {where}: {what}"
        )


def test_inspect_into_a_pipe_closed_early_exits_quietly(corpus, tmp_path):
    """`pack-shards inspect ds | head -3`: the reader leaves; no BrokenPipeError traceback."""
    out = tmp_path / "ds"
    assert run_cli(str(corpus / "more.jsonl"), "-o", str(out)).returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader already left: every write meets a closed pipe
    r = subprocess.run([sys.executable, "-m", "pytrain.pack_shards", "inspect", str(out)],
                       stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    os.close(write_end)
    assert r.returncode == 141 and "Traceback" not in r.stderr, r.stderr
