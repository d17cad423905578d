"""Start the main job: N local workers spawned here, or one rank under torchrun.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) this process is one rank
and runs it. Otherwise the launcher prepares the data once (so workers find the tokenizer
cached), hosts the rendezvous store itself (so it outlives any worker, as torchrun's agent store
does, and the survivors of a dead worker can still hold their roll call), spawns ``world_size``
processes and waits. When one fails, the others get ``GRACE_S`` seconds to stop by themselves
(they notice a dead peer at once, a hung one after ``--timeout-s``), then are terminated and,
failing that, killed; the failure is reported in one line naming the rank, with the checkpoint
to resume from.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gradzip.lab.train import report
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.data import Corpus
from gradzip.lab.train.known_gaps import gap_note
from gradzip.lab.train.optimizers import dense_steps_note

#: seconds the other workers get to stop by themselves after one fails (then SIGTERM, SIGKILL)
GRACE_S = 20.0


class WorkerFailed(RuntimeError):
    """A worker process died or raised; the message names the rank."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _die_with(launcher: int) -> None:
    """Stop this worker when its launcher dies without stopping it (SIGKILL, the OOM killer), so
    no worker trains on alone into the run folder: on Linux the kernel sends SIGTERM when the
    parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread looks every second."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) == 0:
            if os.getppid() != launcher:  # it died before the call: no signal will come
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gradzip-launcher-watch", daemon=True).start()


def _spawned(local_rank: int, cfg: TrainConfig, port: int, status_dir: str, launcher: int) -> None:
    from gradzip.lab.train.faults import PeerLost, leave
    from gradzip.lab.train.loop import pick_backend, train_worker

    _die_with(launcher)

    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_WORLD_SIZE=str(cfg.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    timeout = timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(pick_backend(cfg), store=store, rank=local_rank, world_size=cfg.world_size, timeout=timeout)
    try:
        train_worker(cfg)
        dist.destroy_process_group()
    except PeerLost as exc:
        _write_status(status_dir, local_rank, {"kind": "lost", "message": str(exc), "silent": exc.silent or []})
        leave(str(exc))
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        message = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        _write_status(status_dir, local_rank, {"kind": "error", "message": message})
        raise


def _write_status(status_dir: str, rank: int, status: dict) -> None:
    """Leave this worker's account of its failure for the launcher (written whole, then renamed)."""
    path = os.path.join(status_dir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(path + ".tmp", path)


def _read_status(status_dir: str, rank: int) -> dict:
    path = os.path.join(status_dir, f"rank-{rank}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def launch(cfg: TrainConfig, notes: list[str] | None = None, *, checkpoint: Path | None = None) -> dict[str, Any] | None:
    """Validate, then train. Returns rank 0's summary where this process ran or spawned rank 0.
    ``notes``: lines to print on stderr once every check has passed (rank 0). ``checkpoint``: the
    folder ``cfg.resume`` names, where the caller has found (and verified) it already. A run that
    does not resume removes the checkpoints an earlier run left in ``--out``, saying so.

    Raises:
        ValueError: for bad settings (before any worker starts).
        WorkerFailed: if a worker fails.
    """
    cfg.validate()
    idle = preflight(cfg)
    corpus = Corpus.load(cfg.data, cfg.vocab_size, say=report.status if cfg.progress else None, model=cfg.model)
    corpus.check_fits(cfg.seq_len)
    if cfg.model is not None:
        from gradzip.lab.train.pretrained import check_embedding_rows

        check_embedding_rows(cfg.model, corpus.vocab_size)
    if cfg.resume:
        from gradzip.lab.train.checkpoint import check_compatible, find_checkpoint

        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.world_size
        check_compatible(checkpoint or find_checkpoint(cfg.resume)[0], cfg.to_dict(), world_size)
    from gradzip.lab.cli import warn

    for line in idle if os.environ.get("RANK", "0") == "0" else []:
        warn(line)  # after every check, so that a refused run prints its one error line alone
    for line in notes or [] if os.environ.get("RANK", "0") == "0" else []:
        print(f"{report.command()}: {line}", file=sys.stderr)
    notes = [gap_note(cfg.choice, cfg.optimizer), dense_steps_note(cfg)]
    if cfg.warmup_steps >= cfg.steps > 0 and not cfg.resume:
        notes.append(f"--warmup-steps {cfg.warmup_steps} covers all {cfg.steps} steps: the learning rate never "
                     f"reaches --lr {cfg.lr:g} and never decays (lower --warmup-steps for a short run)")
    if cfg.progress and os.environ.get("RANK", "0") == "0":
        for note in filter(None, notes):
            report.status(f"note: {note}")
    if not cfg.resume and os.environ.get("RANK", "0") == "0":
        from gradzip.lab.train.checkpoint import clear_earlier

        removed = clear_earlier(cfg.out)
        if removed:
            print(f"{report.command()}: --out {cfg.out}: removed the {len(removed)} checkpoint(s) an earlier run left "
                  f"there ({removed[0]}{' to ' + removed[-1] if len(removed) > 1 else ''}); --resume {cfg.out} "
                  "continues a run instead", file=sys.stderr)
    if under_torchrun():
        from gradzip.lab.train.loop import train_worker

        return train_worker(cfg)
    spawn_workers(cfg)
    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else None


#: options read only with ``--compressor auto``, and only with ``--monitor-every`` above 0
AUTO_ONLY = ("adapt_every", "auto_schedule", "auto_candidates", "auto_max_error")
MONITOR_ONLY = ("norm_warn", "norm_warn_checks")
#: options of the GPT-2 trained from scratch, which a pretrained ``--model`` replaces
SCRATCH_ONLY = ("vocab_size", "n_layer", "n_embd", "n_head")


def preflight(cfg: TrainConfig) -> list[str]:
    """What this machine can tell before any worker starts: the backend runs here, ``--out``
    can be written, the ``tensorboard`` package is there for ``--tensorboard``, the
    ``--compressor auto`` options are valid (whether or not auto reads them).

    Returns:
        one warning per option set where nothing reads it (an ``--auto-*`` option without
        ``--compressor auto``, a norm warning without monitoring, a GPT-2 shape with ``--model``).

    Raises:
        ValueError: naming the option, in one line.
    """
    check_backend(cfg)
    try:
        cfg.auto_config().validate()  # checked whether or not --compressor auto reads it
    except ValueError as exc:
        message = str(exc)
        for field, option in (("max_error", "--auto-max-error"), ("adapt_every", "--adapt-every")):
            if message.startswith(field + " "):
                message = option + message[len(field):]
        raise ValueError(message) from None
    from gradzip.lab.cli import writable_folder

    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    writable_folder(cfg.out, "--out")
    defaults = TrainConfig()
    idle = []
    if cfg.compressor.strip().lower() != "auto":
        idle += [(name, "--compressor auto") for name in AUTO_ONLY if getattr(cfg, name) != getattr(defaults, name)]
    if not cfg.monitor_every:
        idle += [(name, "--monitor-every above 0") for name in MONITOR_ONLY if getattr(cfg, name) != getattr(defaults, name)]
    lines = [f"--{name.replace('_', '-')} has no effect without {needs}" for name, needs in idle]
    if cfg.model is not None:
        lines += [f"--{name.replace('_', '-')} has no effect with --model (its own config sets it)"
                  for name in SCRATCH_ONLY if getattr(cfg, name) != getattr(defaults, name)]
    if cfg.outer is not None:
        from gradzip.lab.train.outer import parse_outer

        sync_every = parse_outer(cfg.outer)["sync_every"]  # an integer >= 1 by now: check_outer ran
        if sync_every > cfg.steps:
            lines.append(f"--outer: sync_every={sync_every} is more than --steps {cfg.steps}: "
                         "the replicas never exchange (each trains alone)")
    return lines


def check_backend(cfg: TrainConfig) -> None:
    """Refuse a process-group backend this machine cannot run for this many local workers.

    Raises:
        ValueError: naming ``--backend`` and what is missing.
    """
    import torch

    from gradzip.lab.train.loop import pick_backend

    backend = pick_backend(cfg)
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError(f"--backend gloo: this torch build ({torch.__version__}) has no gloo backend")
    if backend != "nccl":
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun() else cfg.world_size
    if not torch.cuda.is_available():
        raise ValueError(
            f"--backend nccl needs CUDA GPUs and this machine has none available to torch {torch.__version__}; "
            "use --backend gloo"
        )
    if not dist.is_nccl_available():
        raise ValueError(f"--backend nccl: this torch build ({torch.__version__}) has no NCCL; use --backend gloo")
    if torch.cuda.device_count() < local:
        raise ValueError(
            f"--backend nccl runs one local worker per GPU: {local} workers, {torch.cuda.device_count()} GPUs visible; "
            "lower --world-size or use --backend gloo"
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the launcher: stopped like an interrupt, so no worker is left running."""


def _terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM (a scheduler's or timeout's stop) unwinds like Ctrl-C, as
    :class:`Terminated`, so the caller's interrupt handling stops what it started; only the main
    thread may set a handler (elsewhere this does nothing)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def spawn_workers(cfg: TrainConfig) -> None:
    """Run ``cfg.world_size`` local workers to the end.

    Raises:
        WorkerFailed: if a worker fails (the others stopped, none left running).
    """
    timeout = timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    if cfg.progress:
        report.status(f"starting {cfg.world_size} workers (each imports torch and builds the model)")
    with tempfile.TemporaryDirectory(prefix="gradzip-workers-") as status_dir:
        ctx = mp.start_processes(
            _spawned, args=(cfg, store.port, status_dir, os.getpid()), nprocs=cfg.world_size, join=False,
            start_method="spawn",
        )
        with sigterm_as_interrupt():
            try:
                failure = wait_for_workers(ctx.processes, status_dir, GRACE_S, store)
            except KeyboardInterrupt:
                _stop(ctx.processes, GRACE_S)
                raise
    if failure is not None:
        raise WorkerFailed(failure + _resume_hint(cfg.out)) from None


def wait_for_workers(procs, status_dir: str, grace_s: float, store: dist.Store | None = None) -> str | None:
    """Wait for every worker; after the first failure give the rest ``grace_s`` seconds to stop
    by themselves, then SIGTERM, then SIGKILL, so no process is left running. Workers that have
    exited are marked gone in ``store``, so the survivors' roll call need not wait for them.

    Returns:
        None if all succeeded, else one line naming the rank at fault: one that died (exited
        with no account of an error) before one that raised, before one that only lost a peer.
    """
    waiting = {proc.sentinel: proc for proc in procs}
    while waiting and not any(proc.exitcode not in (None, 0) for proc in procs):
        for sentinel in multiprocessing.connection.wait(list(waiting)):
            waiting.pop(sentinel).join()
    if not any(proc.exitcode not in (None, 0) for proc in procs):
        return None
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not _only_silent_alive(procs, status_dir):
        if store is not None:
            _mark_gone(procs, store)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
    stopped = _stop(procs, grace_s)
    return _diagnose(procs, status_dir, stopped)


def _stop(procs, grace_s: float) -> list[int]:
    """SIGTERM to every worker still running, ``grace_s`` seconds for each to exit, then SIGKILL;
    returns the ranks that had to be stopped."""
    stopped = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in stopped:
        procs[rank].terminate()
    for rank in stopped:
        procs[rank].join(grace_s)
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join()
    return stopped


def _mark_gone(procs, store: dist.Store) -> None:
    from gradzip.lab.train.faults import roll_call_key

    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            store.set(roll_call_key(rank, "gone"), str(proc.exitcode))


def _only_silent_alive(procs, status_dir: str) -> bool:
    """Whether every worker still running is one the others found silent in their roll call (a
    hung worker: no reason to wait for it)."""
    alive = {rank for rank, proc in enumerate(procs) if proc.is_alive()}
    silent = set()
    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            silent.update(_read_status(status_dir, rank).get("silent", []))
    return alive <= silent


def _diagnose(procs, status_dir: str, stopped: list[int]) -> str:
    died, raised, lost = [], [], []
    for rank, proc in enumerate(procs):
        if rank in stopped or proc.exitcode == 0:
            continue
        status = _read_status(status_dir, rank)
        if status.get("kind") == "lost":
            lost.append(f"worker {status['message']}")
        elif status.get("kind") == "error":
            raised.append(f"worker rank {rank} failed: {status['message']}")
        else:
            died.append(f"worker rank {rank} died ({_exit_text(proc.exitcode)})")
    first = (died + raised + lost + ["a worker failed"])[0]
    if stopped:
        first += f"; terminated rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}, which did not stop by itself"
    return first


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _resume_hint(out: str) -> str:
    from gradzip.lab.train.checkpoint import NoUsableCheckpoint, find_checkpoint

    try:
        folder, _ = find_checkpoint(out)
    except NoUsableCheckpoint:
        return "; no checkpoint to resume from"
    return f"; resume with --resume {out} (last complete checkpoint: {folder.name})"
