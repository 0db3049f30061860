"""What a GPU's memory held at its peak, read from the caching allocator's history
(`--profile_memory`'s memory.pickle, the dictionary torch.cuda.memory._snapshot returns).

pytorch.org/memory_viz draws the whole timeline; this answers the question a run that does
not fit asks first: at the moment the most memory was allocated, what held it? Every
allocation made in the profiled window and alive at that moment is grouped by where it was
made (the innermost Python frame, and the first frame in pytrain/ that led there, such as
the trainer's backward call); what was allocated before the window (weights, optimizer
state, anything older than the history) is one line of its own."""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePath

GiB = 2**30


def _frame(f: dict) -> str:
    return f"{PurePath(f['filename']).name}:{f['line']} {f['name']}"


def where(frames: list[dict]) -> str:
    """The place an allocation is counted under: its innermost Python frame, with the first
    frame in pytrain/ behind it where that is another one ('a < b': a, called from b)."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    if not py:
        return frames[0]["name"] if frames else "(no stack recorded)"
    ours = next((f for f in py if "/pytrain/" in f["filename"]), None)
    inner = _frame(py[0])
    return inner if ours is None or ours is py[0] else f"{inner} < {_frame(ours)}"


def _allocated_at_end(snapshot: dict, device: int) -> int:
    return sum(
        b["size"]
        for s in snapshot["segments"]
        if s.get("device", device) == device
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )


def peak_composition(snapshot: dict, device: int = 0, top: int = 12) -> dict:
    """{"peak_bytes", "before_window_bytes", "groups": [{"where", "bytes", "count"}] (the
    `top` largest), "other_bytes", "other_count", "events", "peak_event"} for `device`.

    The trace says what was allocated and freed in the window, not what was there before
    it; that follows from the segments' blocks at the end: allocated at the end, less what
    the window added in all, was allocated when the window began."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    # A block is released at free_requested (the allocator may hold it a little longer for
    # another stream: free_completed). Histories without the first count the second.
    free = (
        "free_requested"
        if any(e["action"] == "free_requested" for e in trace)
        else "free_completed"
    )

    def replay(until: int | None):
        live: dict[int, tuple[int, int]] = {}  # address: (bytes, index of its alloc event)
        cur = peak = 0
        peak_at = -1
        pre_freed = 0  # bytes allocated before the window and freed in it
        for i, e in enumerate(trace if until is None else trace[: until + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], i)
                cur += e["size"]
                if cur > peak:
                    peak, peak_at = cur, i
            elif e["action"] == free:
                if e["addr"] in live:
                    cur -= live.pop(e["addr"])[0]
                else:
                    cur -= e["size"]
                    pre_freed += e["size"]
        return live, cur, peak, peak_at, pre_freed

    _, end_delta, peak_delta, peak_at, _ = replay(None)
    at_start = _allocated_at_end(snapshot, device) - end_delta
    if peak_at < 0:  # nothing allocated in the window: its start was the most
        return {"peak_bytes": at_start, "before_window_bytes": at_start, "groups": [],
                "other_bytes": 0, "other_count": 0, "events": len(trace), "peak_event": -1}  # fmt: skip
    live, _, _, _, pre_freed = replay(peak_at)
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, i in live.values():  # placed only now: one stack per live block, not per event
        place = where(trace[i].get("frames") or [])
        sizes[place][0] += size
        sizes[place][1] += 1
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": at_start + peak_delta,
        "before_window_bytes": at_start - pre_freed,
        "groups": [{"where": w, "bytes": b, "count": n} for w, (b, n) in ranked[:top]],
        "other_bytes": sum(b for _, (b, _) in ranked[top:]),
        "other_count": sum(n for _, (_, n) in ranked[top:]),
        "events": len(trace),
        "peak_event": peak_at,
    }


def format_composition(c: dict) -> str:
    """The composition as Markdown: the peak, then what held it, largest first."""
    rows = [
        f"Peak allocated: {c['peak_bytes'] / GiB:.2f} GiB (event {c['peak_event']} of "
        f"{c['events']} in the allocator's history)",
        "",
        "| held at the peak | GiB | allocations |",
        "|---|---|---|",
        f"| allocated before the profiled window (weights, optimizer state, ...) | "
        f"{c['before_window_bytes'] / GiB:.2f} | - |",
    ]
    rows += [f"| `{g['where']}` | {g['bytes'] / GiB:.2f} | {g['count']} |" for g in c["groups"]]
    if c["other_count"]:
        rows.append(f"| elsewhere | {c['other_bytes'] / GiB:.2f} | {c['other_count']} |")
    return "\n".join(rows)
