"""What a GPU's memory held at its peak, read from the caching allocator's history
(`--profile_memory`'s memory.pickle, the dictionary torch.cuda.memory._snapshot returns).

pytorch.org/memory_viz draws the whole timeline; this answers the question a run that does
not fit asks first: at the moment the most memory was allocated, what held it? Every
allocation made in the profiled window and alive at that moment is grouped by where it was
made (the innermost Python frame, and the first frame in pytrain/ that led there, such as
the trainer's backward call); what was allocated before the window (weights, optimizer
state, anything older than the history) is one line of its own. The same for the runner-up,
the highest moment that memory falls well below before it reaches the peak and at which
other things hold it (the end of a forward, when the peak lies in the backward; not the
peak's moment in the next step): a change that lowers the peak lowers it to no less than
that. Last, what the allocator had reserved, by stream: where max_memory_reserved exceeds
the allocated peak, which stream's segments hold the difference."""

from __future__ import annotations

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


def _timeline(trace: list[dict], free: str) -> list[int]:
    """Bytes allocated in the window after each event (negative where the window freed
    more than it allocated: what was there before it)."""
    live: dict[int, int] = {}
    cur, out = 0, []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
        elif e["action"] == free:
            cur -= live.pop(e["addr"], e["size"])
        out.append(cur)
    return out


def _hump_tops(cur: list[int], dip: int) -> list[int]:
    """The highest event of each hump of the timeline, humps being cut where memory falls
    `dip` below a hump's top and then climbs `dip` again."""
    tops: list[int] = []
    top, valley = 0, None  # the hump's highest event so far; the low since it fell `dip`
    for i, c in enumerate(cur):
        if valley is None:
            if c > cur[top]:
                top = i
            elif c <= cur[top] - dip:
                valley = c
        elif c < valley:
            valley = c
        elif c >= valley + dip:
            tops.append(top)
            top, valley = i, None
    return [*tops, top] if cur else []


def peak_composition(snapshot: dict, device: int = 0, top: int = 12, dip: int = GiB // 2) -> dict:
    """{"peak_bytes", "before_window_bytes", "groups": [{"where", "bytes", "count"}] (the
    `top` largest), "other_bytes", "other_count", "events", "peak_event", "runner_up"} for
    `device`. "runner_up" is the same for the highest moment apart from the peak (memory
    falls by `dip` between the two) and held by other things (`dip` bytes of it, so not
    the peak's moment in another step), None where there is none: what a change that
    lowers the peak meets next.

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
    cur = _timeline(trace, free)
    at_start = _allocated_at_end(snapshot, device) - (cur[-1] if cur else 0)
    peak_at = max(range(len(cur)), key=cur.__getitem__, default=-1)
    if peak_at < 0 or cur[peak_at] <= 0:  # nothing allocated in the window: its start was the most
        return {"peak_bytes": at_start, "before_window_bytes": at_start, "groups": [],
                "other_bytes": 0, "other_count": 0, "events": len(trace), "peak_event": -1,
                "runner_up": None}  # fmt: skip
    stacks: dict[int, str] = {}  # alloc event: where, each stack read once
    peak = _live(trace, free, peak_at, stacks)
    second = None
    # The highest other hump whose memory is held by other things (at least `dip` bytes of
    # it): not the peak's moment in another step.
    for i in sorted((t for t in _hump_tops(cur, dip) if t != peak_at), key=lambda t: -cur[t]):
        rival = _live(trace, free, i, stacks)
        places = peak[2].keys() | rival[2].keys()
        if sum(abs(peak[2].get(w, (0,))[0] - rival[2].get(w, (0,))[0]) for w in places) >= dip:
            second = (i, rival)
            break
    return {
        **_held(peak_at, peak, at_start, top),
        "events": len(trace),
        "runner_up": None if second is None else _held(*second, at_start, top),
    }


def _live(
    trace: list[dict], free: str, at: int, stacks: dict[int, str]
) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """After event `at`: bytes the window added, bytes allocated before it and freed in it,
    and what the window's live allocations hold by where they were made, {where: (bytes,
    count)}."""
    live: dict[int, tuple[int, int]] = {}  # address: (bytes, index of its alloc event)
    cur = pre_freed = 0
    for i, e in enumerate(trace[: at + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            cur += e["size"]
        elif e["action"] == free:
            if e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
            else:
                cur -= e["size"]
                pre_freed += e["size"]
    sizes: dict[str, tuple[int, int]] = {}
    for size, i in live.values():  # placed only now: one stack per live block, not per event
        if i not in stacks:
            stacks[i] = where(trace[i].get("frames") or [])
        place = stacks[i]
        b, n = sizes.get(place, (0, 0))
        sizes[place] = (b + size, n + 1)
    return cur, pre_freed, sizes


def _held(at: int, live: tuple[int, int, dict], at_start: int, top: int) -> dict:
    cur, pre_freed, sizes = live
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": at_start + cur,
        "before_window_bytes": at_start - pre_freed,
        "groups": [{"where": w, "bytes": b, "count": n} for w, (b, n) in ranked[:top]],
        "other_bytes": sum(b for _, (b, _) in ranked[top:]),
        "other_count": sum(n for _, (_, n) in ranked[top:]),
        "peak_event": at,
    }


def reserved_by_stream(snapshot: dict, device: int = 0) -> list[dict]:
    """The allocator's segments when the snapshot was taken, by the stream each serves:
    [{"stream", "reserved", "allocated", "segments"}], most reserved first. A block freed
    in one stream's segment waits there for that stream's next allocation, so what is
    reserved and not allocated (the gap between max_memory_reserved and the allocated peak)
    is told apart by stream: the compute stream's, the collectives'. Reserved memory is
    not returned while a run lasts (short of an out-of-memory retry or empty_cache), so at
    the profiled window's end it is the run's most reserved so far."""
    streams: dict[int, list[int]] = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        row = streams.setdefault(seg["stream"], [0, 0, 0])
        row[0] += seg["total_size"]
        row[1] += sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        row[2] += 1
    rows = [{"stream": k, "reserved": r, "allocated": a, "segments": n}
            for k, (r, a, n) in streams.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["reserved"])


def format_composition(c: dict, streams: list[dict] | None = None) -> str:
    """The composition as Markdown: the peak, then what held it, largest first; then the
    same for the runner-up, where there is one; then, given `streams` (reserved_by_stream),
    what was reserved by stream."""
    out = _format_held(c, "Peak allocated", c["events"])
    if c.get("runner_up"):
        out += "\n\n" + _format_held(c["runner_up"], "Runner-up, apart from the peak", c["events"])
    if streams:
        total = sum(r["reserved"] for r in streams)
        rows = [
            f"Reserved at the window's end: {total / GiB:.2f} GiB, by stream (0x0: the default "
            "stream; the others by their handles)",
            "",
            "| stream | GiB reserved | allocated | reserved, not allocated | segments |",
            "|---|---|---|---|---|",
        ]
        rows += [
            f"| {r['stream']:#x} | {r['reserved'] / GiB:.2f} | {r['allocated'] / GiB:.2f} | "
            f"{(r['reserved'] - r['allocated']) / GiB:.2f} | {r['segments']} |"
            for r in streams
        ]
        out += "\n\n" + "\n".join(rows)
    return out


def _format_held(c: dict, title: str, events: int) -> str:
    rows = [
        f"{title}: {c['peak_bytes'] / GiB:.2f} GiB (event {c['peak_event']} of "
        f"{events} in the allocator's history)",
        "",
        "| held at that moment | GiB | allocations |",
        "|---|---|---|",
        f"| allocated before the profiled window (weights, optimizer state, ...) | "
        f"{c['before_window_bytes'] / GiB:.2f} | - |",
    ]
    rows += [f"| `{g['where']}` | {g['bytes'] / GiB:.2f} | {g['count']} |" for g in c["groups"]]
    if c["other_count"]:
        rows.append(f"| elsewhere | {c['other_bytes'] / GiB:.2f} | {c['other_count']} |")
    return "\n".join(rows)
