"""pytrain.train.memory_peak: what held a GPU's memory at its peak, from an allocator history
built by hand in the format torch.cuda.memory._snapshot returns."""

from pytrain.train.memory_peak import (
    format_composition,
    peak_composition,
    reserved_by_stream,
    where,
)

MiB = 2**20
TORCH = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
TRAINER = "/repo/pytrain/train/trainer.py"
GPT = "/repo/pytrain/model/gpt.py"


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size):  # released, then handed back to the allocator
    return [{"action": a, "addr": addr, "size": size, "frames": []}
            for a in ("free_requested", "free_completed")]  # fmt: skip


def snapshot(trace, blocks):
    segment = {"device": 0, "blocks": [{"size": s, "state": st} for s, st in blocks]}
    return {"segments": [segment], "device_traces": [trace]}


def test_the_peak_is_told_apart_by_where_its_memory_was_allocated():
    gather = frame(TORCH, 140, "foreach_all_gather")
    backward, block = frame(TRAINER, 229, "_forward_backward"), frame(GPT, 237, "forward")
    trace = [
        alloc(1, 300 * MiB, block, frame(TRAINER, 215, "_micro_loss")),  # an activation
        alloc(2, 100 * MiB, gather, backward),  # gathered weights
        *free(90, 50 * MiB),  # allocated before the history began
        alloc(3, 100 * MiB, gather, backward),
        alloc(4, 20 * MiB),  # no stack recorded
        # the peak: 300 + 200 + 20 in the window, 1000 - 50 from before it
        *free(2, 100 * MiB),
        *free(3, 100 * MiB),
        alloc(5, 60 * MiB, gather, backward),
        *free(1, 300 * MiB),
    ]
    # At the end: 950 MiB from before the window, 20 + 60 from it; some blocks free.
    snap = snapshot(trace, [(950 * MiB, "active_allocated"), (20 * MiB, "active_allocated"),
                            (60 * MiB, "active_allocated"), (500 * MiB, "inactive")])  # fmt: skip
    c = peak_composition(snap, top=2)
    assert c["peak_bytes"] == (950 + 300 + 200 + 20) * MiB
    assert c["before_window_bytes"] == 950 * MiB
    assert c["peak_event"] == 5 and c["events"] == len(trace)
    assert c["groups"] == [
        {"where": "gpt.py:237 forward", "bytes": 300 * MiB, "count": 1},
        {"where": "_fsdp_collectives.py:140 foreach_all_gather < trainer.py:229 _forward_backward",
         "bytes": 200 * MiB, "count": 2},
    ]  # fmt: skip
    assert (c["other_bytes"], c["other_count"]) == (20 * MiB, 1)  # the one without a stack
    table = format_composition(c)
    assert "Peak allocated: 1.44 GiB" in table and "| elsewhere | 0.02 | 1 |" in table


def test_the_runner_up_is_the_highest_moment_apart_from_the_peak():
    fwd, bwd = frame(GPT, 1, "forward"), frame(TRAINER, 2, "_forward_backward")
    trace = [
        alloc(1, 800 * MiB, fwd),  # the end of a forward: 800
        alloc(2, 100 * MiB, fwd),  # 900, the runner-up
        *free(2, 100 * MiB),
        *free(1, 800 * MiB),  # down to 0
        alloc(3, 950 * MiB, bwd),  # 950
        alloc(6, 30 * MiB, bwd),  # 980: higher, but only 30 MiB above what follows
        *free(6, 30 * MiB),
        alloc(4, 20 * MiB, bwd),  # 970
        alloc(5, 100 * MiB, bwd),  # 1070, the peak
    ]
    snap = snapshot(trace, [(1070 * MiB, "active_allocated")])
    c = peak_composition(snap, dip=500 * MiB)
    assert c["peak_bytes"] == 1070 * MiB and c["peak_event"] == len(trace) - 1
    second = c["runner_up"]
    assert second["peak_bytes"] == 900 * MiB and second["peak_event"] == 1
    assert second["groups"] == [{"where": "gpt.py:1 forward", "bytes": 900 * MiB, "count": 2}]
    assert "Runner-up, apart from the peak: 0.88 GiB" in format_composition(c)
    # Memory that falls less than the dip between two humps makes them one.
    assert peak_composition(snap, dip=1000 * MiB)["runner_up"] is None


def test_the_runner_up_is_not_the_peak_again_in_another_step():
    fwd, bwd = frame(GPT, 1, "forward"), frame(TRAINER, 2, "_forward_backward")
    step = [
        alloc(1, 800 * MiB, fwd), alloc(2, 100 * MiB, fwd),  # the forward's end: 900
        *free(2, 100 * MiB), *free(1, 800 * MiB),
        alloc(3, 950 * MiB, bwd), alloc(4, 120 * MiB, bwd),  # the backward's peak: 1070
        *free(4, 120 * MiB), alloc(5, 90 * MiB, bwd),  # 1040, much as at the peak
        *free(5, 90 * MiB), *free(3, 950 * MiB),
    ]  # fmt: skip
    snap = snapshot(step + step, [(64 * MiB, "inactive")])  # two steps, nothing left
    c = peak_composition(snap, dip=500 * MiB)
    assert c["peak_bytes"] == 1070 * MiB and c["peak_event"] == 7  # the first step's
    # The second step's 1070 and 1040 are held by what held the peak: passed over.
    assert c["runner_up"]["peak_bytes"] == 900 * MiB
    assert c["runner_up"]["groups"] == [
        {"where": "gpt.py:1 forward", "bytes": 900 * MiB, "count": 2}
    ]


def test_a_window_that_only_frees_peaks_at_its_start():
    snap = snapshot(free(7, 64 * MiB), [(200 * MiB, "active_allocated")])
    c = peak_composition(snap)
    assert c["peak_bytes"] == c["before_window_bytes"] == 264 * MiB and c["groups"] == []


def test_where_names_the_innermost_python_frame_and_ours_behind_it():
    cpp = {"filename": "??", "line": 0, "name": "at::native::empty_cuda"}
    assert where([cpp, frame(GPT, 10, "f")]) == "gpt.py:10 f"  # ours is the innermost
    assert where([cpp]) == "at::native::empty_cuda"
    assert where([]) == "(no stack recorded)"


def test_what_is_reserved_is_told_apart_by_the_stream_its_segments_serve():
    """Reserved memory not allocated, the gap between max_memory_reserved and the allocated
    peak, sits in the segments of the stream that freed it: the table says which."""
    nccl = 0x5A00

    def seg(stream, blocks, device=0):
        return {"device": device, "stream": stream, "total_size": sum(s for s, _ in blocks),
                "blocks": [{"size": s, "state": st} for s, st in blocks]}  # fmt: skip

    snap = {
        "segments": [
            seg(0, [(700 * MiB, "active_allocated"), (100 * MiB, "inactive")]),
            seg(nccl, [(200 * MiB, "inactive"), (56 * MiB, "active_allocated")]),
            seg(nccl, [(768 * MiB, "inactive")]),
            seg(0, [(512 * MiB, "active_allocated")]),
            seg(0, [(999 * MiB, "active_allocated")], device=1),  # another GPU's
        ],
        "device_traces": [[alloc(1, 64 * MiB, frame(GPT, 1, "forward"))], []],
    }
    rows = reserved_by_stream(snap, 0)
    assert rows == [
        {"stream": 0, "reserved": 1312 * MiB, "allocated": 1212 * MiB, "segments": 2},
        {"stream": nccl, "reserved": 1024 * MiB, "allocated": 56 * MiB, "segments": 2},
    ]
    assert reserved_by_stream(snap, 1)[0]["reserved"] == 999 * MiB
    table = format_composition(peak_composition(snap), rows)
    assert "Reserved at the window's end: 2.28 GiB" in table
    assert (
        "| 0x5a00 | 1.00 | 0.05 | 0.95 | 2 |" in table
        and "| 0x0 | 1.28 | 1.18 | 0.10 | 2 |" in table
    )
    assert "Reserved at" not in format_composition(peak_composition(snap))  # none given
