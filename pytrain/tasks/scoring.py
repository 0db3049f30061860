"""The log-likelihood of each request's continuation given its context, with any GPT of
pytrain (a run's, in training or loaded, or a Hugging Face export's).

Tokens are split as lm-evaluation-harness splits them (TemplateLM._encode_pair): trailing
whitespace of the context moves to the front of the continuation, and the continuation's
tokens are the tail of the whole string's encoding after the context's (so a word the
tokenizer merges across the boundary is scored as the whole string encodes it). An empty
context is one prefix token (the begin-of-text token where the tokenizer has one, else the
end-of-text token), unless the continuation begins with it. A request longer than the model's
window keeps its last window + 1 tokens (the context cut from the left, as
lm-evaluation-harness cuts it) and is counted.

Requests go one a row, longest first, each batch padded to its longest (lm-evaluation-
harness's way), or with `packed` several to a row, each its own document under the document
mask training uses (positions from 0 in each), the rows filled longest request first, each
into the row whose free space fits it most tightly (slower on a CPU, where the mask's
attention is dense: docs/DOWNSTREAM.md). Only the positions that predict a continuation
token go through the output layer."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytrain.tasks.requests import Request

Encode = Callable[..., list[int]]
"""A tokenizer's encoding of a text: encode(text) as its tokenizer's default encodes it
(a template's tokens added, as transformers' tokenizers add them), encode(text,
special=False) without them."""


def encode_pair(
    encode: Encode, context: str, continuation: str, prefix_id: int
) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-evaluation-harness splits them."""
    if context == "":  # the prefix token as the context, unless the text starts with it
        cont = encode(continuation, special=False)
        return ([prefix_id], cont) if cont[:1] != [prefix_id] else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx) :]


@dataclass(frozen=True)
class Segment:
    """A request as one document of a row: the tokens the model reads (the last `window`
    of context + continuation, less the last token), and the continuation's tokens, which
    the last len(targets) positions predict."""

    inputs: list[int]
    targets: list[int]
    truncated: bool


def segments(reqs: Sequence[Request], encode: Encode, prefix_id: int, window: int) -> list[Segment]:
    out = []
    for r in reqs:
        ctx, cont = encode_pair(encode, r.context, r.continuation, prefix_id)
        whole = ctx + cont
        kept = whole[-(window + 1) :]
        n = min(len(cont), len(kept) - 1)
        out.append(Segment(kept[:-1], cont[len(cont) - n :], len(whole) > window + 1))
    return out


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `row_len` tokens: best fit,
    longest first. Deterministic: the same lengths give the same rows on every rank."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = row_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, row))
    return rows


def one_per_row(lengths: Sequence[int]) -> list[list[int]]:
    """Each request a row, longest first (lm-evaluation-harness's order)."""
    return [[i] for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))]


@dataclass
class Scores:
    loglik: list[float]
    greedy: list[bool]
    truncated: int
    rows: int
    """Rows the requests took (their forwards' tokens: rows x the batches' widths)."""
    tokens: int
    """Tokens the forwards read, padding included."""
    mine: int = 0
    """Rows this rank scored itself (all of them in one process)."""


def score(
    gpt,
    segs: Sequence[Segment],
    *,
    row_len: int,
    batch_rows: int,
    device: torch.device,
    packed: bool = True,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    share: tuple[int, int] = (0, 1),
    all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Scores:
    """The log-likelihood of each segment's targets and whether they are the greedy tokens.
    `share` (rank, world): this rank scores every world-th batch of rows, and `all_sum`
    adds the ranks' results (each request's is zero on the ranks that did not score it)."""
    lengths = [len(s.inputs) for s in segs]
    rows = pack_rows(lengths, row_len) if packed else one_per_row(lengths)
    batches = [rows[i : i + batch_rows] for i in range(0, len(rows), batch_rows)]
    out = torch.zeros((2, len(segs)), dtype=torch.float64, device=device)
    tokens = mine = 0
    rank, world = share
    was_training = gpt.training
    gpt.eval()
    try:
        with torch.no_grad():
            for b, batch in enumerate(batches):
                width = max(sum(lengths[i] for i in row) for row in batch)
                tokens += width * len(batch)
                if b % world == rank:
                    _score_batch(gpt, segs, batch, width, device, autocast, out)
                    mine += len(batch)
    finally:
        gpt.train(was_training)
    out = all_sum(out).cpu()
    return Scores(out[0].tolist(), [bool(g) for g in out[1].tolist()],
                  sum(s.truncated for s in segs), len(rows), tokens, mine)  # fmt: skip


def _score_batch(gpt, segs, batch, width, device, autocast, out: torch.Tensor) -> None:
    """Adds each segment's log-likelihood (out[0]) and greedy flag (out[1])."""
    B = len(batch)
    ids = torch.zeros((B, width), dtype=torch.long)
    pos = torch.zeros((B, width), dtype=torch.long)
    docs = torch.full((B, width), -1, dtype=torch.long)
    # Each continuation token: its row, its position, the token, its segment.
    at_b: list[int] = []
    at_t: list[int] = []
    targets: list[int] = []
    owner: list[int] = []
    for b, row in enumerate(batch):
        start = 0
        for d, i in enumerate(row):
            s = segs[i]
            n = len(s.inputs)
            ids[b, start : start + n] = torch.tensor(s.inputs)
            pos[b, start : start + n] = torch.arange(n)
            docs[b, start : start + n] = d
            k = len(s.targets)
            at_b += [b] * k
            at_t += range(start + n - k, start + n)
            targets += s.targets
            owner += [i] * k
            start += n
    ids, pos, docs = ids.to(device), pos.to(device), docs.to(device)
    with autocast():
        h = gpt.hidden(ids, pos, gpt.make_mask(docs, "sdpa_mask"))
        picked = h[torch.tensor(at_b, device=device), torch.tensor(at_t, device=device)]
        logits = gpt.head(picked)
    logp = F.log_softmax(logits.float(), dim=-1)
    want = torch.tensor(targets, device=device)
    ll = logp.gather(1, want[:, None])[:, 0].double()
    miss = (logp.argmax(dim=-1) != want).double()
    whose = torch.tensor(owner, device=device)
    out[0].index_add_(0, whose, ll)
    wrong = torch.zeros_like(out[1]).index_add_(0, whose, miss)
    touched = torch.zeros_like(out[1]).index_add_(0, whose, torch.ones_like(miss))
    out[1] += ((wrong == 0) & (touched > 0)).double()
