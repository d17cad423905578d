"""Run the main job once per compressor on one network and write the comparison."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradzip.compressors.values import check_int, check_number
from gradzip.lab.cluster import Cluster, burst_bytes, format_bandwidth, parse_bandwidth, support_problem
from gradzip.lab.cluster.schedule import RateChange, format_link_schedule, parse_link_schedule
from gradzip.lab.compare import report
from gradzip.lab.compare.analysis import BASELINE, LIMIT, TARGET_MARGIN, compare_rows, merge_repeats
from gradzip.lab.compare.progress import EntryProgress
from gradzip.lab.compare.runner import (
    RUN_FILE,
    TRAIN_PREFIX,
    Emulated,
    Loopback,
    RunResult,
    launch_run,
    load_run,
    train_command,
)
from gradzip.lab.train.config import TrainConfig

NETWORKS = ("auto", "emulated", "loopback")
SETUP_FILE = "setup.json"  # the comparison's settings, for --report-only
MAX_TARGET_LOSS = 1e6  # a validation loss (nats per token) past any that training reports


@dataclass
class CompareConfig:
    """Settings of ``gradzip compare``; :meth:`validate` raises ``ValueError`` on bad values."""

    compressors: list[str]
    """Codec specs (and ``torch:...`` hooks) to run; ``none`` is added when missing (the baseline)
    unless ``baseline`` is False."""

    world_size: int = 4
    """Workers, one per emulated host."""

    bandwidth: str = "100mbit"
    """Each host's link rate in each direction (``20mbit``, ``1gbit``)."""

    steps: int = 100
    """Training steps of every run."""

    seed: int = 0
    """Seed of model init and data order, the same for every run."""

    out: str = "runs/compare"
    """Output folder: report.md, results.json, the plots, and one folder per run under ``runs/``."""

    network: str = "auto"
    """``emulated`` (network namespaces; needs root), ``loopback``, or ``auto`` (emulated where
    possible, else loopback, saying why)."""

    link_schedule: str | None = None
    """``STEP:RATE`` pairs (``40:20mbit,80:100mbit``): every entry's link changes to ``RATE`` once
    its step ``STEP - 1`` is recorded, from ``bandwidth`` at the start of each entry
    (:mod:`gradzip.lab.cluster.schedule`); needs ``network="emulated"``, steps below ``steps``."""

    target_loss: float | None = None
    """Validation loss to reach; None: the baseline's final validation loss plus ``target_margin``."""

    target_margin: float = TARGET_MARGIN
    """The default target's margin over the baseline's final validation loss, a fraction in [0, 1]."""

    timeout_s: float = 3600.0
    """Wall-clock limit of one run; a run past it is stopped and reported as ``timeout``."""

    collective_timeout_s: float = 300.0
    """Timeout of every collective inside a run (``gradzip train --timeout-s``)."""

    ranks_per_host: int = 1
    """Ranks on each emulated host, dividing ``world_size``: their traffic inside the host is not
    limited; DiLoCo entries take one replica per host (``--replica-size``)."""

    pin_cpus: bool = True
    """Run each emulated host's workers on its own share of this machine's CPUs
    (:func:`gradzip.lab.cluster.netns.host_cpus`), as real hosts have their own; False leaves
    their placement to the kernel. Loopback runs are never pinned."""

    limit: bool = True
    """Also run the ``limit`` row: the same workers with no gradient exchange."""

    baseline: bool = True
    """Run the ``none`` row (dense DDP) even when ``compressors`` leaves it out; False needs
    ``target_loss`` (the default target is taken from that row), and the ratios against
    ``none`` are then left blank."""

    repeats: int = 1
    """Rounds of runs, in [1, 20]: every round runs every row once, in the same order, so that a
    slow minute of a shared machine falls on the rows of one round alike; timings are reported
    as medians over the rounds (:func:`gradzip.lab.compare.analysis.merge_repeats`)."""

    keep_checkpoints: bool = False
    """Keep each run's checkpoint (they are large and the comparison does not need them)."""

    train_options: dict[str, Any] = field(default_factory=dict)
    """Further ``gradzip train`` options by name (``batch_size``, ``eval_every``, ...)."""

    train_prefix: tuple[str, ...] = TRAIN_PREFIX
    """The command that runs one rank of the main job (tests substitute a stand-in)."""

    command: str = ""
    """The command line, quoted in the report."""

    def validate(self) -> CompareConfig:
        if not self.compressors:
            raise ValueError("--compressors must name at least one compressor")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or not 1 <= self.world_size <= 64:
            raise ValueError(f"--world-size must be an integer in [1, 64]; got {self.world_size!r}")
        check_int(self.ranks_per_host, name="--ranks-per-host", low=1, high=self.world_size)
        if self.world_size % self.ranks_per_host:
            raise ValueError(f"--ranks-per-host must divide --world-size={self.world_size}; got {self.ranks_per_host}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"--steps must be an integer >= 1; got {self.steps!r}")
        if self.network not in NETWORKS:
            raise ValueError(f"--network must be one of {', '.join(NETWORKS)}; got {self.network!r}")
        try:
            parse_bandwidth(self.bandwidth)
        except ValueError as exc:
            raise ValueError(f"--{exc}") from None
        if self.link_schedule is not None:
            if self.network != "emulated":
                raise ValueError(f"--link-schedule changes the emulated hosts' links: it needs --network emulated; "
                                 f"got --network {self.network}")
            last = self.link_changes()[-1].step
            if last >= self.steps:
                raise ValueError(f"--link-schedule: step {last} is past the last step of the run ({self.steps - 1}, "
                                 f"--steps {self.steps})")
        check_int(self.seed, name="--seed", low=0, high=2**63 - 1)
        for name in ("timeout_s", "collective_timeout_s"):
            check_number(getattr(self, name), name=f"--{name.replace('_', '-')}", low=0, low_open=True)
        if self.target_loss is not None:
            check_number(self.target_loss, name="--target-loss", low=0, low_open=True, high=MAX_TARGET_LOSS)
        check_number(self.target_margin, name="--target-margin", low=0, high=1)
        check_int(self.repeats, name="--repeats", low=1, high=20)
        if not self.baseline and self.target_loss is None:
            raise ValueError(f"--no-baseline leaves out the '{BASELINE}' row, whose final loss sets the default target: "
                             "give --target-loss too")
        if LIMIT in self.compressors:
            raise ValueError(f"'{LIMIT}' is the no-exchange row, added by default; it is not a compressor")
        return self

    def link_changes(self) -> list[RateChange]:
        """``link_schedule`` read (empty when None).

        Raises:
            ValueError: naming ``--link-schedule`` for a malformed schedule.
        """
        return [] if self.link_schedule is None else parse_link_schedule(self.link_schedule)

    def entries(self) -> list[str]:
        """Row labels in run order: ``limit`` (unless ``limit`` is False), ``none`` (unless
        ``baseline`` is False), then the compressors as given."""
        labels = ([LIMIT] if self.limit else []) + ([BASELINE] if self.baseline else [])
        for spec in self.compressors:
            if spec not in labels:
                labels.append(spec)
        return labels


def split_compressors(text: str) -> list[str]:
    """``none,fp16,qsgd:bits=4,bucket=512`` -> ``["none", "fp16", "qsgd:bits=4,bucket=512"]``: a
    comma-separated part that is only ``key=value`` (up to a ``+``) continues the spec before it
    (:func:`gradzip.compressors.spec.split_spec_list`).

    Raises:
        ValueError: naming ``--compressors`` when the list starts with a bare ``key=value``.
    """
    from gradzip.compressors.spec import split_spec_list

    return split_spec_list(text, name="--compressors")


def _check_specs(cfg: CompareConfig) -> None:
    """Fail on a bad spec or training option now, not in the fifth run."""
    from gradzip.lab.options import list_entry
    from gradzip.lab.train.optimizers import check_optimizer, names_optimizer, split_optimizer_entry
    from gradzip.lab.train.outer import names_outer, split_entry

    for spec in cfg.compressors:
        # the train options' messages name --optimizer, --outer, --compressor..., which this command has not
        if names_optimizer(spec):
            optimizer, codec = split_optimizer_entry(spec)
            run = TrainConfig(optimizer=optimizer, compressor=codec, steps=cfg.steps,
                              **{k: v for k, v in cfg.train_options.items() if v is not None})
            list_entry("--compressors", spec, lambda _s, run=run: check_optimizer(run),
                       names=("--optimizer ", f"--compressor {codec}: "))
        elif names_outer(spec):
            outer, codec = split_entry(spec)
            run = TrainConfig(outer=outer, outer_compressor=codec, compressor="none", steps=cfg.steps,
                              world_size=cfg.world_size, replica_size=cfg.ranks_per_host)
            list_entry("--compressors", spec, lambda _s, run=run: run.validate(),
                       names=("--outer: ", f"--outer-compressor {codec}: "))
        else:  # the spec with train's default options, as each run will use it
            list_entry("--compressors", spec,
                       lambda s: TrainConfig(compressor=s, steps=cfg.steps, world_size=cfg.world_size).validate())
    TrainConfig(
        steps=cfg.steps, seed=cfg.seed, world_size=cfg.world_size, timeout_s=cfg.collective_timeout_s, out=cfg.out,
        **cfg.train_options,
    ).validate()


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def run_folder(out: Path, label: str, round_index: int) -> Path:
    """Where a row's run of round ``round_index`` (from 0) lives: ``runs/<label>`` for the first
    round, ``runs/repeat<k>/<label>`` for round ``k`` from 2 on."""
    base = out / "runs" if round_index == 0 else out / "runs" / f"repeat{round_index + 1}"
    return base / _slug(label)


def _progress_line(index: int, total: int, result: RunResult, row: dict[str, Any]) -> str:
    parts = [f"[{index}/{total}] {result.label:<28} {result.status:<7}", f"{row['steps']:>4} steps"]
    if row["step_s"] is not None:
        parts.append(f"step {row['step_s']:.3f} s")
    if row["final_val_loss"] is not None:
        parts.append(f"val {row['final_val_loss']:.4f}")
    if row["wire_bytes"] is not None:
        parts.append(f"wire {row['wire_bytes'] / 1e6:,.1f} MB/rank")
    parts.append(f"({result.process_wall_s:.0f} s)")
    if result.error:
        parts.append(f"- {result.error}")
    return "  ".join(parts)


def _loopback_reason(network: str, pin_cpus: bool) -> str | None:
    """Why the runs go over loopback, or None when they run on emulated hosts."""
    if network == "loopback":
        return "asked for with --network loopback"
    problem = support_problem(pin_cpus=pin_cpus)
    if problem and network == "emulated":
        raise ValueError(problem)
    return problem


def run_compare(cfg: CompareConfig, *, log=print) -> list[dict[str, Any]]:
    """Run every entry, then write report.md, results.json and the plots into ``cfg.out``.

    Returns:
        the rows of ``results.json``.

    Raises:
        ValueError: for bad settings, or ``network="emulated"`` where namespaces are unavailable.
    """
    cfg.validate()
    from gradzip.lab.cli import writable_folder

    out = writable_folder(cfg.out, "--out")
    if cfg.train_prefix == TRAIN_PREFIX:
        _check_specs(cfg)
        from gradzip.lab.train.data import Corpus

        # tokenize once here, so that the ranks find the cache instead of all building it
        Corpus.load(cfg.train_options.get("data"), cfg.train_options.get("vocab_size") or TrainConfig().vocab_size,
                    model=cfg.train_options.get("model"))

    reason = _loopback_reason(cfg.network, cfg.pin_cpus)
    emulated = reason is None
    if not emulated and cfg.network == "auto":
        log(f"gradzip compare: {reason}; running on loopback without a bandwidth limit")
    bandwidth = format_bandwidth(parse_bandwidth(cfg.bandwidth))
    link_changes = cfg.link_changes()

    entries = cfg.entries()
    rounds: list[list[RunResult]] = []
    hosts = cfg.world_size // cfg.ranks_per_host
    total = len(entries) * cfg.repeats
    with Cluster(hosts, bandwidth, pin_cpus=cfg.pin_cpus) if emulated else nullcontext() as cluster:
        network = Emulated(cluster, cfg.ranks_per_host) if emulated else Loopback()
        # Written first, and an earlier comparison's outputs cleared, so that the folder only
        # ever holds this comparison's: an interrupted one can still be reported (--report-only)
        # from the runs it finished.
        setup = {
            "entries": entries,
            "network": "emulated" if emulated else "loopback",
            "network_reason": None if emulated else reason,
            "bandwidth": bandwidth,
            "link": f"{bandwidth} links" if emulated else "loopback",
            # the tbf bucket at the starting rate, as the cluster set it (it follows a --link-schedule)
            "tbf_burst_bytes": burst_bytes(parse_bandwidth(bandwidth)) if emulated else None,
            "link_schedule": format_link_schedule(link_changes) if link_changes else None,
            "world_size": cfg.world_size,
            "ranks_per_host": cfg.ranks_per_host,
            "steps": cfg.steps,
            "seed": cfg.seed,
            "eval_every": cfg.train_options.get("eval_every") or TrainConfig().eval_every,
            "train_options": ", ".join(f"{k}={v}" for k, v in cfg.train_options.items() if v is not None),
            "cpu_count": os.cpu_count(),
            # per host, the CPUs its workers ran on; None: placed by the kernel (not pinned, or loopback)
            "host_cpus": [list(host.cpus) for host in cluster.hosts] if emulated and cfg.pin_cpus else None,
            "command": cfg.command or f"gradzip compare --compressors {','.join(cfg.compressors)}",
            "target_loss": cfg.target_loss,
            "target_margin": cfg.target_margin,
            "repeats": cfg.repeats,
        }
        _clear_outputs(out)
        (out / SETUP_FILE).write_text(json.dumps(setup, indent=2) + "\n")
        for round_index in range(cfg.repeats):
            results: list[RunResult] = []
            for index, label in enumerate(entries):
                run_dir = run_folder(out, label, round_index)
                argv = train_command(
                    BASELINE if label == LIMIT else label, out_dir=run_dir, steps=cfg.steps, seed=cfg.seed,
                    collective_timeout_s=cfg.collective_timeout_s, no_exchange=label == LIMIT,
                    options=cfg.train_options, prefix=cfg.train_prefix, replica_size=cfg.ranks_per_host,
                )
                number = round_index * len(entries) + index + 1
                with EntryProgress(run_dir / "metrics.jsonl", f"[{number}/{total}] {label}", cfg.steps):
                    result = launch_run(label, argv, world_size=cfg.world_size, out_dir=run_dir, network=network,
                                        run_index=number - 1, timeout_s=cfg.timeout_s, link_changes=link_changes)  # fmt: skip
                if not cfg.keep_checkpoints:
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                results.append(result)
                row = compare_rows([result])[0][0]
                log(_progress_line(number, total, result, row))
            rounds.append(results)

    return write_outputs(out, rounds, setup, target_loss=cfg.target_loss, log=log)


def _clear_outputs(out: Path) -> None:
    """Remove what an earlier comparison wrote in ``out``: its runs, report, results and plots."""
    shutil.rmtree(out / "runs", ignore_errors=True)
    for name in (*report.FILES, SETUP_FILE):
        (out / name).unlink(missing_ok=True)


def write_outputs(out: Path, rounds: list[list[RunResult]], setup: dict[str, Any], *, target_loss: float | None,
                  log=print) -> list[dict[str, Any]]:  # fmt: skip
    """Rows, results.json, report.md and the plots from finished runs (one list of runs per
    round, rows in the same order); returns the rows."""
    margin = setup.get("target_margin", TARGET_MARGIN)
    per_round = [compare_rows(results, target_loss=target_loss, target_margin=margin) for results in rounds]
    target = per_round[0][1]
    rows = merge_repeats([r for r, _ in per_round]) if len(rounds) > 1 else per_round[0][0]
    report.write_results(out, rows)
    report.write_report(out, rows, setup, target)
    # the curves of the first round (losses are the same in every round; times differ a little)
    plots = report.write_plots(out, rounds[0], rows, setup, target["target_loss"])
    for line in report.summary_lines(rows, target["target_loss"]):
        log(line)
    log(f"wrote {out}/report.md (every figure), results.json, {', '.join(p.name for p in plots)}")
    return rows


def _finished_rounds(out: Path, setup: dict[str, Any], log) -> list[list[RunResult]]:
    """The runs of an earlier comparison: every round it finished, or, where it was stopped in its
    first round, the entries that round finished (said in a line).

    Raises:
        FileNotFoundError: if not one run finished.
    """
    entries, repeats = setup["entries"], setup.get("repeats", 1)
    finished = [[(run_folder(out, label, k) / RUN_FILE).exists() for label in entries] for k in range(repeats)]
    complete = [k for k in range(repeats) if all(finished[k])]
    if complete:
        if len(complete) < repeats:
            log(f"gradzip compare: {len(complete)} of {repeats} rounds finished; the report covers those")
        return [[load_run(run_folder(out, label, k)) for label in entries] for k in complete]
    done = [label for label, ok in zip(entries, finished[0]) if ok]
    if not done:
        raise FileNotFoundError(f"{out}: no run of the comparison finished, so there is nothing to report")
    log(f"gradzip compare: the comparison was stopped; the report covers the {len(done)} of {len(entries)} entries "
        f"that finished ({', '.join(done)})")
    setup["entries"], setup["repeats"] = done, 1
    return [[load_run(run_folder(out, label, 0)) for label in done]]


def _read_setup(path: Path) -> dict[str, Any]:
    """``setup.json`` of an earlier comparison, checked for what a rewrite reads from it.

    Raises:
        ValueError: naming the file, if it is not JSON or not a comparison's settings.
    """
    try:
        setup = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}): --report-only needs the folder of an earlier comparison") from None
    entries = setup.get("entries") if isinstance(setup, dict) else None
    repeats = setup.get("repeats", 1) if isinstance(setup, dict) else None
    if (not isinstance(entries, list) or not entries or not all(isinstance(e, str) and e for e in entries)
            or isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"{path} is not the settings of a comparison (an object with 'entries', a list of "
                         "names, and 'repeats', an integer >= 1)")
    return setup


def rewrite_report(out: str | Path, *, target_loss: float | None = None, target_margin: float | None = None,
                   log=print) -> list[dict[str, Any]]:
    """Write the outputs again from the runs an earlier comparison left in ``out`` (a new
    ``target_loss`` or ``target_margin`` (None: the comparison's own), or a newer report format),
    without running anything.

    Raises:
        FileNotFoundError: if ``out`` holds no finished comparison.
    """
    out = Path(out)
    setup_path = out / SETUP_FILE
    if not setup_path.exists():
        raise FileNotFoundError(f"{setup_path} not found: --report-only needs the folder of an earlier comparison")
    setup = _read_setup(setup_path)
    if target_loss is not None:
        check_number(target_loss, name="--target-loss", low=0, low_open=True, high=MAX_TARGET_LOSS)
    if target_margin is not None:
        check_number(target_margin, name="--target-margin", low=0, high=1)
        setup["target_margin"] = target_margin
    rounds = _finished_rounds(out, setup, log)
    # the Setup's command is the one that ran the runs; the report says what rewrote it
    given = [f"--{name} {value:g}" for name, value in (("target-loss", target_loss), ("target-margin", target_margin))
             if value is not None]
    setup["report_command"] = " ".join(["gradzip compare --report-only", *given, "--out", str(out)])
    if target_loss is None:  # the comparison's own --target-loss, where it gave one
        target_loss = setup.get("target_loss")
    return write_outputs(out, rounds, setup, target_loss=target_loss, log=log)
