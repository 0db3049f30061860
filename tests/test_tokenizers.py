"""Real tokenizer families, built offline here with `tokenizers`: every token of every
document reaches the shards, whatever truncation, padding or template the file carries.

For each family the shards must equal an independent `encode(text, add_special_tokens=False)`
with truncation and padding off, plus the end token, document by document; `decode` must
give the text back where the family is lossless."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import stdlib_texts
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pytrain.data.documents import read_all_documents
from pytrain.data.shards import PackOptions, pack, read_manifest
from pytrain.data.tokenizer import TokenizerError, train_bpe
from pytrain.pack_shards import main as pack_shards

# Llama 3's split pattern (tiktoken cl100k-style), as its tokenizer.json carries it.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
UNICODE = [
    "naïve café — Ünïcödé façade, 東京タワー and 🚀🦀 emoji\n",
    "  leading spaces,\ttabs\tand trailing   ",
    "数学 ∑∫√ and Ελληνικά",
    "x" * 3000,
]


def corpus() -> list[str]:
    """Real text (stdlib sources, most far longer than 128 tokens) and awkward strings."""
    texts = stdlib_texts(250_000)
    return texts[:40] + UNICODE + ["", "   \n\n  "]


def _train(tok: Tokenizer, trainer, texts: list[str]) -> Tokenizer:
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def gpt2_style(texts):
    return train_bpe(texts, 600)


def llama3_style(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    _train(tok, trainer, texts)
    bos = tok.token_to_id(specials[0])
    # Llama 3's template puts <|begin_of_text|> before every sequence: packing must not.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{specials[0]} $A", special_tokens=[(specials[0], bos)]
    )
    return tok


def metaspace_byte_fallback(texts):
    """SentencePiece-style BPE (Llama 2, Mistral): ▁ for spaces, bytes for what the
    vocabulary lacks (a small alphabet, so the emoji and CJK above fall back to bytes)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=120,
        show_progress=False,
    )
    _train(tok, trainer, texts)
    cfg = json.loads(tok.to_str())
    vocab = cfg["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    cfg["model"]["byte_fallback"] = True
    cfg["model"]["fuse_unk"] = True
    tok = Tokenizer.from_str(json.dumps(cfg))
    tok.decoder = decoders.Sequence(
        [
            decoders.Metaspace(replacement="▁", prepend_scheme="first"),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def wordpiece_bert_truncated(texts):
    """A sentence-transformers-style file: BERT normalizer, [CLS] $A [SEP] template, and
    truncation to 128 with fixed padding to 128 saved in the file."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=800,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    _train(tok, trainer, texts)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.enable_truncation(max_length=128)
    tok.enable_padding(length=128, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok


def unigram(texts):
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=600, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False
    )
    return _train(tok, trainer, texts)


def byte_level_wide(texts):
    """A vocabulary above 65,536 ids: the shards must be uint32 and keep ids > 65,535."""
    from pytrain.data.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(70_000)])
    return tok


def always(text: str) -> bool:
    return True


def no_leading_space(text: str) -> bool:
    """SentencePiece-style decoding drops the space it prepended, and with it a real one."""
    return not text[:1].isspace()


FAMILIES = {
    # name: (builder, texts decode gives back (None: lossy family), expected eos token)
    "gpt2-byte-bpe": (gpt2_style, always, "<|endoftext|>"),
    "llama3-regex-byte-bpe": (llama3_style, always, "<|end_of_text|>"),
    "metaspace-bpe-byte-fallback": (metaspace_byte_fallback, no_leading_space, "</s>"),
    "wordpiece-bert-truncation-padding": (wordpiece_bert_truncated, None, "[SEP]"),  # lowercases
    "unigram": (unigram, None, "</s>"),  # <unk> for characters it never saw
    "byte-level-70k": (byte_level_wide, always, "<|endoftext|>"),
}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus()


def _build(name: str, texts: list[str], tmp: Path) -> Path:
    builder = FAMILIES[name][0]
    path = tmp / f"{name}.json"
    builder([t for t in texts if t.strip()]).save(str(path))
    return path


def _docs_for(name: str, texts: list[str]) -> list[tuple[str, str]]:
    if name == "byte-level-70k":  # use the wide ids
        texts = [t + f" <extra_{69_990 + i % 10}> " for i, t in enumerate(texts)]
    return [(f"doc:{i}", t) for i, t in enumerate(texts)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_shards_hold_every_token_of_every_document(name, texts, tmp_path):
    path = _build(name, texts, tmp_path)
    docs = _docs_for(name, texts)
    said: list[str] = []
    out = tmp_path / "ds"
    r = pack(iter(docs), out, PackOptions(tokenizer=str(path)), say=said.append)

    # The reference: an independent load of the same file, truncation and padding off.
    ref = Tokenizer.from_file(str(path))
    ref.no_truncation()
    ref.no_padding()
    eos_token = FAMILIES[name][2]
    eos = ref.token_to_id(eos_token)
    expected = []
    for _, t in docs:
        ids = ref.encode(t, add_special_tokens=False).ids if t else []
        if ids:
            expected.append(ids + [eos])
    got = read_all_documents(out)
    assert len(got) == len(expected) == r.documents
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.tolist() == e, f"{name}: document {i} differs ({len(g)} vs {len(e)} tokens)"
    assert r.tokens == sum(map(len, expected))

    m = read_manifest(out)
    assert m["tokenizer"]["eos_id"] == eos and m["tokenizer"]["eos_token"] == eos_token
    assert m["tokenizer"]["packing"]["add_special_tokens"] is False
    assert any(eos_token in line for line in said), said
    if name == "byte-level-70k":
        assert m["dtype"] == "uint32" and max(int(g.max()) for g in got) > 65_535
    if name == "wordpiece-bert-truncation-padding":
        off = m["tokenizer"]["packing"]["file_settings_switched_off"]
        assert off["truncation"]["max_length"] == 128 and off["padding"]["strategy"] == {
            "Fixed": 128
        }
        assert max(len(g) for g in got) > 129  # what truncation to 128 would have cut
        assert any("guess" in line and "[SEP]" in line for line in said), said
    lossless = FAMILIES[name][1]
    if lossless is not None:
        dec = Tokenizer.from_file(str(out / "tokenizer.json"))
        kept = [t for _, t in docs if t and ref.encode(t, add_special_tokens=False).ids]
        checked = 0
        for g, t in zip(got, kept, strict=True):
            if lossless(t):
                assert dec.decode(g[:-1].tolist(), skip_special_tokens=False) == t
                checked += 1
        assert checked >= min(10, len(kept))


def test_post_processor_template_adds_nothing(texts, tmp_path):
    """Llama 3's template prepends <|begin_of_text|>; encoding with the template on would
    start every document with it."""
    path = _build("llama3-regex-byte-bpe", texts, tmp_path)
    tok = Tokenizer.from_file(str(path))
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.encode("hello").ids[0] == bos  # the file's template is live
    pack(iter([("d", "hello world")]), tmp_path / "ds", PackOptions(tokenizer=str(path)))
    (doc,) = read_all_documents(tmp_path / "ds")
    assert bos not in doc.tolist()
    assert doc.tolist() == tok.encode("hello world", add_special_tokens=False).ids + [
        tok.token_to_id("<|end_of_text|>")
    ]


def test_eos_and_bos_overrides_by_string_and_id(texts, tmp_path):
    path = _build("metaspace-bpe-byte-fallback", texts, tmp_path)
    tok = Tokenizer.from_file(str(path))
    unk, s = tok.token_to_id("<unk>"), tok.token_to_id("<s>")
    said: list[str] = []
    opts = PackOptions(tokenizer=str(path), eos_token="<unk>", bos_token=str(s), prepend_bos=True)
    pack(iter([("d", "abc def")]), tmp_path / "a", opts, say=said.append)
    (doc,) = read_all_documents(tmp_path / "a")
    body = tok.encode("abc def", add_special_tokens=False).ids
    assert doc.tolist() == [s] + body + [unk]
    t = read_manifest(tmp_path / "a")["tokenizer"]
    assert (t["eos_id"], t["eos_token"], t["bos_id"], t["bos_token"]) == (unk, "<unk>", s, "<s>")
    assert "--eos-token" in t["chosen"]["eos"] and "--bos-token" in t["chosen"]["bos"]
    assert any("'<unk>'" in line and "--eos-token" in line for line in said), said


def test_missing_end_token_is_an_error_naming_the_flag(tmp_path, capsys):
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "t.json"
    tok.save(str(path))
    with pytest.raises(TokenizerError, match="--eos-token"):
        pack(iter([("d", "a b")]), tmp_path / "x", PackOptions(tokenizer=str(path)))
    (tmp_path / "in.txt").write_text("a b a")
    rc = pack_shards(
        [
            str(tmp_path / "in.txt"),
            "-o",
            str(tmp_path / "y"),
            "--tokenizer",
            str(path),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "--eos-token" in err and "Traceback" not in err
    assert not (tmp_path / "y").exists()
    # Naming a token the vocabulary lacks is an error too; naming one it has works.
    rc = pack_shards([str(tmp_path / "in.txt"), "-o", str(tmp_path / "y"), "--tokenizer", str(path),
                      "--eos-token", "</s>", "--no-progress"])  # fmt: skip
    assert rc == 1 and "'</s>'" in capsys.readouterr().err
    rc = pack_shards([str(tmp_path / "in.txt"), "-o", str(tmp_path / "y"), "--tokenizer", str(path),
                      "--eos-token", "2", "--no-progress"])  # fmt: skip
    assert rc == 0
    (doc,) = read_all_documents(tmp_path / "y")
    assert doc.tolist() == [0, 1, 0, 2]


def test_packing_ids_are_the_same_whatever_the_thread_count(texts, tmp_path):
    """Two encode calls in flight and a reader thread must not reorder documents."""
    path = _build("gpt2-byte-bpe", texts, tmp_path)
    docs = _docs_for("gpt2-byte-bpe", texts) * 3
    a = pack(iter(docs), tmp_path / "a", PackOptions(tokenizer=str(path), batch_docs=7))
    b = pack(iter(docs), tmp_path / "b", PackOptions(tokenizer=str(path), batch_docs=500))
    assert a.tokens == b.tokens
    for x, y in zip(
        read_all_documents(tmp_path / "a"), read_all_documents(tmp_path / "b"), strict=True
    ):
        assert np.array_equal(x, y)
