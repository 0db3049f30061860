"""Corpora as users have them: FineWeb-style parquet, bad files in a real corpus
(--on-bad-input), and data already tokenized by nanoGPT, llm.c or Megatron-LM
(`pack-shards import`), written here with their documented layouts."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pytrain.data.documents import read_all_documents
from pytrain.data.shards import read_manifest
from pytrain.pack_shards import main as pack_shards


def cli(*args: str) -> int:
    """pack-shards as a user calls it (import has no progress bar to switch off)."""
    return pack_shards([*args] if args[0] == "import" else [*args, "--no-progress"])


def import_to(out: Path, *args) -> int:
    """`pack-shards import ARGS... -o OUT` (paths or strings)."""
    return cli("import", *map(str, args), "-o", str(out))


def byte_docs(out: Path) -> list[str]:
    """Documents of a dataset packed with the byte tokenizer, as text (EOS dropped)."""
    return [bytes(d[:-1].astype(np.uint8)).decode() for d in read_all_documents(out)]


# ---------------------------------------------------------------- parquet


def test_parquet_many_row_groups_text_among_other_columns(tmp_path, monkeypatch):
    import pytrain.data.inputs as inputs

    texts = [f"row {i} " + "word " * (i % 13) for i in range(5_000)]
    table = pa.table({
        "id": [f"<urn:{i}>" for i in range(5_000)],
        "text": texts,
        "score": np.linspace(0, 1, 5_000),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "fw.parquet", row_group_size=700)
    assert pq.ParquetFile(tmp_path / "fw.parquet").metadata.num_row_groups == 8
    # Read back in small pieces: documents must come out whole and in order anyway.
    monkeypatch.setattr(inputs, "PARQUET_BATCH_ROWS", 97)
    assert cli(str(tmp_path / "fw.parquet"), "-o", str(tmp_path / "ds")) == 0
    assert byte_docs(tmp_path / "ds") == texts
    m = read_manifest(tmp_path / "ds")
    assert m["totals"]["input_bytes"] == sum(len(t.encode()) for t in texts)


def test_parquet_null_text_is_a_bad_row(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "n.parquet")
    assert cli(str(tmp_path / "n.parquet"), "-o", str(tmp_path / "ds")) == 1
    assert "n.parquet:row 2: column 'text' is NoneType" in capsys.readouterr().err
    assert (
        cli(str(tmp_path / "n.parquet"), "-o", str(tmp_path / "ds"), "--on-bad-input", "skip") == 0
    )
    assert byte_docs(tmp_path / "ds") == ["a", "c"]


# ---------------------------------------------------------------- bad input


def write_bad_corpus(d: Path) -> list[str]:
    """Good documents among bad ones; returns the good ones in input order."""
    (d / "a.jsonl").write_bytes(
        b'{"text": "one"}\n{"text": broken}\n{"text": "two"}\n{"other": 1}\n'
        b'{"text": "\xff\xfe"}\n{"text": 5}\n{"text": "three"}\n'
    )
    (d / "b.txt").write_bytes(b"fine text file")
    (d / "c.txt").write_bytes(b"line one\nline two \xc3\x28 here\n")  # invalid UTF-8 at byte 18
    good_gz = gzip.compress(b'{"text": "four"}\n' * 3)
    (d / "d.jsonl.gz").write_bytes(good_gz[: len(good_gz) - 6])  # truncated stream
    (d / "e.parquet").write_bytes(b"PAR1 this is not parquet")
    (d / "f.jsonl").write_bytes(b'{"text": "five"}\n')
    return ["one", "two", "three", "fine text file", "five"]


def test_on_bad_input_stop_names_file_line_and_byte_offset(tmp_path, capsys):
    (tmp_path / "c.txt").write_bytes(b"line one\nline two \xc3\x28 here\n")
    assert cli(str(tmp_path / "c.txt"), "-o", str(tmp_path / "ds")) == 1
    err = capsys.readouterr().err
    assert "c.txt:2: invalid UTF-8 (byte offset 18)" in err and "Traceback" not in err
    assert not (tmp_path / "ds").exists()
    (tmp_path / "j.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    assert cli(str(tmp_path / "j.jsonl"), "-o", str(tmp_path / "ds")) == 1
    assert "j.jsonl:2: invalid UTF-8 (byte offset 25)" in capsys.readouterr().err


def test_on_bad_input_skip_keeps_the_good_and_lists_the_bad(tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    good = write_bad_corpus(src)
    assert cli(str(src), "-o", str(tmp_path / "stop")) == 1  # the default stops
    assert not (tmp_path / "stop").exists()
    capsys.readouterr()
    assert cli(str(src), "-o", str(tmp_path / "ds"), "--on-bad-input", "skip") == 0
    err = capsys.readouterr().err
    docs = byte_docs(tmp_path / "ds")
    # d.jsonl.gz: whatever was read before the damage stays (one "four" per good line read)
    assert [d for d in docs if d != "four"] == good
    bad = read_manifest(tmp_path / "ds")["bad_input"]
    listed = "\n".join(bad["listed"])
    for needle in ("a.jsonl:2: invalid JSON", "a.jsonl:4: no field 'text'", "a.jsonl:5: invalid UTF-8",
                   "a.jsonl:6: field 'text' is int", "c.txt:2: invalid UTF-8 (byte offset 18)",
                   "d.jsonl.gz: cannot read", "e.parquet: not a readable parquet file"):  # fmt: skip
        assert needle in listed, (needle, listed)
    assert bad["skipped"] == 7 and bad["policy"] == "skip" and bad["listed_all"]
    assert "skipped 7 bad input(s)" in err


# ---------------------------------------------------------------- import


def gpt2_like_docs(rng, n: int, eot: int) -> list[list[int]]:
    return [rng.integers(0, eot, rng.integers(1, 300)).tolist() for _ in range(n)]


def test_import_nanogpt_bin_splits_after_eot(tmp_path):
    rng = np.random.default_rng(0)
    docs = gpt2_like_docs(rng, 200, 50256)
    stream = [t for d in docs for t in d + [50256]]  # prepare.py: ids, then <|endoftext|>
    np.array(stream, dtype="<u2").tofile(tmp_path / "train.bin")
    assert import_to(tmp_path / "ds", tmp_path / "train.bin", "--vocab-size", 50257) == 0
    got = [d.tolist() for d in read_all_documents(tmp_path / "ds")]
    assert got == [d + [50256] for d in docs]
    m = read_manifest(tmp_path / "ds")
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 50257


def write_llmc(path: Path, tokens: list[int], magic: int, dtype: str) -> None:
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, 1 if magic == 20240520 else 7, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, dtype=dtype).tobytes())


def test_import_llmc_shards_split_before_eot_and_across_files(tmp_path, monkeypatch):
    import pytrain.data.pretokenized as pt

    monkeypatch.setattr(pt, "CHUNK_TOKENS", 1000)  # documents also cross read chunks
    rng = np.random.default_rng(1)
    docs = gpt2_like_docs(rng, 300, 50256)
    stream = [t for d in docs for t in [50256] + d]  # fineweb.py: <|endoftext|>, then ids
    cut = len(stream) // 2 + 7  # llm.c shards cut mid-document
    write_llmc(tmp_path / "fw_000000.bin", stream[:cut], 20240520, "<u2")
    write_llmc(tmp_path / "fw_000001.bin", stream[cut:], 20240520, "<u2")
    files = [tmp_path / "fw_000000.bin", tmp_path / "fw_000001.bin"]
    assert import_to(tmp_path / "ds", *files, "--vocab-size", 50257) == 0
    got = [d.tolist() for d in read_all_documents(tmp_path / "ds")]
    assert got == [[50256] + d for d in docs]


def test_import_llmc_llama3_uint32(tmp_path):
    docs = [[128000, 5, 100_000, 7], [128000, 128_255]]
    write_llmc(tmp_path / "l3.bin", [t for d in docs for t in d], 20240801, "<u4")
    assert import_to(tmp_path / "ds", tmp_path / "l3.bin", "--vocab-size", 128256) == 0
    assert [d.tolist() for d in read_all_documents(tmp_path / "ds")] == docs
    assert read_manifest(tmp_path / "ds")["dtype"] == "uint32"


def write_megatron(prefix: Path, docs: list[list[list[int]]], dtype=np.int32, code=4) -> None:
    """Megatron's IndexedDatasetBuilder layout: documents made of sequences (sentences)."""
    seqs = [s for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    np.array([t for s in seqs for t in s], dtype=dtype).tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


@pytest.mark.parametrize("dtype, code", [(np.int32, 4), (np.uint16, 8)])
def test_import_megatron_indexed_dataset(tmp_path, dtype, code):
    rng = np.random.default_rng(2)
    docs = [[rng.integers(0, 30_000, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(150)]  # fmt: skip
    write_megatron(tmp_path / "corpus_text_document", docs, dtype, code)
    src = tmp_path / "corpus_text_document.bin"
    assert import_to(tmp_path / "ds", src, "--vocab-size", 32000) == 0
    got = [d.tolist() for d in read_all_documents(tmp_path / "ds")]
    assert got == [[t for s in d for t in s] for d in docs]


def test_import_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse: usage error, exit 2
        import_to(tmp_path / "ds", tmp_path / "x.bin", "--zstd-level", 99)
    assert e.value.code == 2 and "--zstd-level 99 is outside" in capsys.readouterr().err
    write_llmc(tmp_path / "x.bin", [1, 2, 3], 20240520, "<u2")
    with open(tmp_path / "x.bin", "ab") as f:
        f.write(b"\x00\x00")  # one id more than the header says
    assert import_to(tmp_path / "ds", tmp_path / "x.bin", "--vocab-size", 50257) == 1
    assert "header says 3 tokens" in capsys.readouterr().err
    np.array([1, 2, 60_000], dtype="<u2").tofile(tmp_path / "y.bin")
    assert import_to(tmp_path / "ds", tmp_path / "y.bin", "--vocab-size", 50257) == 1
    assert "id 60000 is outside the vocabulary" in capsys.readouterr().err
    assert import_to(tmp_path / "ds", tmp_path / "y.bin") == 1
    assert "--vocab-size" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()
    assert not any(p.name.startswith(".ds.tmp") for p in tmp_path.iterdir())


def test_import_with_a_tokenizer_copies_it_and_uses_its_eos(tmp_path, bpe_tokenizer_file):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_tokenizer_file))
    eos = tok.token_to_id("<|endoftext|>")
    texts = ["def f(x):\n    return x\n", "import os\n"]
    stream = [t for s in texts for t in tok.encode(s).ids + [eos]]
    np.array(stream, dtype="<u2").tofile(tmp_path / "t.bin")
    assert import_to(tmp_path / "ds", tmp_path / "t.bin", "--tokenizer", bpe_tokenizer_file) == 0
    dec = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert [dec.decode(d[:-1].tolist()) for d in read_all_documents(tmp_path / "ds")] == texts
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["tokenizer"]["eos_id"] == eos


def test_missing_optional_reader_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """pyarrow and zstandard are extras: without them the error says what to install."""
    import sys

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "x.parquet")
    (tmp_path / "y.jsonl.zst").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert cli(str(tmp_path / "x.parquet"), "-o", str(tmp_path / "ds")) == 1
    err = capsys.readouterr().err
    assert "x.parquet: reading .parquet needs pyarrow" in err and "pytrain[parquet]" in err
    assert "Traceback" not in err
    assert cli(str(tmp_path / "y.jsonl.zst"), "-o", str(tmp_path / "ds")) == 1
    assert "pytrain[zstd]" in capsys.readouterr().err
