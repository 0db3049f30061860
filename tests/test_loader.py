"""TokenLoader through the extension: exactly-once delivery, determinism across thread
counts, exact resume, disjoint ranks, bucket shapes, zero copy, typed errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import traceable_docs, write_synthetic

from pytrain import _loader
from pytrain.data import CorruptShardError, StateError, TokenLoader


def delivered_tokens(batch) -> np.ndarray:
    t = batch.tokens.numpy()
    return t[batch.doc_ids.numpy() >= 0]


def take(loader, n=None) -> list[dict]:
    """Copies of up to n batches (all, if None), releasing each slot."""
    out = []
    for b in loader:
        out.append(
            {k: getattr(b, k).clone() for k in ("tokens", "position_ids", "doc_ids", "loss_mask")}
            | {"epoch": b.epoch}
        )
        b.release()
        if n is not None and len(out) == n:
            break
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x[k], y[k]) for k in ("tokens", "position_ids", "doc_ids", "loss_mask"))
        for x, y in zip(a, b, strict=True)
    )


def all_tokens(docs) -> np.ndarray:
    return np.sort(np.concatenate(docs).astype(np.int64))


@pytest.mark.parametrize("strategy", ["best_fit", "concat"])
@pytest.mark.parametrize("epochs", [1, 3])
def test_pack_delivers_every_token_once_per_epoch(synthetic_dataset, strategy, epochs):
    # Batches stream across epoch boundaries (no padding there), so check the multiset.
    path, docs = synthetic_dataset
    loader = TokenLoader(
        path, seq_len=127, batch_size=4, num_epochs=epochs, strategy=strategy, frames_per_block=3
    )
    got, rows = [], 0
    for b in loader:
        assert b.tokens.shape == (4, 128)
        rows += 4
        got.append(delivered_tokens(b).astype(np.int64))
        b.release()
    assert np.array_equal(np.sort(np.concatenate(got)), np.sort(np.tile(all_tokens(docs), epochs)))
    s = loader.stats()
    assert s["doc_tokens"] == epochs * sum(len(d) for d in docs)
    assert s["doc_tokens"] + s["pad_tokens"] == rows * 128
    if strategy == "best_fit":
        assert s["documents_cut"] == epochs * sum(len(d) > 128 for d in docs)
    assert loader.epoch == epochs


def test_row_metadata_matches_documents(synthetic_dataset):
    path, _ = synthetic_dataset
    b = next(iter(TokenLoader(path, seq_len=255, batch_size=2)))
    t, pos, doc, mask = (x.numpy() for x in (b.tokens, b.position_ids, b.doc_ids, b.loss_mask))
    for r in range(2):
        for seg in range(doc[r].max() + 1):
            idx = np.nonzero(doc[r] == seg)[0]
            assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))  # contiguous
            assert np.array_equal(pos[r, idx], np.arange(len(idx)))
            assert np.all(np.diff(t[r, idx]) == 1)  # consecutive tokens of one document
            assert mask[r, idx[:-1]].all() and mask[r, idx[-1]] == 0
        assert mask[r][doc[r] < 0].sum() == 0


def test_same_batches_for_any_thread_count(synthetic_dataset):
    path, _ = synthetic_dataset
    runs = [
        take(
            TokenLoader(
                path, seq_len=63, batch_size=3, num_epochs=2, threads=t, frames_per_block=2, slots=s
            )
        )
        for t, s in ((1, 1), (2, 3), (8, 5))
    ]
    assert len(runs[0]) > 20
    assert same(runs[0], runs[1]) and same(runs[0], runs[2])


def test_seed_and_epoch_change_the_order(synthetic_dataset):
    path, _ = synthetic_dataset
    a = take(TokenLoader(path, seq_len=63, batch_size=3, seed=1), 5)
    b = take(TokenLoader(path, seq_len=63, batch_size=3, seed=2), 5)
    assert not same(a, b)


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_resume_at_any_batch_gives_the_same_continuation(synthetic_dataset, mode):
    path, _ = synthetic_dataset
    kw = dict(
        seq_len=63,
        batch_size=3,
        mode=mode,
        bucket_lengths=(16, 64, 256),
        token_budget=512,
        num_epochs=2,
        frames_per_block=2,
    )
    full = take(TokenLoader(path, **kw))
    for k in (0, 1, 7, len(full) // 2, len(full) - 1):
        first = TokenLoader(path, **kw)
        take(first, k) if k else None
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
        resumed = TokenLoader(path, **kw)
        resumed.load_state_dict(state)
        assert same(take(resumed), full[k:]), k


def test_ranks_are_disjoint_and_complete(synthetic_dataset):
    path, docs = synthetic_dataset
    for world in (2, 3, 4):
        seen = []
        for rank in range(world):
            for b in TokenLoader(
                path,
                seq_len=127,
                batch_size=2,
                num_epochs=1,
                rank=rank,
                world_size=world,
                frames_per_block=1,
            ):
                seen.append(delivered_tokens(b).astype(np.int64))
                b.release()
        assert np.array_equal(np.sort(np.concatenate(seen)), all_tokens(docs)), world


def _ranks_take(path, world, n, state=None, **kw) -> tuple[list[np.ndarray], list[dict]]:
    """Each of `world` ranks takes `n` batches (all, if None) from `state`: the tokens
    they got, and each rank's state after them."""
    got, states = [], []
    for rank in range(world):
        loader = TokenLoader(path, rank=rank, world_size=world, **kw)
        if state is not None:
            loader.load_state_dict(state)
        for i, b in enumerate(loader):
            got.append(delivered_tokens(b).astype(np.int64))
            b.release()
            if n is not None and i + 1 == n:
                break
        states.append(loader.state_dict())
        loader.close()
    return got, states


@pytest.mark.parametrize("mode", ["pack", "bucket"])
@pytest.mark.parametrize("before,after", [(4, 3), (4, 6), (2, 1)])
def test_resume_on_another_world_size_delivers_every_document_once(
    synthetic_dataset, mode, before, after
):
    path, docs = synthetic_dataset
    kw = dict(seq_len=63, batch_size=2, frames_per_block=1, num_epochs=1, mode=mode,
              bucket_lengths=[32, 128], token_budget=512)  # fmt: skip
    got, states = _ranks_take(path, before, 25 if mode == "pack" else 10, **kw)
    # At a step boundary the state is the same on every rank, whatever the world size.
    assert all(st == states[0] for st in states)
    rest, _ = _ranks_take(path, after, None, state=states[0], **kw)
    assert len(rest) > after  # the epoch was not over at the switch
    delivered = np.sort(np.concatenate(got + rest))
    assert np.array_equal(delivered, all_tokens(docs))  # no loss, no repeat


def test_resume_with_another_batch_size_continues_the_same_rows(synthetic_dataset):
    """Rows are packed block by block whatever the batch size: a state saved between
    batches of 4 rows is a row that batches of 3 (here also on 2 ranks instead of 1)
    continue from, so a micro-batch that no longer fits the GPU can shrink on resume."""
    path, docs = synthetic_dataset
    kw = dict(seq_len=63, frames_per_block=1, num_epochs=1)

    def rows(batches) -> list[np.ndarray]:  # a last batch's empty rows left out
        return [
            r for b in batches for r in np.asarray(b["tokens"] * (b["doc_ids"] >= 0)) if r.any()
        ]

    whole = rows(take(TokenLoader(path, batch_size=4, **kw)))
    first = TokenLoader(path, batch_size=4, **kw)
    taken = take(first, 7)
    head = rows(taken)
    state = first.state_dict()
    rest = TokenLoader(path, batch_size=3, **kw)
    rest.load_state_dict(state)
    tail = rows(take(rest))
    got = head + tail
    assert len(head) == 28 and len(got) == len(whole)
    assert all(np.array_equal(a, b) for a, b in zip(got, whole, strict=True))  # row for row
    # And on 2 ranks of 3-row batches: every document once.
    ranks, _ = _ranks_take(path, 2, None, state=state, batch_size=3, **kw)
    delivered = np.concatenate([np.asarray(b["tokens"][b["doc_ids"] >= 0]) for b in taken] + ranks)
    assert np.array_equal(np.sort(delivered.astype(np.int64)), all_tokens(docs))


# A state the build before batch sizes could change saved (7 batches of 4 rows of 64 from
# this synthetic set): its fingerprint holds the batch size.
LEGACY_STATE = {"version": 2, "config": "5942582464460774", "items": 28,
                "sources": [{"manifest_hash": "9c23a37ff2448dc3", "epoch": 0, "block": 0,
                             "item": 28, "tokens": 1792, "stage_tokens": 1792}],
                "names": ["legacy_ds"]}  # fmt: skip


def test_a_state_saved_before_batch_sizes_could_change_resumes_at_its_batch_size(tmp_path):
    _loader.write_synthetic(str(tmp_path / "ds"), 500, mu=4.0, sigma=1.0, vocab=256, seed=1)
    kw = dict(seq_len=63, frames_per_block=1)
    same = TokenLoader(tmp_path / "ds", batch_size=4, **kw)
    same.load_state_dict(LEGACY_STATE)
    fresh = TokenLoader(tmp_path / "ds", batch_size=4, **kw)
    want = take(fresh, 8)[7]["tokens"]
    assert torch.equal(take(same, 1)[0]["tokens"], want)  # the 8th batch, as before
    with pytest.raises(StateError, match="for a state saved before batch sizes could change"):
        TokenLoader(tmp_path / "ds", batch_size=3, **kw).load_state_dict(LEGACY_STATE)


def test_documents_that_fit_a_row_stay_whole_across_a_world_size_change(synthetic_dataset):
    path, docs = synthetic_dataset
    kw = dict(seq_len=255, batch_size=2, frames_per_block=1, num_epochs=1)
    first, states = _ranks_take(path, 4, 5, **kw)
    rest, _ = _ranks_take(path, 3, None, state=states[0], **kw)
    lengths = {int(d[0]) // 10_000: len(d) for d in docs}
    pieces: dict[int, int] = {}
    for toks in first + rest:
        for doc, n in zip(*np.unique(toks // 10_000, return_counts=True), strict=True):
            pieces[int(doc)] = pieces.get(int(doc), 0) + 1
            assert n == lengths[int(doc)] or lengths[int(doc)] > 256, "a short document was cut"


def test_a_dataset_with_fewer_frames_than_ranks_works(tmp_path):
    docs = traceable_docs([40, 50, 60])
    path = write_synthetic(tmp_path / "tiny", docs, frame_bytes=1 << 16)
    assert _loader.Dataset(str(path)).n_frames == 1
    got, _ = _ranks_take(path, 4, None, seq_len=31, batch_size=1, num_epochs=1)
    assert np.array_equal(np.sort(np.concatenate(got)), all_tokens(docs))


def _mix(paths, weights, stages=(), **kw):
    return TokenLoader(paths, weights=weights, stages=stages, seq_len=127, batch_size=4,
                       frames_per_block=2, **kw)  # fmt: skip


@pytest.fixture
def three_sources(tmp_path):
    out = {}
    for i, (name, n) in enumerate([("web", 900), ("code", 300), ("math", 60)]):
        rng = np.random.default_rng(i)
        lengths = np.clip(rng.lognormal(4.0, 1.0, size=n).astype(int), 1, 2000)
        docs = [d + i * 100_000_000 for d in traceable_docs(lengths)]
        out[name] = (write_synthetic(tmp_path / name, docs), docs)
    return out


def test_mixture_shares_stages_and_up_sampling(three_sources):
    paths = {k: v[0] for k, v in three_sources.items()}
    weights = {"web": 0.6, "code": 0.3, "math": 0.1}
    stages = [(200, {"web": 0.2, "code": 0.2, "math": 0.6})]
    loader = _mix(paths, weights, stages)
    per_batch = []
    for i, b in enumerate(loader):
        src = (delivered_tokens(b).astype(np.int64) // 100_000_000).tolist()
        per_batch.append(np.bincount(src, minlength=3))
        b.release()
        if i + 1 == 400:
            break
    s = loader.stats()
    first, second = np.sum(per_batch[:200], axis=0), np.sum(per_batch[200:], axis=0)
    for got, want in ((first, weights), (second, stages[0][1])):
        shares = got / got.sum()
        for j, name in enumerate(["web", "code", "math"]):
            assert abs(shares[j] - want[name]) < 0.01, (name, shares)
    # The stage starts at its exact batch: batch 200 is the first under the new weights.
    assert per_batch[200][2] > 0 and sum(per_batch[199 - k][2] for k in range(3)) <= sum(
        per_batch[200 + k][2] for k in range(3)
    )
    assert sum(s["tokens_by_source"].values()) == int(np.sum(per_batch))
    assert s["tokens_by_source"]["math"] == int(np.sum(per_batch, axis=0)[2])
    # math (60 documents) is repeated to give its share: many more epochs than web.
    assert s["epochs_by_source"]["math"] >= 5 * (s["epochs_by_source"]["web"] + 1)
    loader.close()


def test_mixture_is_thread_count_independent_and_resumes_exactly_mid_stage(three_sources):
    paths = {k: v[0] for k, v in three_sources.items()}
    weights, stages = {"web": 0.5, "code": 0.4, "math": 0.1}, [(30, {"web": 0.1, "code": 0.9})]
    a = take(_mix(paths, weights, stages, threads=1), 60)
    b = take(_mix(paths, weights, stages, threads=4), 60)
    assert same(a, b)
    first = _mix(paths, weights, stages, threads=2)
    take(first, 20)
    state = first.state_dict()
    again = _mix(paths, weights, stages, threads=3)
    again.load_state_dict(state)
    assert same(take(again, 40), a[20:])  # across the stage switch at batch 30


def test_mixture_resumes_on_another_world_size(three_sources):
    paths = {k: v[0] for k, v in three_sources.items()}
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    kw = dict(seq_len=63, batch_size=2, frames_per_block=1, num_epochs=1)
    got, states = _ranks_take(paths, 4, 25, weights=weights, **kw)
    assert all(st == states[0] for st in states)
    rest, _ = _ranks_take(paths, 3, None, state=states[0], weights=weights, **kw)
    want = np.sort(np.concatenate([all_tokens(v[1]) for v in three_sources.values()]))
    assert np.array_equal(np.sort(np.concatenate(got + rest)), want)


def test_mixture_resumes_with_another_batch_size_row_for_row(three_sources):
    """The mixture picks a source per row: its rows do not depend on the batch size either."""
    paths = {k: v[0] for k, v in three_sources.items()}
    kw = dict(weights={"web": 0.5, "code": 0.3, "math": 0.2}, seq_len=63, frames_per_block=1,
              num_epochs=1)  # fmt: skip

    def rows(batches) -> list[np.ndarray]:
        return [
            r for b in batches for r in np.asarray(b["tokens"] * (b["doc_ids"] >= 0)) if r.any()
        ]

    whole = rows(take(TokenLoader(paths, batch_size=2, **kw)))
    first = TokenLoader(paths, batch_size=2, **kw)
    head = rows(take(first, 9))
    rest = TokenLoader(paths, batch_size=5, **kw)
    rest.load_state_dict(first.state_dict())
    got = head + rows(take(rest))
    assert len(head) == 18 and len(got) == len(whole)
    assert all(np.array_equal(a, b) for a, b in zip(got, whole, strict=True))


def test_mixture_refuses_other_tokenizers_and_bad_weights(three_sources, tmp_path):
    paths = {k: v[0] for k, v in three_sources.items()}
    other = write_synthetic(tmp_path / "other", traceable_docs([30, 40]), vocab=50_000)
    with pytest.raises(ValueError, match="another tokenizer") as e:
        _mix({"web": paths["web"], "other": other}, {"web": 1, "other": 1})
    assert "(vocabulary 50000 vs " in str(e.value) and "Some(" not in str(e.value)
    with pytest.raises(ValueError, match="no dataset named 'wbe'"):
        _mix(paths, {"wbe": 1.0})
    with pytest.raises(ValueError, match="needs weights"):
        TokenLoader(paths)
    with pytest.raises(ValueError, match="needs mode 'pack'"):
        _mix(paths, {"web": 1.0}, mode="bucket")
    loader = _mix(paths, {"web": 1.0, "code": 1.0, "math": 1.0})
    with pytest.raises(StateError, match="saved for datasets web, code"):
        TokenLoader(paths["web"], seq_len=127, batch_size=4, frames_per_block=2).load_state_dict(
            {**loader.state_dict(), "names": ["web", "code"]}
        )


def test_bucket_mode_uses_few_shapes_and_delivers_everything(synthetic_dataset):
    path, docs = synthetic_dataset
    lengths = (32, 128, 512)
    loader = TokenLoader(
        path, mode="bucket", bucket_lengths=lengths, token_budget=1024, num_epochs=1
    )
    shapes, got = set(), []
    for b in loader:
        shapes.add(tuple(b.tokens.shape))
        got.append(delivered_tokens(b).astype(np.int64))
        b.release()
    assert shapes <= {(1024 // n, n + 1) for n in lengths}
    assert np.array_equal(np.sort(np.concatenate(got)), all_tokens(docs))
    # Padding is what rounding each piece up to its bucket costs, plus, per block, the
    # leftovers of each bucket (fewer than a batch) moved up and the last batch padded.
    pieces = [len(d[i : i + 513]) for d in docs for i in range(0, len(d), 513)]
    inherent = sum(min(n for n in lengths if n + 1 >= p) + 1 - p for p in pieces)
    leftovers = loader._inner.blocks_per_epoch[0] * sum(1024 // n for n in lengths) * 513
    s = loader.stats()
    assert inherent <= s["pad_tokens"] <= inherent + leftovers


def test_batches_are_views_of_the_slots(synthetic_dataset):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=63, batch_size=2, slots=2)
    b = next(loader)
    slot_ptrs = {s[0].data_ptr() for s in loader._slots}
    assert b.tokens.data_ptr() in slot_ptrs
    assert b.tokens.untyped_storage().data_ptr() == b.tokens.data_ptr()


def test_holding_every_slot_raises_instead_of_hanging_or_overwriting(synthetic_dataset):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=63, batch_size=2, slots=2)
    a, b = next(loader), next(loader)
    snapshot = a.tokens.clone()
    with pytest.raises(ValueError, match="all 2 slots are held"):
        next(loader)
    assert torch.equal(a.tokens, snapshot)
    a.release()
    c = next(loader)
    assert c.tokens.shape == b.tokens.shape


def test_device_copy_releases_the_slot(synthetic_dataset):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=63, batch_size=2, slots=1)
    for _ in range(5):  # one slot: works only if every copy releases it
        d = next(loader).to("cpu")
        assert d.input_ids.shape == (2, 63) and d.targets.dtype == torch.int64
        assert d.loss_mask.dtype == torch.bool


def test_corrupt_frame_names_shard_and_frame(synthetic_dataset):
    path, _ = synthetic_dataset
    shard = path / "shard-00000.tks"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    loader = TokenLoader(path, seq_len=63, batch_size=2, shuffle=False, frames_per_block=1)
    with pytest.raises(
        CorruptShardError, match=r"shard-00000\.tks frame 0: frame checksum mismatch"
    ):
        take(loader)


def test_changed_dataset_is_refused(synthetic_dataset, tmp_path):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=63, batch_size=2)
    take(loader, 2)
    state = loader.state_dict()
    other = write_synthetic(tmp_path / "other", traceable_docs([50] * 300))
    with pytest.raises(StateError, match="changed since the state was saved"):
        TokenLoader(other, seq_len=63, batch_size=2).load_state_dict(state)
    with pytest.raises(StateError, match="settings"):
        TokenLoader(path, seq_len=31, batch_size=2).load_state_dict(state)


def test_bad_arguments_are_value_errors(synthetic_dataset):
    path, _ = synthetic_dataset
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TokenLoader(path, rank=2, world_size=2)
    with pytest.raises(ValueError, match="strictly ascending"):
        TokenLoader(path, mode="bucket", bucket_lengths=(64, 64))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        TokenLoader(path / "nope")


def reference_metadata(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Position ids and loss mask by the definition, one token at a time."""
    pos, mask = np.zeros_like(doc_ids), np.zeros(doc_ids.shape, bool)
    for r, row in enumerate(doc_ids):
        for t in range(len(row)):
            same_as_prev = t > 0 and row[t] >= 0 and row[t] == row[t - 1]
            pos[r, t] = pos[r, t - 1] + 1 if same_as_prev else 0
            mask[r, t] = t + 1 < len(row) and row[t] >= 0 and row[t] == row[t + 1]
    return pos, mask


def test_derived_position_ids_and_loss_mask_follow_the_definition():
    from pytrain.data import loss_mask, position_ids

    rng = np.random.default_rng(3)
    for _ in range(50):
        width, rows = int(rng.integers(2, 40)), int(rng.integers(1, 4))
        doc = np.full((rows, width), -1, np.int32)
        for r in range(rows):
            at, seg = 0, 0
            fill = int(rng.integers(0, width + 1))  # tokens before the padding
            while at < fill:
                n = int(rng.integers(1, fill - at + 1))
                doc[r, at : at + n] = seg
                at, seg = at + n, seg + 1
        pos, mask = reference_metadata(doc)
        t = torch.from_numpy(doc)
        assert np.array_equal(position_ids(t).numpy(), pos)
        assert np.array_equal(loss_mask(t).numpy(), mask)


def reference_segments(doc: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of one id within a row, in flattened positions."""
    rows, width = doc.shape
    out = []
    for r in range(rows):
        start = 0
        for t in range(1, width + 1):
            if t == width or doc[r, t] != doc[r, t - 1]:
                out.append((r * width + start, r * width + t))
                start = t
    return out


def test_cu_seqlens_are_the_document_runs_of_each_row():
    from pytrain.data import cu_seqlens

    rng = np.random.default_rng(5)
    for _ in range(200):
        rows, width = int(rng.integers(1, 5)), int(rng.integers(1, 30))
        # Few ids, so the same id often ends one row and starts the next (a document cut
        # across rows is two segments), and -1 padding runs appear too.
        doc = rng.integers(-1, 3, size=(rows, width)).astype(np.int32)
        doc.sort(axis=1)
        cu = cu_seqlens(doc)
        want = reference_segments(doc)
        n = len(want)
        assert cu.dtype == np.int32 and len(cu) > n and len(cu) & (len(cu) - 1) == 0
        assert [(int(a), int(b)) for a, b in zip(cu[:n], cu[1 : n + 1], strict=True)] == want
        assert (cu[n:] == rows * width).all()  # padding: empty segments at the end


def test_batch_segments_start_where_positions_restart(synthetic_dataset):
    loader = TokenLoader(synthetic_dataset[0], seq_len=64, batch_size=3, num_epochs=1)
    for i, b in enumerate(loader):
        cu = b.cu_seqlens.numpy()
        pos = b.position_ids[:, :-1].numpy().reshape(-1)
        doc = b.doc_ids[:, :-1].numpy().reshape(-1)
        starts = set(cu[cu < pos.size].tolist())
        real = doc >= 0
        # A document token starts a segment exactly where its position id is 0 or a row
        # begins (a document continued from the previous row keeps counting positions).
        row_start = np.arange(pos.size) % 64 == 0
        assert {int(j) for j in np.flatnonzero(real & ((pos == 0) | row_start))} == {
            j for j in starts if real[j]
        }
        # Only a copy asked for segments carries them (they cost host work per batch).
        if i % 2:
            assert torch.equal(b.to("cpu", segments=True).cu_seqlens, torch.from_numpy(cu))
        else:
            assert b.to("cpu").cu_seqlens is None
        if i > 20:
            break


@pytest.mark.parametrize("fixture", ["synthetic_dataset", "small_corpus"])
def test_slots_hold_tokens_at_dataset_width_and_loss_tokens_are_exact(request, fixture):
    data = request.getfixturevalue(fixture)
    path = data[0]
    loader = TokenLoader(path, seq_len=100, batch_size=3, num_epochs=1)
    width = 2 if loader.dataset.dtype == "uint16" else 4
    assert {s[0].element_size() for s in loader._slots} == {width}
    seen = 0
    for b in loader:
        assert b.tokens.element_size() == width
        assert b.loss_tokens == int(b.loss_mask[:, :-1].sum())
        host_ids = b.tokens[:, :-1].to(torch.int64)
        d = b.to("cpu")  # releases the slot
        assert d.input_ids.dtype == torch.int32 and torch.equal(d.input_ids.long(), host_ids)
        assert d.loss_tokens == int(d.loss_mask.sum())
        seen += 1
    assert seen > 3


def test_uint16_tokens_widen_without_sign_errors():
    from pytrain.data import token_ids

    t = torch.tensor([[0, 1, 32767, 32768, 40000, 65535]], dtype=torch.uint16)
    assert token_ids(t).tolist() == [[0, 1, 32767, 32768, 40000, 65535]]
    assert token_ids(t).dtype == torch.int32
