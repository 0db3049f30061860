"""A consumer cannot leak a loader slot: every slot taken is given back on every path
(early stops, exceptions), also when the device copy is asynchronous, as on CUDA, where
the slot may be reused only after the copy has landed. The copy in flight is simulated
on the CPU by replacing `pytrain.data.batch._copy` with one that reports a pending event."""

from __future__ import annotations

import time

import pytest

from pytrain.data import DeviceFeed, TokenLoader
from pytrain.data import batch as data


class SlowCopy:
    """An event that lands only after `polls` queries (or when waited for)."""

    def __init__(self, polls: int, sleep_s: float = 0.0):
        self.polls = polls
        self.sleep_s = sleep_s  # how long a wait for it takes
        self.waited = False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.waited = True
        self.polls = -1
        time.sleep(self.sleep_s)


@pytest.fixture
def copies_in_flight(monkeypatch):
    """Every `HostBatch.to()` behaves like CUDA's: the copy lands a few polls later."""
    made: list[SlowCopy] = []
    real = data._copy

    def slow(hb, device, segments):
        out, _ = real(hb, device, segments)
        made.append(SlowCopy(polls=3))
        return out, made[-1]

    monkeypatch.setattr(data, "_copy", slow)
    return made


def test_copies_in_flight_never_exhaust_the_slots(synthetic_dataset, copies_in_flight):
    """The README's loop (`batch.to(device)` and nothing else) over more batches than
    slots: the loader reclaims slots whose copies landed, waits for the oldest when it
    must, and `close()` leaves no slot held."""
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=32, batch_size=2, slots=2, threads=1, num_epochs=1)
    n = 0
    for hb in loader:
        hb.to("cpu")
        n += 1
        assert loader.held_slots <= 2
    assert n > 4 * 2
    assert any(c.waited for c in copies_in_flight)  # some copy had to be awaited
    loader.close()
    assert loader.held_slots == 0


def test_feed_releases_every_slot_when_stopped_early_or_by_an_exception(
    synthetic_dataset, copies_in_flight
):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=32, batch_size=2, slots=2, threads=1)
    with DeviceFeed(loader, "cpu") as feed:
        feed.prefetch(1)
        for i, _ in enumerate(feed):
            if i == 3:
                break
        assert loader.held_slots >= 1  # the last copy has not landed yet
    assert loader.held_slots == 0
    loader = TokenLoader(path, seq_len=32, batch_size=2, slots=2, threads=1)
    with pytest.raises(RuntimeError, match="boom"):
        with DeviceFeed(loader, "cpu") as feed:
            next(feed)
            raise RuntimeError("boom")
    assert loader.held_slots == 0


def test_host_batches_not_released_are_an_error_naming_the_fix(synthetic_dataset):
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=32, batch_size=2, slots=2, threads=1)
    kept = [next(loader), next(loader)]
    with pytest.raises(ValueError, match="release a batch"):
        next(loader)
    kept[0].release()
    kept[0].release()  # twice is harmless
    next(loader).release()
    loader.close()


def test_feed_state_excludes_batches_fetched_ahead(synthetic_dataset):
    """A checkpoint taken while the next step's batches are prefetched records the state
    after the batches consumed: resuming from it yields the prefetched batches again."""
    path, _ = synthetic_dataset
    kw = dict(seq_len=32, batch_size=2, slots=4, threads=2)
    feed = DeviceFeed(TokenLoader(path, **kw), "cpu")
    feed.take(3)
    feed.prefetch(2)
    state = feed.state_dict()
    ahead, _ = feed.take(2)
    feed.close()
    resumed = DeviceFeed(TokenLoader(path, **kw), "cpu")
    resumed.load_state_dict(state)
    again, _ = resumed.take(2)
    resumed.close()
    for a, b in zip(ahead, again, strict=True):
        assert a.input_ids.equal(b.input_ids) and a.doc_ids.equal(b.doc_ids)


def test_evaluation_releases_its_slots_with_copies_in_flight(
    small_corpus, tmp_path, copies_in_flight
):
    """The GPU crash at the first evaluation ("all 2 slots are held by the consumer"),
    reproduced on the CPU: evaluation stops after eval_batches while copies are in flight,
    several times in a row, and training goes on."""
    from test_trainer import small_cfg

    from pytrain.train.trainer import Trainer

    cfg = small_cfg(
        small_corpus, tmp_path, "--eval_every", "2", "--eval_batches", "3", "--max_steps", "6"
    )
    trainer = Trainer(cfg, log=lambda *a: None)
    out = trainer.fit()
    assert out["val_loss"] is not None and out["step"] == 6
    assert trainer.loader.held_slots <= cfg.data.slots
    # The same evaluation twice gives the same loss (the same batches, all released).
    assert trainer.evaluate() == trainer.evaluate()
    trainer.close()
    assert trainer.loader.held_slots == 0


def test_feed_time_splits_waiting_from_host_work_and_sums_to_the_loaders_wait(
    synthetic_dataset, monkeypatch
):
    """The per-step data wait the trainer logs is the loader's blocked time (its ring, or
    a copy that had not landed), step by step; the run's sum is the loader's own wait_s,
    which the end line prints. Host work around it (taking batches, queueing copies) is
    the separate `host_s`. Copies here land only when awaited, 20 ms later."""
    real = data._copy
    waits: list[SlowCopy] = []

    def slow(hb, device, segments):
        out, _ = real(hb, device, segments)
        waits.append(SlowCopy(polls=10**9, sleep_s=0.02))
        return out, waits[-1]

    monkeypatch.setattr(data, "_copy", slow)
    path, _ = synthetic_dataset
    loader = TokenLoader(path, seq_len=32, batch_size=2, slots=4, threads=1)
    spent = []
    with DeviceFeed(loader, "cpu") as feed:
        for _ in range(6):
            batches, fed = feed.take(2)
            feed.prefetch(2)
            spent.append(fed)
        stats = loader.stats()
        awaited = sum(c.waited for c in waits)
    assert awaited >= 6  # 4 slots, 2 fetched ahead: most copies are awaited
    assert stats["copy_wait_s"] >= 0.02 * awaited * 0.9
    assert stats["wait_s"] == pytest.approx(stats["ring_wait_s"] + stats["copy_wait_s"])
    # Every step's wait is inside its host time, and the steps' waits add up to the loader's
    # (the last prefetch is not a step's: its batches were never taken).
    assert all(0 < f.wait_s <= f.host_s for f in spent)
    last_prefetch = feed._ahead_time
    total = sum(f.wait_s for f in spent) + last_prefetch.wait_s
    assert total == pytest.approx(stats["wait_s"], rel=1e-6, abs=1e-6)
