"""benchmarks/time_to_quality.py's report arithmetic: when a run first reaches nanoGPT's final
loss (between snapshots), and the preset against its variants at equal steps."""

import pytest
from conftest import load_script

ttq = load_script("benchmarks/time_to_quality.py", "time_to_quality")


def run(name, points):
    return {"name": name, "points": [{"step": s, "wall_s": w, "val_loss": v} for s, w, v in points]}


def test_crossing_interpolates_between_snapshots():
    pts = run("x", [(20, 10.0, 4.0), (40, 20.0, 3.0), (60, 30.0, 2.0)])["points"]
    assert ttq.crossing(pts, 2.5) == pytest.approx(25.0)
    assert ttq.crossing(pts, 5.0) == 10.0  # reached at the first snapshot
    assert ttq.crossing(pts, 1.0) is None


def test_equal_steps_pairs_the_shipped_preset_with_its_plain_variant():
    runs = {
        "adamw": run("shipped", [(20, 1, 5.0), (100, 5, 3.0), (200, 9, 2.5), (220, 10, 2.4)]),
        "adamw-plain": run("plain", [(20, 1, 5.1), (100, 5, 3.03), (200, 9, 2.5), (220, 10, 2.2)]),
    }
    rows = [
        r for r in ttq.equal_steps(runs).splitlines() if r.startswith("| 1") or r.startswith("| 2")
    ]
    assert rows == [
        "| 100 | 3.0000 | 3.0300 | 0.9901 |",
        "| 200 | 2.5000 | 2.5000 | 1.0000 |",
        "| 220 | 2.4000 | 2.2000 | 1.0909 |",
    ]
    assert ttq.equal_steps({"adamw": runs["adamw"]}) == ""  # no variant ran
    apart = {**runs, "adamw-plain": run("plain", [(40, 2, 4.0)])}
    assert ttq.equal_steps(apart) == ""  # no step in common


def test_documents_end_at_eos_and_positions_restart_after_it():
    import torch

    doc, pos = ttq.doc_ids_and_positions(torch.tensor([[5, 3, 7, 7, 3, 1], [3, 3, 2, 2, 2, 2]]), 3)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
