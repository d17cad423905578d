"""The main job's worker: one rank of data-parallel training with a compressed DDP hook.

Read top to bottom: set up the process group, data, model, DDP with the hook and the optimizer
(under ``--outer``: DDP inside each replica, and DiLoCo around the inner AdamW between replicas);
restore a checkpoint when resuming; measure compute alone; train with a validation pass every
``eval_every`` steps, skipping on every rank a step whose gradient is not finite on some rank
(under ``--outer`` on the ranks of that replica only, as DiLoCo's replicas step apart between
exchanges), and a checkpoint every ``checkpoint_every`` steps; save the final checkpoint; rank 0 writes the
metrics, the summary and the plot.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.choice import parse_compressor
from gradzip.control.monitor import QualityMonitor
from gradzip.lab.train import faults, layer_ratios, report
from gradzip.lab.train.checkpoint import Progress, resume, save_training_state
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.data import Corpus, batch_generator, sample_batch, val_batches
from gradzip.lab.train.hooks import warm_up_kernels
from gradzip.lab.train.known_gaps import gap_note
from gradzip.lab.train.model import build_model, count_parameters, next_token_loss
from gradzip.lab.train.optimizers import build_optimizer, owns_communication, params_differ
from gradzip.lab.train.optimizers import label as optimizer_label
from gradzip.lab.train.outer import build_outer, dense_bytes, describe
from gradzip.lab.train.parallel import Parallel, make_parallel
from gradzip.optim import grad_sync

CALIBRATION_STEPS = 3

#: steps skipped in a row (a non-finite gradient, or an update the optimizer skipped, on some rank)
#: after which a run is called diverged and stopped: an isolated overflow is skipped and forgotten,
#: a model whose loss stays NaN is not trained on to the last step. Ranks agree on every skip, so
#: they stop at the same step.
DIVERGED_AFTER = 10


def pick_backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to the peak, then cosine decay to 10% of it."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device) -> float:
    """Mean validation loss over fixed batches (every rank computes the same value)."""
    model.eval()
    losses = [float(next_token_loss(model, x.to(device), y.to(device))) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def measure_compute(par: Parallel, corpus: Corpus, cfg: TrainConfig, device) -> float:
    """Median forward + backward seconds with no gradient exchange (``no_sync``; under FSDP
    the parameter all-gathers still run), the floor of any step time; gradients are discarded
    and the model is unchanged."""
    gen = batch_generator(cfg.seed + 1, dist.get_rank())
    times = []
    for _ in range(CALIBRATION_STEPS):
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        start = time.perf_counter()
        with par.no_exchange():
            next_token_loss(par.module, x.to(device), y.to(device)).backward()
        times.append(time.perf_counter() - start)
        par.module.zero_grad(set_to_none=True)
    return report.median(times)


def settle_buckets(ddp: DDP, corpus: Corpus, cfg: TrainConfig, device) -> None:
    """One synced forward + backward with DDP's own all_reduce, before the hook is registered.

    DDP rebuilds its buckets after its first synced backward. Doing that here gives every step,
    the first one included, the final bucket layout, so state keyed by bucket (error feedback,
    PowerSGD factors) always meets the buckets it was made for, also in a run resumed at any step.
    The gradients are dropped; the model is unchanged.
    """
    gen = batch_generator(cfg.seed + 2, dist.get_rank())
    x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
    next_token_loss(ddp, x.to(device), y.to(device)).backward()
    ddp.zero_grad(set_to_none=True)


def train_worker(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run one rank. The process group is read from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), as torchrun and gradzip's launcher set it, unless one is
    already initialised (then it is used and left open).

    Returns:
        the summary on rank 0, None elsewhere.

    Raises:
        faults.PeerLost: when another rank died or stopped responding (a one-line message).
    """
    backend = pick_backend(cfg)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    try:
        return _train(cfg, dist.get_backend())
    except RuntimeError as exc:
        if not faults.is_lost_peer_error(exc):
            raise
        lost = faults.lost_peer(exc, rank=dist.get_rank(), world_size=dist.get_world_size())
        if lost is None:
            raise
        raise lost from None
    finally:
        if owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, backend: str) -> dict[str, Any] | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # the CPUs this worker may run on (a pinned host's share), not the machine's
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(cfg.threads or max(1, usable // local_workers))
    is_main = rank == 0

    if is_main and cfg.progress:
        wrapper = "FSDP" if cfg.fsdp else "DDP"
        report.status(f"{world_size} workers up ({backend}); building the model, {wrapper} and the codec's kernels")
    # Data and model.
    corpus = Corpus.load(cfg.data, cfg.vocab_size, model=cfg.model)
    corpus.check_fits(cfg.seq_len)
    model = build_model(cfg, corpus.vocab_size).to(device)
    replica_group = outer_group = None
    if cfg.outer is not None:
        from gradzip.outer import replica_groups

        replica_group, outer_group = replica_groups(world_size, cfg.replica_size, timeout=timedelta(seconds=cfg.timeout_s))
    par = make_parallel(model, cfg, settle=lambda ddp: settle_buckets(ddp, corpus, cfg, device), group=replica_group)
    # auto probes its candidates on a later step: theirs compile now as well (the per-layer
    # schedules build theirs as they plan)
    choices = [cfg.choice]
    if cfg.choice.kind == "auto":
        choices = [] if cfg.choice.per_layer else [parse_compressor(s) for s in cfg.auto_config().candidate_specs(world_size)]
    if cfg.outer is not None:
        choices = ([] if cfg.replica_size == 1 else choices) + [parse_compressor(cfg.outer_compressor)]
    kernels_s = sum(warm_up_kernels(choice) for choice in choices) if device.type == "cpu" else 0.0
    if is_main and kernels_s > 1.0:
        print(f"codec kernels ready in {kernels_s:.1f} s (compiled, native loops built unless cached)", file=sys.stderr)
    inner = build_optimizer(cfg, model, metrics=par.state.metrics)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(cfg))
    optimizer, outer_metrics = inner, None
    if cfg.outer is not None:
        from gradzip.metrics import StepMetrics

        outer_metrics = StepMetrics(monitor_every=cfg.monitor_every)
        optimizer = build_outer(cfg, model, inner, outer_group=outer_group,
                                replica_group=replica_group if cfg.replica_size > 1 else None, metrics=outer_metrics)
    per_rank = dict(per_rank_optimizer=owns_communication(optimizer) or outer_metrics is not None,
                    per_rank_model=outer_metrics is not None or params_differ(optimizer))
    data_gen = batch_generator(cfg.seed, rank)
    val = val_batches(corpus, cfg.eval_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
    tokens_per_step = world_size * cfg.batch_size * cfg.seq_len
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, hook_state=par.state, data_gen=data_gen)

    # Starting point (step 0, or where the checkpoint left off) and the floor of the step time.
    progress = resume(cfg, rank=rank, world_size=world_size, parallel=par, **state) if cfg.resume else Progress()
    if is_main and cfg.progress:
        report.status(f"first validation loss and compute alone ({CALIBRATION_STEPS} steps, no exchange), then training")
    if progress.initial_val_loss is None:
        progress.initial_val_loss = evaluate(model, val, device)
    compute_s = measure_compute(par, corpus, cfg, device)

    log = report.RunLog(cfg.out, start_step=progress.step) if is_main else None
    monitor = QualityMonitor(
        threshold=cfg.norm_warn, patience=cfg.norm_warn_checks,
        tensorboard_dir=Path(cfg.out) / "tensorboard" if cfg.tensorboard else None,
    ) if is_main else None
    bar = _progress(cfg, is_main, progress.step)
    fault_plan = faults.FaultPlan.from_env()  # test-only injection; empty unless GRADZIP_FAULTS is set
    train_start = time.perf_counter() - progress.elapsed_s
    paused_s = 0.0  # validation passes and checkpoints: measuring, not training, so kept out of elapsed_s
    # Under --outer and --no-exchange each replica (rank) skips its own steps, so a count of them is
    # not agreed: no stop there, and checkpoints are not held back by it.
    agreed_skips = outer_metrics is None and not cfg.no_exchange
    skipped_in_a_row, diverged_at = 0, None
    for step in range(progress.step, cfg.steps):
        fault_plan.at_step(model, rank=rank, step=step)
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, data_gen)
        step_start = time.perf_counter()
        with par.no_exchange() if cfg.no_exchange else grad_sync(par.module, optimizer):
            loss = next_token_loss(par.module, x.to(device), y.to(device))
            loss.backward()
        backward_end = time.perf_counter()
        # A step whose gradient is not finite on some rank is skipped by all ranks together; under
        # --outer each replica skips its own (its ranks share DDP's averaged gradient) and DiLoCo
        # counts the step anyway, so no collective runs between the outer exchanges.
        own_gradients = outer_metrics is None and (par.kind != "ddp" or (
            owns_communication(optimizer) and not optimizer.needs_grad_sync))
        exchanges = getattr(optimizer, "exchanges", 0)
        finite = faults.step_finite(model, own_gradients=own_gradients)
        if finite:
            optimizer.step()
        else:
            progress.skipped_steps += 1
            if outer_metrics is not None:
                optimizer.skip_step()
        if finite or outer_metrics is not None:  # the schedule follows the inner step count
            scheduler.step()
        skipped = not finite or bool(getattr(optimizer, "last_step_skipped", False))
        if finite and skipped:  # the optimizer skipped it itself (a non-finite update on some rank)
            progress.skipped_steps += 1
        skipped_in_a_row = skipped_in_a_row + 1 if skipped and agreed_skips else 0
        optimizer.zero_grad(set_to_none=True)
        step_end = time.perf_counter()

        comm = par.state.metrics.pop()
        replica_comm = None
        if outer_metrics is not None:
            replica_comm, comm = comm, outer_counts(outer_metrics.pop(), model, replica_group,
                                                     exchanged=optimizer.exchanges != exchanges)
        record = {
            "step": step,
            "loss": float(loss.detach()),
            "lr": scheduler.get_last_lr()[0],
            "elapsed_s": step_end - train_start - paused_s,
            "step_s": step_end - step_start,
            "fwd_bwd_s": backward_end - step_start,
            "optimizer_s": step_end - backward_end,
            "payload_bytes": comm["payload_bytes"],
            "dense_bytes": comm["dense_bytes"],
            "compression_ratio": comm["compression_ratio"],
            "compress_s": comm["compress_s"],
            "decompress_s": comm["decompress_s"],
            "communicate_s": comm["communicate_s"],
            "sent_bytes": comm["sent_bytes"],
            "received_bytes": comm["received_bytes"],
            "uncompressed_buckets": comm["uncompressed_buckets"],
            "fused_buckets": comm["fused_buckets"],
            "tokens": tokens_per_step * (step + 1),
            "skipped": skipped,
        }
        if replica_comm is not None:
            record["replica_payload_bytes"] = replica_comm["payload_bytes"]
        if "link" in comm:  # an adaptive compressor's estimate of the link
            record["link"] = comm["link"]
        if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
            eval_start = time.perf_counter()
            record["val_loss"] = evaluate(model, val, device)
            paused_s += time.perf_counter() - eval_start
        if monitor is not None:
            record.update(monitor.observe(step, comm, record))
        if log is not None:
            log.write(record)
            _update_progress(bar, record, tokens_per_step, progress.skipped_steps)
        progress.step, progress.elapsed_s = step + 1, record["elapsed_s"]
        # no checkpoint from the second step in a row skipped on: it may hold a model that is
        # diverging (one skip alone, an overflow, is routine and leaves no trace)
        if (cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0 and progress.step < cfg.steps
                and skipped_in_a_row < 2):
            save_start = time.perf_counter()
            save_training_state(
                cfg, progress, rank=rank, world_size=world_size, parallel=par,
                **per_rank, **state,
            )
            paused_s += time.perf_counter() - save_start
        if skipped_in_a_row >= DIVERGED_AFTER:
            diverged_at = step + 1 - skipped_in_a_row
            break

    if bar is not None:
        bar.close()
    if owns_communication(optimizer) or outer_metrics is not None:
        optimizer.synchronize()  # 0/1 Adam: ranks that took local steps meet again; DiLoCo: land what is in flight
    final_val = evaluate(model, val, device)
    # a diverged model is not saved: the last checkpoint stays the latest (the ranks agree on it)
    if diverged_at is None and faults.everywhere(math.isfinite(final_val), device):
        save_training_state(
            cfg, progress, rank=rank, world_size=world_size, parallel=par,
            **per_rank, **state,
        )
    skipped_by_replica = None
    if not agreed_skips and world_size > 1:  # each replica (each rank under --no-exchange) skipped its own
        replica_size = cfg.replica_size if outer_metrics is not None else 1
        skipped_by_replica = faults.gathered(progress.skipped_steps, device)[::replica_size]
    if log is None:
        return None
    log.close()
    monitor.close()
    summary = report.summarize(
        log.records,
        compressor=run_name(cfg),
        optimizer=cfg.optimizer,
        hook=par.hook,
        parallel=par.kind,
        collective=cfg.collective,
        min_compress_bytes=cfg.min_compress_bytes,
        world_size=world_size,
        backend=backend,
        parameters=count_parameters(model),
        model=cfg.model or "gpt2 (from scratch)",
        corpus=corpus.name,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        initial_val_loss=progress.initial_val_loss,
        final_val_loss=final_val,
        initial_train_loss=log.records[0]["loss"],
        final_train_loss=log.records[-1]["loss"],
        compute_s=compute_s,
    )
    summary["tokens_per_s"] = tokens_per_step / summary["step_s_median"] if summary["step_s_median"] else 0.0
    summary["skipped_steps"] = progress.skipped_steps if skipped_by_replica is None else sum(skipped_by_replica)
    if skipped_by_replica is not None:
        summary["skipped_steps_by_replica"] = skipped_by_replica
    summary["diverged"] = report.divergence(log.records, final_val, diverged_at=diverged_at,
                                            skipped_in_a_row=skipped_in_a_row)
    summary["monitor"] = monitor.summary()
    summary["known_gap"] = gap_note(cfg.choice, cfg.optimizer)
    if cfg.outer is not None:
        summary.update(outer=cfg.outer, outer_compressor=cfg.outer_compressor, replica_size=cfg.replica_size,
                       inner_compressor=cfg.compressor if cfg.replica_size > 1 else None,
                       replica_payload_bytes_per_step=sum(r.get("replica_payload_bytes", 0) for r in log.records)
                       / len(log.records))
    out = Path(cfg.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = f"{summary['compressor']} on {world_size} workers" + (f", {cfg.model}" if cfg.model else "")
    report.plot_losses(log.records, out / "loss.png", title, summary["initial_val_loss"])
    per_layer = layer_ratios.plot(log.records, out / "layer_ratios.png", f"Compression ratio per layer: {title}")
    if cfg.progress:
        print(report.summary_table(summary))
        print("\n".join(monitor.summary_lines()))
        if summary["known_gap"]:
            print(f"note: {summary['known_gap']}")
        unpeeled = report.unpeeled_note(summary)
        if unpeeled:
            print(f"note: {unpeeled}")
        print(f"\nwrote {out}/metrics.jsonl, summary.json, loss.png, {'layer_ratios.png, ' if per_layer else ''}"
              "checkpoints/")
    return summary


def run_name(cfg: TrainConfig) -> str:
    """What the run exchanges, for the summary and the progress bar."""
    if cfg.outer is not None:
        return describe(cfg)
    return "no-exchange" if cfg.no_exchange else cfg.compressor


def outer_counts(comm: dict[str, Any], model: torch.nn.Module, replica_group, *, exchanged: bool) -> dict[str, Any]:
    """The step's figures of the outer exchange, between replicas: ``dense_bytes`` is the dense
    gradient DDP between the replicas would send every step, so ratios are against it. A
    replica of several ranks shares its exchange out (each rank sends some buckets); on steps
    where it exchanged, its ranks add up their bytes (a small all_reduce inside the replica)."""
    comm = dict(comm, dense_bytes=dense_bytes(model))
    if replica_group is not None and dist.get_world_size(replica_group) > 1 and exchanged:
        counts = torch.tensor([comm["payload_bytes"], comm["sent_bytes"], comm["received_bytes"]], dtype=torch.float64)
        dist.all_reduce(counts, group=replica_group)
        comm["payload_bytes"], comm["sent_bytes"], comm["received_bytes"] = (int(v) for v in counts.tolist())
    comm["compression_ratio"] = comm["dense_bytes"] / comm["payload_bytes"] if comm["payload_bytes"] else 0.0
    return comm


def _progress(cfg: TrainConfig, is_main: bool, start_step: int = 0):
    """tqdm's bar on a terminal; where stderr is a file or a pipe (a job's log), a line every
    twentieth of the run instead, since the bar's redraws would pile up there as one long line."""
    if not (is_main and cfg.progress):
        return None
    name = f"train {optimizer_label(cfg.optimizer, run_name(cfg))}"
    if not sys.stderr.isatty():
        return report.ProgressLines(name, total=cfg.steps, initial=start_step)
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)


def _update_progress(bar, record: dict[str, Any], tokens_per_step: int, skipped_steps: int = 0) -> None:
    if bar is None:
        return
    postfix = {
        "loss": f"{record['loss']:.3f}",
        "tok/s": f"{tokens_per_step / record['step_s']:,.0f}",
    }
    if record["payload_bytes"] or not record["dense_bytes"]:  # else the hook did not count its bytes
        postfix["ratio"] = f"{record['compression_ratio']:.1f}x"
    if "val_loss" in record:
        postfix["val"] = f"{record['val_loss']:.3f}"
    if skipped_steps:
        postfix["skipped"] = f"{skipped_steps} (non-finite gradient)"
    if "norm_warning" in record:
        postfix["warn"] = record["norm_warning"]
    bar.set_postfix(postfix, refresh=False)
    bar.update(1)
