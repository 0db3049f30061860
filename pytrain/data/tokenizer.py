"""Tokenizers for pack-shards and the trainer: a Hugging Face `tokenizer.json`, the
built-in byte-level tokenizer (no file needed), or a small BPE trained on the spot.

Packing needs every token of every document, whatever the file says: `for_packing`
switches off the truncation and padding a tokenizer.json may carry (many in the wild are
saved from an embedding model with `max_length` 128 and fixed padding), and documents are
encoded with `add_special_tokens=False`, so a post-processor's template ([CLS] ... [SEP],
<s> ...) adds nothing. The end- and begin-of-document tokens are chosen here, once, and
recorded in the manifest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
BOS = "<|startoftext|>"
BYTE_TOKENIZER = "byte"


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or lacks what packing needs."""


# Names of end- and begin-of-document tokens across model families, most specific first:
# GPT-2/Qwen/OLMo, Llama 3, Llama 2/Mistral/T5, Gemma, DeepSeek; BERT's [SEP]/[CLS] last
# (a guess for a vocabulary made for classification, printed as one).
EOS_CANDIDATES = (
    EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[SEP]",
)  # fmt: skip
BOS_CANDIDATES = (
    BOS, "<|begin_of_text|>", "<s>", "<bos>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "[CLS]",
)  # fmt: skip
GUESSES = ("[SEP]", "[CLS]")


@dataclass(frozen=True)
class SpecialToken:
    """An end- or begin-of-document token and how it was chosen."""

    id: int
    token: str | None
    chosen: str
    """"automatic", "automatic guess" (a BERT-style [SEP]/[CLS]) or the flag that named it."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about a tokenizer."""

    name: str
    sha256: str | None
    """Of the tokenizer's settings as packing uses them; None for imported ids without one."""
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    eos_token: str | None = None
    bos_token: str | None = None
    chosen: dict = field(default_factory=dict)
    """How eos and bos were chosen ({"eos": "automatic", "bos": "--bos-token"})."""
    switched_off: dict = field(default_factory=dict)
    """The file's truncation and padding settings, switched off for packing (None: unset)."""

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "eos_token": self.eos_token,
            "bos_token": self.bos_token,
            "chosen": self.chosen,
            "packing": {
                "truncation": "off",
                "padding": "off",
                "add_special_tokens": False,
                "file_settings_switched_off": self.switched_off,
            },
            "file": "tokenizer.json",
        }

    @classmethod
    def from_manifest(cls, t: dict) -> TokenizerInfo:
        """The `tokenizer` table of a manifest (older manifests lack the newer keys)."""
        return cls(
            name=t["name"],
            sha256=t.get("sha256", "0" * 64),
            vocab_size=int(t["vocab_size"]),
            eos_id=t.get("eos_id"),
            bos_id=t.get("bos_id"),
            eos_token=t.get("eos_token"),
            bos_token=t.get("bos_token"),
            chosen=t.get("chosen", {}),
            switched_off=t.get("packing", {}).get("file_settings_switched_off", {}),
        )


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


def for_packing(tok: Tokenizer) -> dict:
    """Switches off truncation and padding (packing keeps every token of a document);
    returns what the file had set, for the manifest."""
    cfg = json.loads(tok.to_str())
    was = {k: cfg.get(k) for k in ("truncation", "padding") if cfg.get(k) is not None}
    tok.no_truncation()
    tok.no_padding()
    return was


def describe(
    tok: Tokenizer,
    name: str,
    *,
    eos: str | None = None,
    bos: str | None = None,
    switched_off: dict | None = None,
) -> TokenizerInfo:
    """Identity of a tokenizer: content hash (of the settings packing uses), vocabulary
    size, and the end/begin-of-document tokens: `eos`/`bos` (a token or an id, from
    --eos-token/--bos-token) or the first of the known names the vocabulary has."""
    blob = tok.to_str().encode()
    e = choose_special(tok, eos, EOS_CANDIDATES, "--eos-token")
    b = choose_special(tok, bos, BOS_CANDIDATES, "--bos-token")
    return TokenizerInfo(
        name=name,
        sha256=hashlib.sha256(blob).hexdigest(),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=e.id if e else None,
        bos_id=b.id if b else None,
        eos_token=e.token if e else None,
        bos_token=b.token if b else None,
        chosen={k: v.chosen for k, v in (("eos", e), ("bos", b)) if v is not None},
        switched_off=switched_off or {},
    )


def choose_special(
    tok: Tokenizer, spec: str | None, candidates: tuple[str, ...], flag: str
) -> SpecialToken | None:
    """The token `spec` names (a token string, or a decimal id), else the first candidate
    in the vocabulary, else None. A `spec` the vocabulary lacks is an error naming `flag`."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if spec is not None:
        if spec.isdigit():
            i = int(spec)
            if i >= vocab:
                raise TokenizerError(f"{flag} {spec}: id outside the vocabulary (size {vocab})")
            return SpecialToken(i, tok.id_to_token(i), f"set by {flag}")
        found = tok.token_to_id(spec)
        if found is None:
            raise TokenizerError(
                f"{flag} {spec!r}: no such token in the tokenizer (give a token string or an id)"
            )
        return SpecialToken(found, spec, f"set by {flag}")
    for c in candidates:
        found = tok.token_to_id(c)
        if found is not None:
            how = "automatic guess" if c in GUESSES else "automatic"
            return SpecialToken(found, c, f"{how}; choose another with {flag}")
    return None
