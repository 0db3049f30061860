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


class Continuations(torch.nn.Module):
    """The forward that scores: a GPT's log-probability of each picked position's target
    token, and whether that token is not the greedy one. `docs` None: each row one request
    (plain causal attention; the padding after it is never read), else each row's
    documents under the document mask. What the trainer compiles where the run compiles."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, ids, pos, docs, at_b, at_t, targets):
        mask = None if docs is None else self.gpt.make_mask(docs, "sdpa_mask")
        h = self.gpt.hidden(ids, pos, mask)
        logp = F.log_softmax(self.gpt.head(h[at_b, at_t]).float(), dim=-1)
        return logp.gather(1, targets[:, None])[:, 0], logp.argmax(dim=-1) != targets


def fixed_width(width: int, row_len: int) -> int:
    """A row width of a few fixed ones (powers of two from 64, at most `row_len`), so that a
    compiled forward sees few shapes."""
    return min(row_len, max(64, 1 << (width - 1).bit_length()))


def score(
    gpt,
    segs: Sequence[Segment],
    *,
    row_len: int,
    device: torch.device,
    batch_rows: int = 8,
    packed: bool = False,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    share: tuple[int, int] = (0, 1),
    all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    forward: Callable | None = None,
    fixed_shapes: bool = False,
    lockstep: bool = False,
) -> Scores:
    """The log-likelihood of each segment's targets and whether they are the greedy tokens.
    `share` (rank, world): this rank scores every world-th batch of rows, and `all_sum`
    adds the ranks' results (each request's is zero on the ranks that did not score it).
    `forward`: Continuations(gpt), or its compiled module; `fixed_shapes`: every batch
    `batch_rows` rows of a fixed_width, and as many picked positions as the most any batch
    of that width has (one compiled graph a width). `lockstep`: every rank runs as many
    forwards as the busiest, the spare ones on a one-token row whose scores are dropped
    (FSDP2 gathers each block's weights in every forward, on every rank)."""
    forward = Continuations(gpt) if forward is None else forward
    lengths = [len(s.inputs) for s in segs]
    rows = pack_rows(lengths, row_len) if packed else one_per_row(lengths)
    batches = [_Batch(segs, rows[i : i + batch_rows], packed)
               for i in range(0, len(rows), batch_rows)]  # fmt: skip
    picks: dict[int, int] = {}  # the most picked positions a batch of each width has
    for b in batches:
        if fixed_shapes:
            b.width, b.rows = fixed_width(b.width, row_len), batch_rows
        picks[b.width] = max(picks.get(b.width, 0), len(b.targets))
    # Each request's (log-likelihood, greedy), and a last column that padding's picks go to.
    out = torch.zeros((2, len(segs) + 1), dtype=torch.float64, device=device)
    rank, world = share
    mine = batches[rank::world]
    spare = -(-len(batches) // world) - len(mine) if lockstep else 0
    was_training = gpt.training
    gpt.eval()
    try:
        with torch.no_grad():
            for b in mine:
                b.run(forward, picks[b.width] if fixed_shapes else 0, device, autocast, out)
            for _ in range(spare):
                _Batch(segs, [[]], False, dummy=True).run(forward, 0, device, autocast, out)
    finally:
        gpt.train(was_training)
    out = all_sum(out[:, :-1]).cpu()
    return Scores(out[0].tolist(), [bool(g) for g in out[1].tolist()],
                  sum(s.truncated for s in segs), len(rows),
                  sum(b.width * b.rows for b in batches),
                  sum(len(b.members) for b in mine))  # fmt: skip


class _Batch:
    """A forward's rows: each row's requests side by side, and the positions that predict
    a continuation token (`targets`, at (row, column), of segment `owner`). `dummy`: one
    token, picked for nothing (owner -1, the dropped column)."""

    def __init__(self, segs: Sequence[Segment], members: list[list[int]], packed: bool,
                 dummy: bool = False):  # fmt: skip
        self.segs, self.members, self.packed = segs, members, packed
        self.rows = len(members)
        self.width = 1 if dummy else max(sum(len(segs[i].inputs) for i in r) for r in members)
        self.at_b: list[int] = [0] if dummy else []
        self.at_t: list[int] = [0] if dummy else []
        self.targets: list[int] = [0] if dummy else []
        self.owner: list[int] = [-1] if dummy else []
        for b, row in enumerate(members):
            start = 0
            for i in row:
                n, k = len(segs[i].inputs), len(segs[i].targets)
                self.at_b += [b] * k
                self.at_t += range(start + n - k, start + n)
                self.targets += segs[i].targets
                self.owner += [i] * k
                start += n

    def run(self, forward, picks: int, device, autocast, out: torch.Tensor) -> None:
        """Adds each segment's log-likelihood (out[0]) and greedy flag (out[1]); `picks`:
        the picked positions padded to this many (0: as many as there are)."""
        ids = torch.zeros((self.rows, self.width), dtype=torch.long)
        pos = torch.zeros((self.rows, self.width), dtype=torch.long)
        docs = torch.full((self.rows, self.width), -1, dtype=torch.long)
        for b, row in enumerate(self.members):
            start = 0
            for d, i in enumerate(row):
                n = len(self.segs[i].inputs)
                ids[b, start : start + n] = torch.tensor(self.segs[i].inputs)
                pos[b, start : start + n] = torch.arange(n)
                docs[b, start : start + n] = d
                start += n
        pad = max(picks - len(self.targets), 0)  # padding: position (0, 0), dropped
        picked = [torch.tensor(x + [v] * pad, device=device)
                  for x, v in ((self.at_b, 0), (self.at_t, 0), (self.targets, 0), (self.owner, -1))]  # fmt: skip
        at_b, at_t, targets, whose = picked
        whose = torch.where(whose < 0, out.shape[1] - 1, whose)
        with autocast():
            ll, miss = forward(ids.to(device), pos.to(device),
                               docs.to(device) if self.packed else None, at_b, at_t, targets)  # fmt: skip
        out[0].index_add_(0, whose, ll.double())
        wrong = torch.zeros_like(out[1]).index_add_(0, whose, miss.double())
        touched = torch.zeros_like(out[1]).index_add_(
            0, whose, torch.ones_like(ll, dtype=out.dtype)
        )
        out[1] += ((wrong == 0) & (touched > 0)).double()
