"""Checkpoints that a crash cannot half-write, and resuming from them exactly.

Layout under ``OUT/checkpoints/``: one folder per saved step, ``step-000300/`` (300 steps done),
holding ``shared.pt`` (model, optimizer, scheduler, progress, config; written by rank 0),
``rank-R.pt`` for every rank (its compressor and error-feedback state and its data generator,
which differ across ranks) and ``complete.json``. Every file is written to a temporary name,
fsynced and renamed. ``complete.json`` (the size and SHA-256 of every file, the world size and
the config) is written by rank 0 only after every rank has written (a barrier), and ``latest``
(a one-line text file naming the folder) after that, so a folder without ``complete.json``, or
with a file whose size or checksum differs from it, is one whose write was cut short or whose
bytes were damaged since.

``--resume DIR`` takes the folder ``latest`` names, or, if that one is incomplete, the newest
complete one before it; a checkpoint folder may also be named directly. Resuming restores the
model, the optimizer (moments and step count), the scheduler, every rank's compressor state
(error-feedback residuals, PowerSGD factors), every rank's data-order generator and the step
counter, so the continued run is bit-identical to one that was never interrupted. Under
``--fsdp`` ``shared.pt`` holds the full (unsharded) model and optimizer state, gathered to rank 0
(the optimizer's keyed by parameter name), and every rank takes its shards back on resume.
Under ``--outer`` every ``rank-R.pt`` also holds that rank's model and its whole
:class:`gradzip.DiLoCo` state (global parameters, outer momentum, residuals, exchanges in flight,
the inner AdamW), since replicas differ between outer steps.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradzip.lab.options import names_where
from gradzip.lab.train.atomic import atomic_save, atomic_write_text
from gradzip.lab.train.config import TrainConfig

MANIFEST = "complete.json"
_FOLDER = re.compile(r"^step-(\d+)$", re.ASCII)

#: settings a resumed run must share with its checkpoint: they shape the saved state or the data
MUST_MATCH = names_where(TrainConfig, "must_match")


class NoUsableCheckpoint(ValueError):
    """``--resume`` found nothing to resume from; the message says why, in one line."""


@dataclass
class Progress:
    """Where a run stands; saved with every checkpoint."""

    step: int = 0
    """Steps done (the next step to run)."""
    skipped_steps: int = 0
    """Steps skipped because a gradient held inf or NaN on some rank."""
    elapsed_s: float = 0.0
    """Training wall time so far."""
    initial_val_loss: float | None = None
    """Validation loss before the first step."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_of(folder: Path) -> int | None:
    """The step a checkpoint folder's name gives (``step-000300`` -> 300), None for other names."""
    match = _FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def save_checkpoint(
    out: str | Path,
    step: int,
    *,
    shared: dict[str, Any],
    per_rank: dict[str, Any],
    rank: int,
    world_size: int = 1,
    config: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Save this rank's part of the checkpoint of ``step``; rank 0 also writes the shared part,
    and, once every rank has written (a barrier), ``complete.json`` and the ``latest`` pointer.

    Args:
        keep: complete checkpoints to keep, the newest (by step, up to this one); 0 keeps all.

    Returns:
        the checkpoint folder.
    """
    root = Path(out) / "checkpoints"
    folder = root / f"step-{step:06d}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        # Rewriting a step that exists (a run resumed from an earlier one): it is incomplete
        # from now until the new manifest is in place.
        (folder / MANIFEST).unlink(missing_ok=True)
    _barrier()
    atomic_save(per_rank, folder / f"rank-{rank}.pt")
    if rank == 0:
        atomic_save(shared, folder / "shared.pt")
    _barrier()
    if rank == 0:
        names = ["shared.pt"] + [f"rank-{r}.pt" for r in range(world_size)]
        manifest = {
            "step": step,
            "world_size": world_size,
            "files": {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in names},
            "config": config or {},
        }
        atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        atomic_write_text(root / "latest", folder.name + "\n")
        if keep:
            prune(root, newest=step, keep=keep)
    return folder


def clear_earlier(out: str | Path) -> list[str]:
    """Remove the checkpoints an earlier run left in ``OUT/checkpoints`` (its step folders and the
    ``latest`` pointer), before a new run writes its own there: the new run replaces the folder's
    metrics and summary too, and a resumed run or a reader would otherwise meet two runs' steps.

    Returns:
        the names of the step folders removed, oldest first.
    """
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return []
    folders = sorted((f for f in root.iterdir() if f.is_dir() and step_of(f) is not None), key=step_of)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    (root / "latest").unlink(missing_ok=True)
    return [f.name for f in folders]


def prune(root: Path, *, newest: int, keep: int) -> None:
    """Delete checkpoint folders at or before step ``newest`` except the ``keep`` newest complete
    ones (incomplete leftovers among them go too). Later steps, from another run, stay."""
    folders = sorted((f for f in root.iterdir() if f.is_dir() and (step_of(f) or 0) <= newest), key=step_of, reverse=True)
    kept = 0
    for folder in folders:
        if step_of(folder) is None:
            continue
        if kept < keep and incomplete_reason(folder) is None:
            kept += 1
            continue
        shutil.rmtree(folder, ignore_errors=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def incomplete_reason(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint, or None if it is (reads every file)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST} (its write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged"
    except OSError as exc:
        return f"{MANIFEST} cannot be read ({exc.strerror or type(exc).__name__})"
    for name, (size, digest) in files.items():
        path = folder / name
        if "/" in name or not path.is_file():
            return f"{name} is missing"
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{name} has {actual} of its {size} bytes"
            if sha256(path) != digest:
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
    return None


def run_folder(path: str | Path) -> Path:
    """The run folder ``--resume PATH`` refers to (PATH itself, or the run a checkpoint folder is in)."""
    path = Path(path)
    if step_of(path) is not None and path.parent.name == "checkpoints":
        return path.parent.parent
    return path


def find_checkpoint(path: str | Path, *, option: str = "--resume") -> tuple[Path, list[str]]:
    """The checkpoint folder to resume from (``option``: the command-line option its errors name).

    Args:
        path: a run folder (holding ``checkpoints/``) or one checkpoint folder.

    Returns:
        the folder, and one note per newer checkpoint passed over (why it was unusable).

    Raises:
        NoUsableCheckpoint: if nothing complete is there; the message lists what was found.
    """
    path = Path(path)
    if not path.exists():
        raise NoUsableCheckpoint(f"{option}: no such folder: {path}")
    if not path.is_dir():
        raise NoUsableCheckpoint(f"{option}: {path} is a file; give its run folder or one checkpoint folder")
    if step_of(path) is not None or (path / MANIFEST).exists():
        reason = incomplete_reason(path)
        if reason is not None:
            raise NoUsableCheckpoint(f"{option}: checkpoint {path} is not usable: {reason}")
        return path, []
    root = path / "checkpoints"
    folders = sorted((f for f in root.glob("step-*") if step_of(f) is not None), key=step_of, reverse=True)
    named, notes = read_latest(root)
    if named is not None:
        # Newer folders than the one ``latest`` names belong to a later, unfinished write or
        # to another run: start at the named one.
        folders = [named] + [f for f in folders if step_of(f) < step_of(named)]
    for folder in folders:
        reason = incomplete_reason(folder) if folder.is_dir() else "is missing"
        if reason is None:
            return folder, notes
        notes.append(f"{folder.name}: {reason}")
    found = "; ".join(notes) if notes else f"no checkpoints under {root}"
    raise NoUsableCheckpoint(f"{option}: no usable checkpoint in {path} ({found})")


def read_latest(root: Path) -> tuple[Path | None, list[str]]:
    """The folder ``root/latest`` names, read defensively.

    Returns:
        the named checkpoint folder (which may be missing or damaged: the caller checks), or None
        when there is no pointer or it cannot be trusted; and a note saying why it was passed
        over (non-UTF-8 bytes, not a ``step-N`` name, unreadable), none when it is absent.
    """
    latest = root / "latest"
    if not latest.exists():
        return None, []
    try:
        text = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, ["latest: not UTF-8 text"]
    except OSError as exc:
        return None, [f"latest: cannot be read ({exc.strerror or type(exc).__name__})"]
    named = root / text
    # A bare step-N folder name only: never a path that leads out of the checkpoints folder.
    if "/" in text or "\\" in text or step_of(named) is None:
        shown = text if len(text) <= 40 else text[:40] + "..."
        return None, [f"latest: names {shown!r}, not a step-N folder"]
    return named, []


def manifest_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST).read_text())


def check_compatible(folder: Path, config: dict[str, Any], world_size: int) -> None:
    """Raise if this run cannot continue ``folder`` exactly.

    Raises:
        ValueError: if the checkpoint is already at ``steps``, or naming every setting that
            differs from the checkpoint's (world size, codec, model shape, data order, learning
            rate and weight decay, which the saved optimizer and schedule hold); the others
            (steps, ...) may change.
    """
    manifest = manifest_of(folder)
    saved = manifest.get("config", {})
    if manifest.get("step", 0) >= config.get("steps", 0):
        raise ValueError(
            f"--resume: {folder} is at step {manifest.get('step')} and --steps is {config.get('steps')}; "
            "nothing is left to train (raise --steps to continue)"
        )
    diffs = []
    if manifest.get("world_size") != world_size:
        diffs.append(f"--world-size (checkpoint {manifest.get('world_size')}, now {world_size})")
    # Under tsr-adam and demo DDP's hook never runs; checkpoints from before --compressor became
    # none under them recorded the unused default, which does not change the run.
    from gradzip.lab.train.optimizers import ignores_compressor, takes_codec

    same_optimizer = "optimizer" in saved and saved["optimizer"] == config.get("optimizer")
    hookless = same_optimizer and ignores_compressor(saved["optimizer"])
    must_match = list(MUST_MATCH)
    if same_optimizer and takes_codec(saved["optimizer"]):
        must_match.append("collective")  # local-adamw's residuals follow its route (two phases keep a server's)
    for name in must_match:
        if name == "compressor" and hookless:
            continue
        if name in saved and _canonical(saved[name]) != _canonical(config.get(name)):
            diffs.append(f"--{name.replace('_', '-')} (checkpoint {saved[name]!r}, now {config.get(name)!r})")
    if diffs:
        raise ValueError(
            f"--resume: {folder} was saved with other settings: {', '.join(diffs)}; a resumed run "
            "must use the checkpoint's settings for these"
        )


def _canonical(value: Any) -> Any:
    """A codec spec as the codec reads it (``topk:ratio=0.10`` is ``topk:ratio=0.1``); any other
    value, or a spec that is no plain codec (``auto``, ``torch:...``), as given."""
    if not isinstance(value, str):
        return value
    from gradzip.compressors import build

    try:
        return build(value).spec
    except ValueError:
        return value


def _load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NoUsableCheckpoint(f"--resume: {path} cannot be read ({first})") from None


def save_training_state(
    cfg, progress: Progress, *, rank: int, world_size: int, model, optimizer, scheduler, hook_state, data_gen,
    parallel=None, per_rank_optimizer: bool = False, per_rank_model: bool = False,
) -> Path:
    """Checkpoint everything a bit-identical continuation needs (see the module docstring).

    ``parallel`` (a :class:`gradzip.lab.train.parallel.Parallel`) supplies the full model and
    optimizer state (a collective under FSDP, so every rank calls this). With
    ``per_rank_optimizer`` each rank also saves its own optimizer state: optimizers that own their
    communication keep error buffers that differ across ranks. With ``per_rank_model`` each rank
    also saves its own model: under ``--outer`` the replicas' parameters differ between outer steps,
    and under 0/1 Adam between its synchronisations.
    """
    config = cfg.to_dict()
    if parallel is not None:
        model_state, optimizer_state = parallel.checkpoint_state(optimizer)
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    return save_checkpoint(
        cfg.out,
        progress.step,
        shared={
            "step": progress.step,
            "progress": asdict(progress),
            "config": config,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
        },
        per_rank={
            "rank": rank,
            "hook": hook_state.state_dict(),
            "data_generator": data_gen.get_state(),
            "optimizer": optimizer_state if per_rank_optimizer and rank == 0 else (
                optimizer.state_dict() if per_rank_optimizer else None),
            "model": (model_state if rank == 0 else model.state_dict()) if per_rank_model else None,
        },
        rank=rank,
        world_size=world_size,
        config=config,
        keep=cfg.keep_checkpoints,
    )


def restore_training_state(
    folder: Path, cfg, *, rank: int, world_size: int, model, optimizer, scheduler, hook_state, data_gen,
    parallel=None,
) -> Progress:
    """Load ``folder`` (from :func:`find_checkpoint`) into the live objects of this rank.

    ``parallel`` (a :class:`gradzip.lab.train.parallel.Parallel`) loads the full model and optimizer
    state into a sharded model (under FSDP every rank calls this).

    Raises:
        ValueError: if this run's settings differ from the checkpoint's where they must not, or
            the checkpoint does not fit the model, optimizer or compressor.
    """
    check_compatible(folder, cfg.to_dict(), world_size)
    shared = _load(folder / "shared.pt")
    mine = _load(folder / f"rank-{rank}.pt")
    try:
        optimizer_state = mine["optimizer"] if mine.get("optimizer") is not None else shared["optimizer"]
        model_state = mine["model"] if mine.get("model") is not None else shared["model"]
        if parallel is not None:
            parallel.load_checkpoint_state(optimizer, model_state, optimizer_state)
        else:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(shared["scheduler"])
        hook_state.load_state_dict(mine["hook"])
        data_gen.set_state(mine["data_generator"])
    except (KeyError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--resume: {folder} does not fit this run: {first}") from None
    return Progress(**shared["progress"])


def resume(
    cfg, *, rank: int, world_size: int, model, optimizer, scheduler, hook_state, data_gen, parallel=None
) -> Progress:
    """Find the checkpoint ``cfg.resume`` names and load it into this rank's live objects; rank 0
    says which one (and which newer ones it passed over) when progress output is on.

    Raises:
        NoUsableCheckpoint, ValueError: as :func:`find_checkpoint` and :func:`restore_training_state`.
    """
    folder, passed_over = find_checkpoint(cfg.resume)
    progress = restore_training_state(
        folder, cfg, rank=rank, world_size=world_size, model=model, optimizer=optimizer,
        scheduler=scheduler, hook_state=hook_state, data_gen=data_gen, parallel=parallel,
    )
    if rank == 0 and cfg.progress:
        print(f"resuming from {folder} (step {progress.step})" + "".join(f"; passed over {n}" for n in passed_over))
    return progress
