"""How long a checkpoint save holds the training loop: written in the loop (before) or
handed to the background writer (ckpt_async), for the GPT-2 124M preset's state (model,
AdamW moments; on CUDA the model and optimizer live on the GPU and are snapshotted into
pinned memory). Then the round trip (save, then load into the model and optimizer) of the
single-file checkpoint against the sharded one that runs under --fsdp write
(torch.distributed.checkpoint, FSDP2 on one rank here), whose writer runs 4 threads (4 files
a rank, written in parallel), and again with DCP's default of 1.

    python benchmarks/checkpoint.py [--device cuda] [--saves 3]

With --fsdp, under torchrun: a preset's model sharded over the ranks as the trainer shards
it (FSDP2, bf16 compute; built on the meta device, each rank materialising its shards) with
the trainer's AdamW, saved by the trainer's background writer (ShardedWriter) `--saves`
times, an optimizer step between saves. Each save's loop hold by phase (the slowest rank's),
when its copies into host memory and its write are done, one checkpoint's bytes on disk,
the host memory the saves copy into (made ahead of the first, as in training), and the
resume path's load into a fresh model and optimizer, whose tensors are checked
against the saved ones (exit 1 where they differ); with --cold the checkpoint is first
dropped from the page cache, so the load reads the disk. Llama-3.1-8B on 4 GPUs, and on the CPU:

    torchrun --nproc_per_node 4 benchmarks/checkpoint.py --fsdp --preset configs/llama-8b.toml --saves 1 --cold --dir /tmp/ckpt-bench
    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --fsdp --device cpu --preset configs/cpu-default.toml
"""

from __future__ import annotations

import argparse
import gc
import os
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


LLAMA3_VOCAB = 128256
"""The vocabulary where a preset takes it from its dataset (vocab_size 0): the 8B preset's
data is tokenized with Llama 3's."""


def _preset(path: Path):
    """The preset's TrainConfig, read as the trainer reads --config."""
    from pytrain.config import TrainConfig, apply_toml

    cfg = TrainConfig()
    apply_toml(cfg, path)
    cfg.model.vocab_size = cfg.model.vocab_size or LLAMA3_VOCAB
    return cfg


def _sharded(cfg, device: torch.device, seed: int, moments: bool):
    """(GPT, AdamW) as the trainer builds them under FSDP2 (parallel.wrap over every rank,
    bf16 compute; build_optimizer), but made on the meta device and materialised shard by
    shard: no rank holds the whole model (the 8B: 32 GB in fp32). The weights are random
    (`seed` and the rank: every shard differs); `moments`: AdamW's state made by one step
    on zero gradients, as a trained run has it (a fresh optimizer, as at resume, has none)."""
    import torch.distributed as dist

    from pytrain.model.gpt import LossModule
    from pytrain.optim.build import build_optimizer
    from pytrain.train import parallel

    with torch.device("meta"):
        gpt = GPT(cfg.model)
    plan = parallel.Plan("fsdp2", "", shard=dist.get_world_size())
    parallel.wrap(LossModule(gpt), plan, device, torch.bfloat16).to_empty(device=device)
    # The RoPE tables (buffers, never saved) stay uninitialised: nothing runs the model.
    gen = torch.Generator(device).manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for p in gpt.parameters():  # this rank's shard, in place
            if p.dim() > 1:
                p.to_local().normal_(0, 0.02, generator=gen)
            else:
                p.to_local().uniform_(generator=gen)
    opt, _ = build_optimizer(
        gpt, cfg.optim, device, torch.bfloat16, sharded=True, fp16_scaler=False
    )
    if moments:
        _step(gpt, opt, None)
    return gpt, opt


def _step(gpt, opt, gen: torch.Generator | None) -> None:
    """One AdamW step on zero gradients (`gen` None) or random ones: between saves, so that
    each save holds other values and the moments the load check compares are not zero."""
    for p in gpt.parameters():
        p.grad = torch.zeros_like(p)
        if gen is not None:
            p.grad.to_local().normal_(generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local(t) -> torch.Tensor:
    """This rank's part of a state tensor (a DTensor's shard, or a plain tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(gpt, opt) -> int:
    """Bytes of this rank's shards of the weights and the AdamW state."""
    tensors = [*gpt.parameters(), *(v for st in opt.state.values() for v in st.values())]
    return sum(_local(t).nbytes for t in tensors)


def _probe(gpt, opt) -> dict[str, torch.Tensor]:
    """Host copies of a few of this rank's shards, by name: the first, middle and last
    parameter's and its AdamW state's (step, moments)."""
    named = list(gpt.named_parameters())
    out = {}
    for name, p in (named[0], named[len(named) // 2], named[-1]):
        for key, v in [("", p), *opt.state[p].items()]:
            out[f"{name}.{key}"] = _local(v).detach().to("cpu", copy=True)
    return out


def evict(directory: Path) -> int:
    """Drops the files under `directory` from the page cache (each written to disk
    first), so that the next read of them comes from the disk: a cold load, as on a
    restarted host. posix_fadvise(DONTNEED) asks the kernel to drop a file's clean pages;
    it needs no privilege. Returns the bytes of the files."""
    total = 0
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _rank_figures(args, cfg, info, device: torch.device, work: Path) -> dict:
    """This rank's figures: each save's (loop held, phases, copies done after, write done
    after), the host memory made ahead (bytes, pinned, seconds), the first
    checkpoint's bytes and files (rank 0), the load's seconds, its state's bytes, its peak
    RSS, and whether the loaded tensors equal the saved."""
    import resource

    import torch.distributed as dist

    gpt, opt = _sharded(cfg, device, seed=0, moments=True)
    out: dict = {"state": _state_bytes(gpt, opt), "saves": [], "disk": (0, 0)}
    # As in training: the host memory is made in the background once the optimizer has
    # its state (before an update), long before the first save; timed here on its own.
    writer = sharded_checkpoint.ShardedWriter(gpt, opt)
    t0 = time.perf_counter()
    writer.before_update()
    host = writer.host_memory()
    assert host is not None, "no host memory made ahead"
    out["host"] = (host.buffer.numel(), host.pinned, time.perf_counter() - t0)
    gen = torch.Generator(device).manual_seed(1 + dist.get_rank())
    probe: dict = {}
    for i in range(1, args.saves + 1):
        if i > 1:
            writer.before_update()  # as the trainer's OptimizerStep does
            _step(gpt, opt, gen)
        if i == args.saves:
            probe = _probe(gpt, opt)  # what the last save holds
        _sync(device.type)
        dist.barrier()  # in lockstep, as training's collectives keep the ranks
        t0 = time.perf_counter()
        path = writer.submit(work, i, gpt, opt, {"step": i}, info.is_main, dist.barrier, keep=1)
        held = time.perf_counter() - t0
        writer.copies_done()
        copied = time.perf_counter() - t0
        writer.wait()
        out["saves"].append((held, dict(writer.phases), copied, time.perf_counter() - t0))
        if i == 1:  # before the next save's write prunes it (keep=1)
            sizes = [f.stat().st_size for f in path.iterdir()] if info.is_main else []
            out["disk"] = (sum(sizes), len(sizes))
    del gpt, opt, writer  # the staging buffers too: the resume below starts afresh
    gc.collect()  # FSDP2's hooks hold its modules in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gpt, opt = _sharded(cfg, device, seed=1000, moments=False)
    out["evicted"] = evict(work) if args.cold and info.is_main else 0
    dist.barrier()
    t0 = time.perf_counter()
    found = checkpoint.load_latest(work)  # as run_state.resume reads it
    assert found is not None, f"no checkpoint in {work}"
    sharded_checkpoint.load(found[0]["sharded"], gpt, opt, found[0]["param_groups"])
    _sync(device.type)
    out["load"] = time.perf_counter() - t0
    got = _probe(gpt, opt)
    out["same"] = got.keys() == probe.keys() and all(torch.equal(got[k], probe[k]) for k in probe)
    out["compared"] = len(probe)
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


def _tables(ranks: list[dict]) -> tuple[str, str]:
    """The saves table and the totals table of every rank's figures: the slowest rank's
    seconds, the sums of bytes."""
    saves = []
    for i in range(len(ranks[0]["saves"])):
        held, copied, done = (max(r["saves"][i][j] for r in ranks) for j in (0, 2, 3))
        phases = {k: max(r["saves"][i][1][k] for r in ranks) for k in ranks[0]["saves"][i][1]}
        saves.append([f"save {i + 1}", f"{held:.3f}", *(f"{v:.3f}" for v in phases.values()),
                      f"{copied:.2f}", f"{done:.2f}"])  # fmt: skip
    heads = ["save", "loop held", *ranks[0]["saves"][0][1], "copies done after",
             "write done after"]  # fmt: skip
    pinned = all(r["host"][1] for r in ranks)
    host = (f"{sum(r['host'][0] for r in ranks) / 1e9:.2f} GB on all ranks, "
            f"{'pinned' if pinned else 'not pinned'}, made in "
            f"{max(r['host'][2] for r in ranks):.2f} s (the slowest rank; ahead of the saves)")  # fmt: skip
    gb = 1e9
    disk_bytes, files = ranks[0]["disk"]
    same = all(r["same"] for r in ranks)
    totals = [
        ("state (weights, AdamW state)", f"{sum(r['state'] for r in ranks) / gb:.2f} GB, "
         f"{max(r['state'] for r in ranks) / gb:.2f} GB a rank"),
        ("one checkpoint on disk", f"{disk_bytes / gb:.2f} GB in {files} files"),
        ("load (resume: state.pt, then each rank's shards)", f"{max(r['load'] for r in ranks):.2f} s, "
         + (f"cold (its {sum(r['evicted'] for r in ranks) / gb:.2f} GB dropped from the page cache first)"
            if any(r["evicted"] for r in ranks) else "warm (from the page cache, as just written)")),
        ("host memory the saves copy into", host),
        ("peak host memory (RSS) a rank", f"{max(r['rss'] for r in ranks) / gb:.2f} GB"),
        ("loaded state equals the saved", f"{'yes' if same else 'NO'} "
         f"({min(r['compared'] for r in ranks)} tensors a rank compared)"),
    ]  # fmt: skip
    return markdown_table(heads, saves), markdown_table(["measure", "value"], totals)


def ranks_main(args) -> int:
    """The --fsdp mode: every rank runs this under torchrun; rank 0 prints."""
    from pytrain.config import ConfigError
    from pytrain.train import distributed

    if not args.preset.is_file():
        print(f"--preset {args.preset}: no such file", file=sys.stderr)
        return 2
    try:
        cfg = _preset(args.preset)
        info, device = distributed.init(args.device)
    except ConfigError as e:  # a preset that does not read, more ranks than GPUs
        print(e, file=sys.stderr)
        return 2
    work = args.dir / "checkpoint-bench"
    if info.is_main:
        print(machine_line(), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    distributed.barrier(info)
    ranks = distributed.gather_objects(_rank_figures(args, cfg, info, device, work), info)
    distributed.shutdown(info)
    if info.is_main:
        shutil.rmtree(work, ignore_errors=True)
        m = cfg.model
        print(f"{args.preset}: {m.n_layer} layers, d_model {m.d_model}, vocabulary {m.vocab_size}; "
              f"FSDP2 over {info.world_size} rank(s) on {device.type}; {args.saves} background "
              "saves (ShardedWriter), an AdamW step before each after the first")  # fmt: skip
        saves, totals = _tables(ranks)
        print("\nloop held, seconds, by phase (ShardedWriter.phases; each the slowest rank's)")
        print(saves + "\n\n" + totals)
    distributed.exit_process(0 if all(r["same"] for r in ranks) else 1)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: the preset's model sharded over the ranks (above)")  # fmt: skip
    p.add_argument(
        "--preset",
        type=Path,
        default=Path("configs/gpt2-124m.toml"),
        help="with --fsdp: the model's shape and optimizer (a configs/*.toml)",
    )
    p.add_argument("--cold", action="store_true",
                   help="with --fsdp: the checkpoint dropped from the page cache before its load")  # fmt: skip
    args = p.parse_args()
    if args.fsdp:
        return ranks_main(args)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        print(
            "under torchrun, pass --fsdp (each rank would run its own benchmark)", file=sys.stderr
        )
        return 2
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
