"""`python -m pytrain.export RUN_DIR_OR_CHECKPOINT OUT_DIR`: a Hugging Face model
directory that `transformers` loads offline with no custom code:

    config.json  model.safetensors  generation_config.json
    tokenizer.json  tokenizer_config.json  special_tokens_map.json

the weights in files of at most 5 GB where they are larger (model-00001-of-00007.safetensors
and on, with model.safetensors.index.json, as Hugging Face cuts them; `--max_shard_size`).

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(OUT_DIR)
    tok = AutoTokenizer.from_pretrained(OUT_DIR)

Needs the `hf` extra (`pip install 'pytrain[hf]'`: transformers, safetensors). The class
is chosen by pytrain.model.hf (SwiGLU -> Llama, GELU -> Arcee); a variant without one is
refused with the list of exportable ones. `--dtype bf16` writes the weights in bf16 (half
the size: 2.5 GB instead of 5 at 1.2B parameters) instead of the checkpoint's fp32."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""--dtype: the weights' dtype in the safetensors files, by its name in config.json."""
MAX_SHARD_SIZE = "5GB"
"""--max_shard_size: the largest weight file, as the Hub's Llama checkpoints are cut (an 8B
in fp32 is 7 files); huggingface_hub's notation ("5GB", "500MB")."""
INDEX = "model.safetensors.index.json"


def export(
    src: str | Path, out: str | Path, dtype: str = "fp32", max_shard_size: str = MAX_SHARD_SIZE
) -> Path:
    import torch

    from pytrain.config import ConfigError
    from pytrain.data.shards import read_manifest
    from pytrain.model import families
    from pytrain.model.hf import NotExportable
    from pytrain.model.load import dataset_of, load

    try:  # before the minutes an 8B's checkpoint takes to read: the library's own parser
        from huggingface_hub import split_torch_state_dict_into_shards

        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max_shard_size {max_shard_size!r}: {e}") from None
    loaded = load(src)
    if loaded.config is None:
        raise ConfigError(f"{src} is already an exported directory")
    gpt, cfg = loaded.gpt, loaded.gpt.cfg
    data = dataset_of(loaded.config["data"])
    tok = {} if data is None else read_manifest(data)["tokenizer"]
    hf = families.of(cfg).hf
    try:
        config = hf.hf_config(cfg, gpt.vocab, tok.get("eos_id"), tok.get("bos_id"))
        weights = hf.to_hf(cfg, gpt.state_dict())
    except NotExportable as e:
        raise ConfigError(f"{src}: {e}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config["torch_dtype"] = DTYPES[dtype]
    weights = {k: v.to(getattr(torch, DTYPES[dtype])) for k, v in weights.items()}
    write_weights(weights, out, max_shard_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "max_length": cfg.max_seq_len, "do_sample": True, "temperature": 0.8, "top_k": 50}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if loaded.tokenizer is not None:
        shutil.copyfile(loaded.tokenizer, out / "tokenizer.json")
        special = {k: tok[f"{k}_token"] for k in ("eos", "bos") if tok.get(f"{k}_token")}
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
              "clean_up_tokenization_spaces": False, **{f"{k}_token": v for k, v in special.items()}}  # fmt: skip
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
        (out / "special_tokens_map.json").write_text(
            json.dumps({f"{k}_token": v for k, v in special.items()}, indent=2) + "\n"
        )
    return out


def write_weights(weights: dict, out: Path, max_shard_size: str | int) -> None:
    """The weights as Hugging Face writes them (huggingface_hub's split, as
    `save_pretrained`): model.safetensors where they fit one shard, else
    model-0000N-of-0000M.safetensors and model.safetensors.index.json naming each tensor's
    file. Each file is written under a temporary name and renamed, and the weight files of
    an earlier export into `out` that this one does not write are removed, so that
    transformers never reads a mix of the two."""
    import os

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(weights, max_shard_size=max_shard_size)
    written = []
    for name, tensors in split.filename_to_tensors.items():
        tmp = out / f".{name}.tmp"
        save_file({t: weights[t] for t in tensors}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        written.append(name)
    if split.is_sharded:
        total = sum(v.numel() * v.element_size() for v in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
        tmp = out / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / INDEX)
        written.append(INDEX)
    earlier = [
        out / "model.safetensors",
        out / INDEX,
        *out.glob("model-?????-of-?????.safetensors"),
    ]
    for stale in earlier:
        if stale.name not in written and stale.is_file():
            stale.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pytrain.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("source", help="a run directory (its newest checkpoint) or a ckpt-*.pt file")
    p.add_argument("out", help="the directory to write")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                   help="the weights' dtype (default: fp32, as trained)")  # fmt: skip
    p.add_argument("--max_shard_size", default=MAX_SHARD_SIZE,
                   help=f"the largest weight file; larger models are sharded, with {INDEX} "
                        f"(default: {MAX_SHARD_SIZE})")  # fmt: skip
    args = p.parse_args(argv)
    from pytrain.config import missing_model

    if missing := missing_model(args.source):  # at once: torch takes seconds to load
        print(f"pytrain.export: error: {missing}", file=sys.stderr)
        return 2
    from pytrain._loader import LoaderError
    from pytrain.config import ConfigError

    try:
        out = export(args.source, args.out, args.dtype, args.max_shard_size)
    except (ConfigError, LoaderError, ValueError) as e:
        print(f"pytrain.export: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(
            f"pytrain.export: error: {e.name} is missing: pip install 'pytrain[hf]'",
            file=sys.stderr,
        )
        return 2
    print(f"exported {args.source} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
