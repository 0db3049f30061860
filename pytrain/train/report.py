"""What the user sees at the end of a run: validation loss next to the unigram baseline,
the downstream tasks' last scores, a few generated samples, and where logs and checkpoints
went."""

from __future__ import annotations

import numpy as np
import torch

from pytrain.data.documents import sample_documents

SAMPLE_TOKENS = 4_000_000
"""Tokens read from each dataset for the unigram baseline: a bounded sample, so a
10 B-token dataset costs what the embedded one does."""
PROMPT_TOKENS = 8


def unigram_baseline(train_path, val_path, vocab: int, max_tokens: int = SAMPLE_TOKENS) -> float:
    """Cross-entropy (nats/token) of validation tokens under the training set's unigram
    distribution (add-one smoothed): what a model without context achieves. Both come
    from bounded samples of frames (`sample_documents`)."""
    train = np.concatenate(sample_documents(train_path, max_tokens)).astype(np.int64)
    val = np.concatenate(sample_documents(val_path, max_tokens)).astype(np.int64)
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def prompts(path, n: int, tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    """The first `tokens` ids of `n` held-out documents (spread over the dataset)."""
    docs = [d for d in sample_documents(path, 200_000) if len(d) > tokens]
    step = max(1, len(docs) // max(1, n))
    return [docs[i][:tokens].tolist() for i in range(0, len(docs), step)][:n]


def samples(trainer, n: int, tokens: int) -> list[str]:
    from tokenizers import Tokenizer

    # The dataset's tokenizer, copied into the run directory at start (sources.keep_tokenizer).
    path = trainer.run_dir / "tokenizer.json"
    if n <= 0 or not path.exists():
        return []
    if trainer.sharded:
        # Only rank 0 reports, and under FSDP2 it holds a shard of each parameter.
        return [
            "(samples skipped: the model is sharded by FSDP2; sample from the checkpoint in one process)"
        ]
    tok = Tokenizer.from_file(str(path))
    eos = trainer.loader.dataset.eos_id  # as pack-shards chose it
    out = []
    torch.manual_seed(0)
    trainer.gpt.eval()
    for p in prompts(trainer.val_path or trainer.train_path, n):
        ids = torch.tensor([p], device=trainer.device)
        with trainer.precision.autocast(trainer.device):
            ids = trainer.gpt.generate(ids, tokens, stop=eos)
        out.append(tok.decode(ids[0].tolist()))
    trainer.gpt.train()
    return out


def final_report(trainer, result: dict, seconds: float) -> None:
    say = trainer.say
    val = result["val_loss"]
    if val is not None and trainer.val_path is not None:
        base = unigram_baseline(trainer.train_path, trainer.val_path, trainer.gpt.vocab)
        verdict = "below" if val < base else "NOT below"
        say(
            f"validation loss {val:.4f} nats/token vs unigram baseline {base:.4f}: {verdict} the baseline by {base - val:.3f}"
        )
        trainer.log.text(f"final val_loss {val:.4f} unigram_baseline {base:.4f}")
    if (tasks := trainer.tasks.last) is not None:  # the downstream tasks' last scores
        say("\n".join(tasks.lines()))
    for i, s in enumerate(samples(trainer, trainer.cfg.samples, trainer.cfg.sample_tokens)):
        say(f"--- sample {i + 1} ---\n{s}")
    stats = trainer.loader.stats()
    pad = stats["pad_tokens"] / max(1, stats["pad_tokens"] + stats["doc_tokens"])
    say(
        f"done: {result['step']} steps, {trainer.tokens_seen:,} tokens in {seconds:.0f}s; "
        f"loader padding {pad:.2%}, data wait {stats['wait_s']:.2f}s; skipped steps {result['skipped']}; "
        f"compile fallbacks {len(result['fallbacks'])}"
        + (
            f"; peak GPU memory {torch.cuda.max_memory_allocated(trainer.device) / 1e9:.1f} GB "
            f"({torch.cuda.max_memory_reserved(trainer.device) / 2**30:.2f} GiB reserved)"
            if trainer.device.type == "cuda"
            else ""
        )
    )
    say(f"checkpoints and logs: {trainer.run_dir}/ (train.log, ckpt-*.pt)")
    if trainer.cfg.tensorboard:
        say(f"TensorBoard: tensorboard --logdir {trainer.run_dir.parent}")
