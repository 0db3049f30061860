"""TrainConfig, the run's settings, with its sections: [optim] (OptimConfig), [compile]
(CompileConfig), [ft] (FtConfig), [eval] (EvalConfig), [data] (pytrain.config.data) and
[model] (pytrain.model.config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pytrain.config.data import DataConfig
from pytrain.model.config import ModelConfig


@dataclass
class OptimConfig:
    name: str = "adamw"
    """'adamw', or 'muon': Muon for the 2-D weights of the transformer blocks, AdamW for
    the embedding, output layer, norms and biases (pytrain/optim/muon.py)."""
    lr: float = 2e-3
    """Peak learning rate (AdamW's; with optim.name=muon, that of the AdamW groups)."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    """After warm-up: 'cosine', 'linear' or 'constant'; or 'wsd' (warm-up-stable-decay:
    constant, then linear to lr x min_lr_ratio over the last decay_frac of max_steps)."""
    decay_frac: float = 0.2
    """optim.schedule=wsd: the share of max_steps that decays (0 < decay_frac <= 1)."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank; 0: derived from tokens_per_step at the
    run's world size (one preset then makes the same optimizer step on 1 GPU or 64)."""
    tokens_per_step: int = 0
    """With grad_accum = 0: tokens per optimizer step over all ranks. Each rank runs
    tokens_per_step / (data.batch_size x data.seq_len x ranks) micro-batches, rounded to
    the nearest whole number (at least 1; the start line says the step it gives)."""
    master_weights: str = "auto"
    """Keep the parameters in bf16 and their fp32 copies in the optimizer
    (pytrain.optim.master_adamw): 'auto' (on for bf16 on CUDA in one process), 'on', 'off'
    (fp32 parameters under autocast)."""
    state_dtype: str = "fp32"
    """AdamW's two moments: 'fp32', or 'bf16' (4 bytes a parameter less: 12.8 GB at 3.2B,
    7.5 GiB a GPU for the 8B over 4; the update still computes in fp32 and rounds once;
    DeepSeek-V3 keeps them so). With master weights MasterAdamW keeps them, otherwise
    (FSDP2, fp32 parameters) pytrain.optim.compact_adamw; not Muon."""
    muon_lr: float = 0.02
    """optim.name=muon: peak learning rate of the Muon group (same schedule as optim.lr)."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    """optim.name=muon: decoupled weight decay of the Muon group (per step: lr x this)."""
    spike_factor: float = 4.0
    """Skip a step whose loss exceeds this multiple of the running mean (0 disables)."""
    max_bad_steps: int = 10
    """Stop after this many skipped steps in a row."""


@dataclass
class CompileConfig:
    enabled: bool | None = None
    """None: on for CUDA, off for CPU."""
    mode: str = "auto"
    """'auto', 'eager', 'default', 'reduce-overhead', 'max-autotune-no-cudagraphs'."""
    safe_env: bool = True
    """Set Inductor/Triton environment guards before torch is imported (see docs/COMPILE.md)."""
    cache_dir: str = ""
    """Persistent Inductor cache (TORCHINDUCTOR_CACHE_DIR); empty: under runs/<name>/."""
    guard: bool = True
    """Avoid known-bad combinations up front and fall back at run time. Off shows torch's
    native behaviour (scripts/compile_matrix.py compares the two)."""
    coordinate_descent: bool = False
    """Inductor's coordinate-descent tuning of the kernels it generates (block sizes):
    a longer first compile for sometimes faster steps. Set in code, so it overrides the
    safe_env guard that turns it off; off by default."""
    inductor: str = ""
    """Inductor config overrides set in code before compiling, 'name=value' comma-separated
    with Python literals (e.g. 'triton.enable_pdl=True'); a name this torch does not have
    is skipped with a note in the compile line."""
    inject_failure_at: int = -1
    """Testing knob: raise a compile-like failure at this step (>= 0) to exercise the fallback."""


@dataclass
class FtConfig:
    """Replica groups on torchft (pytrain.train.replica_groups, docs/DISTRIBUTED.md): each
    group is its own torchrun job, the groups meet at torchft's Lighthouse, and a group that
    fails leaves the others training."""

    lighthouse: str = ""
    """The torchft Lighthouse this replica group joins, http://HOST:PORT (`torchft_lighthouse
    --min_replicas N`, the ft extra); empty: off. Each step's global batch is then split over
    the groups of that step's quorum, and a step commits only when torchft says so."""
    group: int = 0
    """This replica group's number, 0 to ft.groups - 1 (its run directory: runs/NAME/groupN)."""
    groups: int = 1
    """The replica groups the job is planned with. The global batch is theirs at full strength
    (data.batch_size x optim.grad_accum x a group's ranks x ft.groups rows) and stays that
    size while some are missing: the groups of a step's quorum take more micro-batches."""
    min_replicas: int = 1
    """A step commits only with at least this many groups in its quorum (torchft's
    min_replica_size; start the Lighthouse with the same --min_replicas)."""
    timeout_s: float = 60.0
    """How long an all-reduce between groups, a commit vote or a heal's transfer waits."""
    quorum_timeout_s: float = 120.0
    """How long a step waits for a quorum at the Lighthouse (too few groups, or the Lighthouse
    down and not yet back): then this group writes a checkpoint and stops with one line."""


@dataclass
class EvalConfig:
    """Downstream tasks scored as the model trains (pytrain.train.downstream; the task
    format: docs/DOWNSTREAM.md). The validation loss's own settings are eval_every and
    eval_batches."""

    tasks: list[str] = field(default_factory=list)
    """Task files (.jsonl, .parquet) or folders of them: acc, acc_norm and acc_bytes of each
    and their CORE-style mean, in train.log, TensorBoard, W&B, MLflow and the report. Empty:
    none."""
    tasks_every: int = 0
    """Score the tasks every this many steps (and at the end); 0: at every evaluation
    (eval_every) and at the end."""
    tasks_limit: int = 0
    """The first N items of each task (0: all), for a cheaper score at every evaluation."""


@dataclass
class TrainConfig:
    name: str = "default"
    out_dir: str = "runs"
    device: str = "auto"
    """'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N' (or 'mps', untested)."""
    precision: str = "auto"
    """'auto' (bf16 on GPUs that have it, else fp16 on CUDA, fp32 on CPU), 'bf16', 'fp16', 'fp32'."""
    max_steps: int = 120
    halt_after: int = 0
    """Checkpoint and exit after this many steps in this process (0: run to max_steps);
    for time-sliced clusters and preemption tests. The schedule still uses max_steps."""
    time_limit_s: float = 0.0
    """Stop (and checkpoint) after this many seconds of training; 0: no limit."""
    eval_every: int = 60
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 60
    """A checkpoint every this many steps; 0: none but the one at the run's end, which is
    always written (at a stop too: resume, pytrain.eval and export read it)."""
    keep_ckpts: int = 3
    """The newest checkpoints kept in the run directory; 0 keeps every one."""
    ckpt_async: bool = True
    """Write checkpoints on a background thread from a snapshot of the step (pinned host
    copies); off: the loop waits for the file."""
    resume: bool = True
    """Resume from the latest valid checkpoint in runs/<name>/ if there is one."""
    init_from: str = ""
    """Start a new run from these weights (continued pretraining): a Hugging Face directory
    (LlamaForCausalLM, e.g. Meta's Llama 3.2, or ArceeForCausalLM; config.json and
    safetensors, one file or sharded), or a pytrain run directory or checkpoint. The model's
    shape comes from it (the preset's speed settings stay); optimizer and schedule start
    fresh. A run that resumes from its own checkpoint continues from that instead."""
    activation_checkpointing: str = "off"
    """'off', 'full' (every block recomputes its forward in the backward), 'every-N' (every
    N-th block), or 'selective' (every block, keeping its attention and matmul outputs and
    recomputing only the cheap ops between them: pytrain.model.selective_ac)."""
    ac_lean_blocks: int = 0
    """Under 'selective', how many blocks (the first) also recompute their MLP's up
    projection (whichever runs it: quack's SwiGLU GEMM, the fused GELU's, a plain or float8
    linear layer) instead of keeping its output: at 8B, 448 MiB less a block for one GEMM
    more in its backward (measured on 4 H200s: about 0.7% of the tokens/s a block in bf16,
    0.2% in float8).
    Needs activation_checkpointing 'selective'; as many as the model's blocks or more:
    every block (--init_from may bring a shape other than the preset's)."""
    fsdp: bool | None = None
    """Under torchrun: shard parameters, gradients and optimizer state with FSDP2 (--fsdp),
    replicate the model on every rank (--no-fsdp), or unset (auto): FSDP2 where the training
    state would take over a quarter of one GPU's memory (pytrain.train.parallel)."""
    fsdp_shard_size: int = 0
    """Under FSDP2, how many ranks shard the model together: the job's ranks form groups of
    this many, which hold replicas of each other (HSDP: gradients reduce-scattered within a
    group, all-reduced between groups). 0 (auto): a node's ranks where the job spans
    several nodes (torchrun's LOCAL_WORLD_SIZE), else all ranks; N: groups of N consecutive
    ranks (N = all ranks: FSDP2 over every node). Needs --fsdp where it is not 0."""
    fsdp_hold_weights: bool = False
    """Under FSDP2, keep each unit's gathered bf16 weights from an optimizer step's first
    forward to its last backward: one all-gather a unit a step, instead of two a
    micro-batch (the forward's and the backward's), as FSDP1's SHARD_GRAD_OP did. Holds the
    whole model in bf16 on every GPU (2.5 GB at 1B, whose peak it did not raise; at 8B, 16
    GB: not for it). Gradients are still reduce-scattered every micro-batch. Ignored where
    the plan is not FSDP2."""
    fsdp_reduce_dtype: str = "fp32"
    """Under FSDP2 in bf16, the dtype each micro-batch's gradients are reduce-scattered in
    (and, under HSDP, all-reduced between groups): 'fp32', as torchtitan's
    mixed_precision_reduce by default, or 'bf16', half the traffic and the copy into the
    collective's buffer, the sum over ranks rounded to bf16 (Megatron-LM's default; the
    shards still accumulate the micro-batches in fp32). Ignored where the plan is not FSDP2
    or the run is not bf16."""
    ep: int = 1
    """Expert parallelism (a mixture of experts, `model.family moe`): the routed experts of
    every MoE block split over groups of `ep` ranks, each rank holding experts / ep of them
    whole, tokens sent to their experts' rank and back by all-to-alls; FSDP2 shards the rest
    of the model over all ranks and each expert's slice over the world / ep ranks that hold
    it (under HSDP, within each shard group; pytrain.train.expert_parallel). 1: off. Under torchrun only; it needs FSDP2 (fsdp
    auto takes it) and a number of ranks, and of experts, that ep divides."""
    dist_timeout_s: float = 120.0
    """Under torchrun, how long a collective waits for the other ranks once training runs
    (after the compile warm-up): a rank that died or hangs ends the job within this, not
    after NCCL's 10 minutes. Longer than any step and than rank 0's synchronous checkpoint
    write (docs/TRAINER.md, Distributed)."""
    dist_init_timeout_s: float = 900.0
    """The same during set-up, resume and the compile warm-up (a cold compile of a large
    model takes minutes, and the ranks meet at its end)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (for exact-resume checks)."""
    seed: int = 1337
    samples: int = 3
    """Text samples generated at the end."""
    sample_tokens: int = 80
    progress: bool = True
    tensorboard: bool = True
    wandb: bool = False
    """Also log to Weights & Biases (the wandb extra; pytrain/train/trackers.py): the scalars
    TensorBoard gets and the run's configuration. W&B's own settings say where:
    WANDB_PROJECT (else "pytrain"), WANDB_ENTITY, WANDB_MODE=offline."""
    mlflow: bool = False
    """Also log to MLflow (the mlflow extra), as wandb: MLFLOW_TRACKING_URI (else a SQLite
    store beside the runs, OUT_DIR/mlflow.db), MLFLOW_EXPERIMENT_NAME (else "pytrain")."""
    profile_steps: str = ""
    """'A:B' records steps A..B-1 with torch.profiler: runs/<name>/profile/ gets a Chrome
    trace and a table of kernel times per step (pytrain/train/profiling.py). Empty: off."""
    profile_memory: bool = False
    """With profile_steps, on a GPU: also records every allocation of torch's CUDA caching
    allocator over those steps, with its Python stack, into profile/memory.pickle (open it
    at pytorch.org/memory_viz: which tensors make the peak). Slows the recorded steps."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
