"""How long a checkpoint save holds the training loop: written in the loop (before) or
handed to the background writer (ckpt_async), for the GPT-2 124M preset's state (model,
AdamW moments; on CUDA the model and optimizer live on the GPU and are snapshotted into
pinned memory). Then the round trip (save, then load into the model and optimizer) of the
single-file checkpoint against the sharded one that runs under --fsdp write
(torch.distributed.checkpoint, FSDP2 on one rank here), whose writer runs 4 threads (4 files
a rank, written in parallel), and again with DCP's default of 1.

    python benchmarks/checkpoint.py [--device cuda] [--saves 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import machine_line, markdown_table  # noqa: E402
from pytrain.model.config import ModelConfig  # noqa: E402
from pytrain.model.gpt import GPT  # noqa: E402
from pytrain.train import checkpoint, sharded_checkpoint  # noqa: E402


def _model_and_optimizer(cfg: ModelConfig, device: str, fsdp: bool):
    model = GPT(cfg).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()  # the moments exist
    return model, opt


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best_round_trip(n: int, device: str, save, load) -> tuple[float, float]:
    """The fastest of `n` saves (`save(i)` returns the checkpoint's path) and of `n` loads
    (`load(path)`), in seconds, the device drained before each clock stops."""
    saves, loads = [], []
    for i in range(n):
        _sync(device)
        t0 = time.perf_counter()
        path = save(i)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load(path)
        _sync(device)
        loads.append(time.perf_counter() - t0)
    return min(saves), min(loads)


def round_trips(
    cfg: ModelConfig, device: str, work: Path, n: int, background: list
) -> list[tuple[str, float, float]]:
    """(kind, best save s, best load s) of the single-file and the DCP checkpoint; appends
    the background DCP writer's (kind, loop held min, max, done after) to `background`."""
    import torch.distributed as dist

    out = []
    model, opt = _model_and_optimizer(cfg, device, fsdp=False)

    def load_file(path):
        state = checkpoint.read(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    def save_file(i):
        whole = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        return checkpoint.save(work / "file", i, whole, keep=1)

    best = _best_round_trip(n, device, save_file, load_file)
    out.append(("single file (no --fsdp)", *best))
    del model, opt
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if device == "cuda" else "gloo", store=store, rank=0, world_size=1
    )
    try:
        model, opt = _model_and_optimizer(cfg, device, fsdp=True)

        def save_dcp(i):
            return sharded_checkpoint.save(
                work / "dcp", i, model, opt, {"step": i}, True, dist.barrier
            )

        def load_dcp(path):
            state = checkpoint.read(path / checkpoint.SHARDED_STATE)
            sharded_checkpoint.load(path, model, opt, state["param_groups"])

        threads = sharded_checkpoint.WRITER_THREADS
        best = _best_round_trip(n, device, save_dcp, load_dcp)
        out.append((f"sharded, DCP (--fsdp, 1 rank), {threads} writer threads", *best))

        def save_dcp_one_thread(i):  # DCP's default writer, as before: one thread, one file
            return sharded_checkpoint.save(
                work / "dcp1", i, model, opt, {"step": i}, True, dist.barrier, threads=1
            )

        best = _best_round_trip(n, device, save_dcp_one_thread, load_dcp)
        out.append(("sharded, DCP, 1 writer thread (before)", *best))
        writer = sharded_checkpoint.ShardedWriter()
        held, done = [], []
        for i in range(n):
            _sync(device)
            t0 = time.perf_counter()
            writer.submit(work / "dcp-bg", i, model, opt, {"step": i}, True, dist.barrier, keep=1)
            held.append(time.perf_counter() - t0)
            writer.wait()
            done.append(time.perf_counter() - t0)
        background.append(
            ("sharded, DCP in the background (--fsdp, 1 rank)", min(held), max(held), min(done))
        )
    finally:
        dist.destroy_process_group()
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    print(machine_line(), flush=True)
    cfg = ModelConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, mlp="gelu")
    model = GPT(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()  # the moments exist
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    tensors = [*state["model"].values(), *(v for st in opt.state.values() for v in st.values())]
    gb = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)) / 1e9
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    rows = []
    try:
        for mode in ("in the loop", "background"):
            writer = checkpoint.AsyncWriter()
            held, total = [], []
            for i in range(args.saves):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if mode == "background":
                    writer.submit(work, i, state, keep=1)
                else:
                    checkpoint.save(work, i, state, keep=1)
                held.append(time.perf_counter() - t0)
                writer.wait()
                total.append(time.perf_counter() - t0)
            rows.append((mode, min(held), max(held), min(total)))
        trips = round_trips(cfg, args.device, work, args.saves, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"GPT-2 124M state: {gb:.2f} GB on {args.device}; {args.saves} saves each")
    held = [(mode, f"{lo * 1e3:.1f} ms", f"{hi * 1e3:.1f} ms", f"{done:.2f} s")
            for mode, lo, hi, done in rows]  # fmt: skip
    print(markdown_table(["save", "loop held (min)", "loop held (max)", "save done after"], held))
    print("\nround trip (best of the saves): save, then load into the model and optimizer")
    trip_rows = [(kind, f"{save:.2f}", f"{load:.2f}", f"{save + load:.2f}")
                 for kind, save, load in trips]  # fmt: skip
    print(markdown_table(["checkpoint", "save s", "load s", "round trip s"], trip_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
