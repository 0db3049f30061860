"""Muon's training step against AdamW's on a CPU: the embedded default (configs/cpu-default.toml,
4.26M parameters) trained a few steps with each optimizer, Muon's Newton-Schulz iteration in
fp32 (as shipped on a CPU) and in bf16 (torch.optim.Muon's, what ran before), each row a
fresh process, on this CPU as it is and with oneDNN held to AVX2
(ONEDNN_MAX_CPU_ISA=AVX2: a CPU without bf16 matrix units, AVX512-BF16 or AMX, whose bf16
matmuls are emulated).

    python benchmarks/muon_cpu.py [--steps 8]

Prints the median step time over the steps after the first two, and each row against
AdamW's on the same CPU setting."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    child_env,
    machine_line,
    markdown_table,
    median_steady,
    read_steps,
)

# A child's trainer: the embedded default, Muon's iteration set to the row's dtype.
CHILD = """
import sys, torch
from pytrain.config import parse_args
from pytrain.train.cli import use_default_dataset
from pytrain.train.trainer import Trainer
optim, ns, out, steps = sys.argv[1:5]
cfg = parse_args(["--optim.name", optim, "--max_steps", steps, "--log_every", "1",
                  "--eval_every", "0", "--ckpt_every", "0", "--samples", "0", "--no-progress",
                  "--no-tensorboard", "--out_dir", out, "--device", "cpu"])
use_default_dataset(cfg)
t = Trainer(cfg)
if ns != "-":
    t.optimizer.muon.ns_dtype = getattr(torch, ns)
t.fit()
t.close()
"""
ROWS = (("AdamW", "adamw", "-"), ("Muon, fp32 Newton-Schulz (as shipped)", "muon", "float32"),
        ("Muon, bf16 Newton-Schulz", "muon", "bfloat16"))  # fmt: skip
ISAS = (("this CPU", {}), ("oneDNN held to AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}))


def step_ms(optim: str, ns: str, env: dict, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-c", CHILD, optim, ns, out, str(steps)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env=child_env(**env))  # fmt: skip
        if r.returncode:
            raise SystemExit(f"{optim} {ns}: exit {r.returncode}: {r.stderr.strip()[-800:]}")
        ms = median_steady(read_steps(Path(out) / "default" / "train.log"), "step_ms", skip=2)
        assert ms is not None
        return ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    print(machine_line(), flush=True)
    rows = []
    for isa, env in ISAS:
        adamw = None
        for name, optim, ns in ROWS:
            ms = step_ms(optim, ns, env, args.steps)
            adamw = adamw or ms
            print(f"{isa}: {name}: {ms:.0f} ms", flush=True)
            rows.append([isa, name, f"{ms:.0f}", f"{ms / adamw:.2f}x"])
    print()
    print(markdown_table(["CPU", "optimizer", "step ms", "against AdamW"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
