"""Start one run of the main job: one ``gradzip train`` process per rank, on emulated hosts or
on loopback, with a wall-clock limit, reading the bytes each host put on its link.

Each rank is started the way torchrun would start it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment), so ``gradzip train`` runs just that rank.
On emulated hosts rank ``r`` runs in host ``r`` with ``GLOO_SOCKET_IFNAME`` set to its interface
and the rendezvous store on host 0; there a run may change the link's rate at given steps
(:class:`~gradzip.lab.cluster.schedule.LinkSchedule`), starting from the cluster's own rate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradzip
from gradzip.lab.cluster import Cluster, format_bandwidth
from gradzip.lab.cluster.schedule import LinkSchedule, RateChange

RUN_FILE = "run.json"  # how the run ended and its interface bytes, beside rank 0's files
FAIL_GRACE_S = 10.0  # after one rank fails, how long the others get to exit before being killed
_PACKAGE_ROOT = str(Path(gradzip.__file__).resolve().parent.parent)


@dataclass
class RunResult:
    """What one run left: its records and summary (rank 0's files) and how it ended.

    ``status`` is ``ok``, ``timeout`` (stopped at the wall-clock limit, or a collective timed
    out) or ``failed``; ``error`` holds the first failing rank's last log line. ``tx_bytes``
    has one entry per host (bytes its interface sent during the run), None on loopback.
    ``link_changes`` lists the link rate changes made during the run (see :func:`applied_changes`),
    None when the run had no link schedule.
    """

    label: str
    out_dir: Path
    status: str = "ok"
    error: str | None = None
    process_wall_s: float = 0.0
    tx_bytes: list[int] | None = None
    link_changes: list[dict[str, Any]] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None


class Loopback:
    """All ranks on this machine's loopback interface; the bytes on the wire are not counted
    (other processes share ``lo``)."""

    kind = "loopback"
    master_addr = "127.0.0.1"
    ifname = "lo"

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def popen(self, rank: int, argv: Sequence[str], *, env: dict[str, str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def port(self, run_index: int) -> int:
        from gradzip.testing import free_port

        return free_port()

    def tx_bytes(self) -> list[int] | None:
        return None

    def kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
                except ProcessLookupError:
                    pass
            proc.wait()
        self._procs.clear()


class Emulated:
    """Rank ``r`` on host ``r // ranks_per_host`` of ``cluster``. Ranks on one host share its
    namespace: their traffic to each other stays inside it (the kernel's loopback path, no
    ``tbf``), as on a real host's fast links; only traffic between hosts crosses the limited link."""

    kind = "emulated"

    def __init__(self, cluster: Cluster, ranks_per_host: int = 1) -> None:
        self.cluster = cluster
        self.ranks_per_host = ranks_per_host
        self.master_addr = cluster.hosts[0].address
        self.ifname = cluster.hosts[0].ifname
        self.bandwidth_bits = cluster.bandwidth_bits  # every scheduled run starts from this rate

    def link_schedule(self, changes: Sequence[RateChange], metrics: Path) -> LinkSchedule:
        """The link set back to the cluster's own rate (an earlier run's schedule may have changed
        it), and a schedule of ``changes`` following ``metrics``, to enter around the run."""
        self.cluster.set_bandwidth(self.bandwidth_bits)
        return LinkSchedule(self.cluster, list(changes), metrics)

    def popen(self, rank: int, argv: Sequence[str], *, env: dict[str, str], **kwargs) -> subprocess.Popen:
        return self.cluster.popen(self.cluster.hosts[rank // self.ranks_per_host], argv, env=env, **kwargs)

    def port(self, run_index: int) -> int:
        # The hosts are fresh namespaces: any port is free; a new one per run avoids TIME_WAIT.
        return 29500 + run_index

    def tx_bytes(self) -> list[int] | None:
        return self.cluster.tx_bytes()

    def kill_all(self) -> None:
        self.cluster.kill_processes()


def _rank_env(rank: int, world_size: int, network, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(world_size),
        # every rank shares this machine's cores, whichever host it runs in
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=network.master_addr,
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=network.ifname,
        PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p),
    )
    return env


def applied_changes(schedule: LinkSchedule) -> list[dict[str, Any]]:
    """The changes ``schedule`` made, as saved in ``run.json`` and ``results.json``: ``step`` and
    ``rate`` asked for, the last step recorded before the change began and after it ended
    (``recorded_before``, ``recorded_after``; the first step at the new rate is one after one of
    them), and ``seconds`` since the run started."""
    return [
        {"step": a.change.step, "rate": format_bandwidth(a.change.bits_per_s), "recorded_before": a.recorded_before,
         "recorded_after": a.recorded_after, "seconds": round(a.seconds, 3)}
        for a in schedule.applied
    ]  # fmt: skip


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def read_records(out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rank 0's ``metrics.jsonl`` records (complete lines only) and ``summary.json`` (or None)."""
    records = []
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut off by a killed run
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return records, summary


def launch_run(
    label: str,
    train_argv: Sequence[str],
    *,
    world_size: int,
    out_dir: Path,
    network,
    run_index: int,
    timeout_s: float,
    link_changes: Sequence[RateChange] = (),
) -> RunResult:
    """Run ``train_argv`` (a command that honours the torchrun environment) on every rank.

    Args:
        label: the row's name in the results (the compressor spec, or ``limit``).
        train_argv: the command of one rank; ``--out`` must already point at ``out_dir``.
        network: :class:`Loopback` or :class:`Emulated`.
        run_index: distinct per run of one comparison (picks the rendezvous port).
        timeout_s: wall-clock limit of the run; past it every rank is killed.
        link_changes: rate changes of the link at given steps (:class:`Emulated` only), made as
            rank 0's ``metrics.jsonl`` reaches them, from the cluster's own rate; a change that
            fails (``tc``) fails the run.

    Returns:
        the :class:`RunResult`; never raises for a failing or hanging run.

    Raises:
        ValueError: for ``link_changes`` on a network that is not :class:`Emulated`.
    """
    if link_changes and not isinstance(network, Emulated):
        raise ValueError("a link schedule needs emulated hosts (--network emulated)")
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    port = network.port(run_index)
    result = RunResult(label, out_dir)
    before = network.tx_bytes()
    schedule = network.link_schedule(link_changes, out_dir / "metrics.jsonl") if link_changes else nullcontext()
    start = time.monotonic()
    procs, log_files = [], []
    with schedule:
        try:
            for rank in range(world_size):
                log = open(logs / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
                log_files.append(log)
                env = _rank_env(rank, world_size, network, port)
                procs.append(network.popen(rank, train_argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            first_failure: tuple[int, float] | None = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now - start > timeout_s:
                    result.status = "timeout"
                    result.error = f"stopped after {timeout_s:g} s (wall-clock limit of the run)"
                    break
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = (failed[0], now)
                if first_failure is not None and now - first_failure[1] > FAIL_GRACE_S:
                    break
                time.sleep(0.2)
        finally:
            network.kill_all()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for log in log_files:
                log.close()
    result.process_wall_s = time.monotonic() - start
    after = network.tx_bytes()
    if before is not None and after is not None:
        result.tx_bytes = [a - b for a, b in zip(after, before)]
    if result.status == "ok":
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            # the rank that failed first is the one whose error explains the others'
            rank = first_failure[0] if first_failure is not None else failed[0]
            result.error = f"rank {rank}: {_death(procs[rank].returncode) or _last_line(logs / f'rank{rank}.log')}"
            result.status = "timeout" if "timed out" in result.error.lower() else "failed"
    if link_changes:
        result.link_changes = applied_changes(schedule)
        if schedule.error is not None and result.status == "ok":  # the run did not see the link asked for
            result.status, result.error = "failed", f"link schedule: {schedule.error}"
    result.records, result.summary = read_records(out_dir)
    if result.status == "ok" and result.summary is None:
        result.status, result.error = "failed", "rank 0 wrote no summary.json"
    (out_dir / RUN_FILE).write_text(json.dumps(
        {"label": label, "status": result.status, "error": result.error, "process_wall_s": result.process_wall_s,
         "tx_bytes": result.tx_bytes, "link_changes": result.link_changes}, indent=2) + "\n")  # fmt: skip
    return result


def _death(returncode: int) -> str | None:
    """What a rank's exit status says when a signal ended it (None for an exit of its own): its
    log's last line then says nothing of the cause."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGKILL:
        return f"killed by {name} (the kernel's out-of-memory killer, if nothing else sent it: see dmesg)"
    return f"killed by {name}"


def load_run(out_dir: Path) -> RunResult:
    """A finished run as :func:`launch_run` left it in ``out_dir``.

    Raises:
        FileNotFoundError: if ``out_dir`` holds no finished run.
    """
    saved = json.loads((out_dir / RUN_FILE).read_text())
    result = RunResult(saved["label"], out_dir, saved["status"], saved["error"], saved["process_wall_s"],
                       saved["tx_bytes"], saved.get("link_changes"))  # fmt: skip
    result.records, result.summary = read_records(out_dir)
    return result


TRAIN_PREFIX = (sys.executable, "-m", "gradzip", "train")


def train_command(
    compressor: str, *, out_dir: Path, steps: int, seed: int, collective_timeout_s: float, no_exchange: bool,
    options: dict[str, Any], prefix: Sequence[str] = TRAIN_PREFIX, replica_size: int = 1,
) -> list[str]:  # fmt: skip
    """The argv of one rank of ``gradzip train`` (``prefix`` runs it); ``options`` maps option
    names (``batch_size``) to values, None meaning the train default. ``compressor`` may name an
    optimizer instead (``onebit-adam``, see :func:`gradzip.lab.train.optimizers.names_optimizer`) or
    DiLoCo (``diloco:sync_every=20+uniform:bits=8``, see :func:`gradzip.lab.train.outer.split_entry`),
    run with ``replica_size`` ranks per replica."""
    from gradzip.lab.train.optimizers import names_optimizer, split_optimizer_entry
    from gradzip.lab.train.outer import names_outer, split_entry

    if names_optimizer(compressor):
        # an optimizer that owns its exchange (onebit-adam) runs behind the uncompressed hook;
        # local-adamw+CODEC sends its update through CODEC
        optimizer, codec = split_optimizer_entry(compressor)
        exchange = ["--optimizer", optimizer, "--compressor", codec]
    elif names_outer(compressor):  # one rank per replica: the outer exchange is the only one
        outer, codec = split_entry(compressor)
        exchange = ["--outer", outer, "--outer-compressor", codec, "--compressor", "none"]
        if replica_size > 1:  # a replica per host: dense all_reduce inside it, DiLoCo between hosts
            exchange += ["--replica-size", str(replica_size)]
    else:
        exchange = ["--compressor", compressor]
    argv = [*prefix, *exchange, "--steps", str(steps), "--seed", str(seed), "--out", str(out_dir),
            "--timeout-s", f"{collective_timeout_s:g}", "--quiet"]  # fmt: skip
    if no_exchange:
        argv.append("--no-exchange")
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
