"""Tokenizers for pack-shards and the trainer: a Hugging Face `tokenizer.json`, the
built-in byte-level tokenizer (no file needed), or a small BPE trained on the spot."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
BOS = "<|startoftext|>"
BYTE_TOKENIZER = "byte"


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or lacks what packing needs."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about a tokenizer."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int | None
    bos_id: int | None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "file": "tokenizer.json",
        }


def byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255) plus EOS (256) and BOS (257)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of_char)
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, BOS])
    return tok


def _byte_of_char(ch: str) -> int:
    """Inverse of GPT-2's byte-to-unicode table, to order the alphabet by byte value."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip((chr(c) for c in cs), bs, strict=True))[ch]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE (GPT-2 style) on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(spec: str | Path) -> tuple[Tokenizer, str]:
    """Loads `spec` ("byte" or a path to tokenizer.json); returns it and a display name."""
    if str(spec) == BYTE_TOKENIZER:
        return byte_tokenizer(), BYTE_TOKENIZER
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer file not found: {path} (give a tokenizer.json path or 'byte')"
        )
    try:
        return Tokenizer.from_file(str(path)), str(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{path}: not a valid Hugging Face tokenizer.json: {e}") from e


def describe(tok: Tokenizer, name: str) -> TokenizerInfo:
    """Identity of a tokenizer: content hash, vocabulary size, special token ids."""
    blob = tok.to_str().encode()
    return TokenizerInfo(
        name=name,
        sha256=hashlib.sha256(blob).hexdigest(),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=_special_id(tok, (EOS, "</s>", "<eos>", "[SEP]")),
        bos_id=_special_id(tok, (BOS, "<s>", "<bos>", "[CLS]")),
    )


def _special_id(tok: Tokenizer, candidates: tuple[str, ...]) -> int | None:
    for c in candidates:
        i = tok.token_to_id(c)
        if i is not None:
            return i
    return None
