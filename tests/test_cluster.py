"""The emulated cluster: qdiscs in place, bytes counted on the wire, nothing left behind.

Needs root and network namespaces (CI has both); elsewhere these tests skip with the reason.
Run as a script, this file is the worker that the byte-count test starts in each host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradzip.lab.cluster import (
    Cluster,
    ClusterError,
    clean,
    format_bandwidth,
    leftovers,
    parse_bandwidth,
    support_problem,
)
from gradzip.lab.cluster.netns import burst_bytes, host_cpus, list_namespaces
from gradzip.lab.cluster.schedule import LinkSchedule, RateChange, format_link_schedule, parse_link_schedule

PROBLEM = support_problem() if sys.platform.startswith("linux") else "emulated hosts need Linux"
needs_netns = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

ALLREDUCE_NUMEL = 2_000_000  # 8 MB of fp32 per rank: large against the fixed handshake traffic
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_bandwidth():
    assert parse_bandwidth("100mbit") == 100_000_000
    assert parse_bandwidth("1gbit") == 1_000_000_000
    assert parse_bandwidth("20Mbit") == 20_000_000
    assert parse_bandwidth("1.5mbit") == 1_500_000
    assert parse_bandwidth(64_000) == 64_000
    assert format_bandwidth(20_000_000) == "20mbit"
    assert format_bandwidth(1_000_000_000) == "1gbit"
    # decimal rates exactly (float once read 1.001mbit as 1000999 bit/s)
    assert all(parse_bandwidth(f"{k / 1000:.3f}mbit") == k * 1000 for k in range(64, 100_000, 7))
    assert format_bandwidth(parse_bandwidth("1.001mbit")) == "1001kbit"
    for bad in ("fast", "100 mbyte", "-1mbit", "10bit", 1e8, True, None):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_bandwidth(bad)
    with pytest.raises(ValueError, match="num_hosts"):
        Cluster(0)
    # the fastest rate taken still has a tbf bucket tc can hold (a 32-bit byte count); one past it is refused
    assert parse_bandwidth("10000gbit") == 10**13 and burst_bytes(10**13) == 10**13 // 8000 < 2**32
    for fast in ("10001gbit", "40000gbit", "1000000gbit"):
        with pytest.raises(ValueError, match="between 64kbit and 10000gbit"):
            parse_bandwidth(fast)


def test_parse_link_schedule():
    changes = parse_link_schedule("40:20mbit, 80:1gbit")
    assert changes == [RateChange(40, 20_000_000), RateChange(80, 1_000_000_000)]
    assert format_link_schedule(changes) == "40:20mbit,80:1gbit"
    for bad, words in (("40-20mbit", "STEP:RATE"), ("", "STEP:RATE"), ("0:20mbit", "steps must be >= 1"),
                       ("40:20mbit,40:1gbit", "steps must increase"), ("40:fast", "bandwidth")):
        with pytest.raises(ValueError, match=words) as info:
            parse_link_schedule(bad)
        assert "--link-schedule" in str(info.value)


def test_link_schedule_changes_the_rate_once_the_step_before_is_recorded(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    written: list[int] = []  # steps whose line is complete in the file
    calls: list[tuple[int, int]] = []  # (rate, last step written when it was set)
    # a line's end and its entry in ``written`` happen under this lock, so the recorder never
    # reads ``written`` behind a line the schedule has already seen in the file
    line_end = threading.Lock()

    class Recorder:
        def set_bandwidth(self, bits):
            with line_end:
                calls.append((bits, written[-1] if written else -1))

    with LinkSchedule(Recorder(), parse_link_schedule("3:20mbit,5:1gbit"), metrics, poll_s=0.001) as schedule:
        with open(metrics, "w", buffering=1) as f:
            for step in range(8):
                line = json.dumps({"step": step, "loss": 1.0})
                f.write(line[:5])  # a line half written is not read as a step
                f.flush()
                time.sleep(0.005)
                with line_end:
                    f.write(line[5:] + "\n")
                    written.append(step)
                time.sleep(0.005)
        deadline = time.monotonic() + 10
        while len(schedule.applied) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert schedule.error is None
    assert [rate for rate, _ in calls] == [20_000_000, 1_000_000_000]
    # never before step STEP - 1 is recorded, and each records what it saw
    for (_, seen), applied in zip(calls, schedule.applied):
        assert seen >= applied.change.step - 1 and applied.recorded_before >= applied.change.step - 1
        assert applied.first_step == applied.recorded_before + 1 <= seen + 1


def _ours(cluster_or_suffix) -> list[str]:
    suffix = getattr(cluster_or_suffix, "suffix", cluster_or_suffix)
    return [n for n in list_namespaces() if f"-{suffix}-" in n]


def _switch_ports(cluster: Cluster) -> list[str]:
    """``tc qdisc show`` of the switch port towards each host, as tc prints it."""
    return [
        subprocess.run(
            ["tc", "-n", cluster.switch, "qdisc", "show", "dev", f"h{host.index}"], capture_output=True, text=True,
            check=True,
        ).stdout
        for host in cluster.hosts
    ]


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.e2e
@needs_netns
def test_two_hosts_qdisc_and_allreduce_bytes():
    with Cluster(2, "100mbit") as cluster:
        assert sorted(_ours(cluster)) == sorted(cluster.names)
        # tbf on each host's egress and on the switch port towards it (its ingress), 12.5 MB/s
        # and a bucket of 1 ms at the rate (12.5 kB; tc stores it in its own time units, so the
        # bytes it reports back may differ by one)
        for qdisc in cluster.qdiscs():
            assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] == 100_000_000 // 8
            assert abs(qdisc["options"]["burst"] - 12_500) <= 1, qdisc
        for port in _switch_ports(cluster):
            assert "tbf" in port and "rate 100Mbit" in port

        before = cluster.tx_bytes()
        procs = []
        for host in cluster.hosts:
            # The script runs by path, so the package comes from the checkout even when not installed.
            pythonpath = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, GLOO_SOCKET_IFNAME=host.ifname, TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=pythonpath)
            argv = [sys.executable, __file__, "allreduce", str(host.index), cluster.hosts[0].address]
            procs.append(cluster.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=90)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs
        sent = [a - b for a, b in zip(cluster.tx_bytes(), before)]

        # a new rate while the cluster runs: every host's eth0 and every switch port
        cluster.set_bandwidth("20mbit")
        assert all(q["kind"] == "tbf" and q["options"]["rate"] == 20_000_000 // 8 for q in cluster.qdiscs())
        # 1 ms at 20 Mbit/s is 2.5 kB, under the 4 KiB floor: a few full-size frames, no more
        assert all(abs(q["options"]["burst"] - 4096) <= 1 for q in cluster.qdiscs()), cluster.qdiscs()
        for port in _switch_ports(cluster):
            assert "tbf" in port and "rate 20Mbit" in port
        with pytest.raises(ValueError, match="bandwidth"):
            cluster.set_bandwidth("fast")

    # all_reduce over 2 ranks (reduce-scatter + all-gather, or a direct exchange) puts exactly
    # numel * 4 bytes of tensor data on each rank's link. On top: Ethernet/IP/TCP headers of at
    # most 66 bytes per 1448-byte segment sent (<= 4.6 %), ACKs for as many bytes received (at
    # most one 66-byte ACK per segment, <= 4.6 %), and a fixed part for the rendezvous,
    # connection set-up, the barrier and shutdown (a few kB; bounded by 256 KiB).
    payload = ALLREDUCE_NUMEL * 4
    for rank, nbytes in enumerate(sent):
        assert payload <= nbytes <= 1.10 * payload + 256 * 1024, (rank, nbytes, payload)
    assert all(o.strip().endswith("sum=3.0") for o in outputs), outputs
    assert _ours(cluster) == []
    with pytest.raises(ClusterError, match="running cluster"):
        cluster.set_bandwidth("1gbit")


@pytest.mark.parametrize("num_hosts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("num_cpus", [1, 2, 3, 8, 16])
def test_host_cpus_give_each_host_a_fair_share(num_hosts, num_cpus):
    available = [10 + 3 * c for c in range(num_cpus)][::-1]  # any CPU numbers, in any order
    shares = [host_cpus(i, num_hosts, available) for i in range(num_hosts)]
    held = [c for share in shares for c in share]
    assert set(held) <= set(available) and all(shares)
    if num_cpus >= num_hosts:  # disjoint, every CPU used, sizes within one of each other
        assert sorted(held) == sorted(available)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:  # one CPU each; every CPU carries the same number of hosts, give or take one
        assert all(len(share) == 1 for share in shares)
        loads = [held.count(c) for c in available]
        assert sum(loads) == num_hosts and max(loads) - min(loads) <= 1


def test_host_cpus_refusals_and_the_pinned_command():
    with pytest.raises(ValueError, match=r"index must be in \[0, 2\); got 2"):
        host_cpus(2, 2, [0, 1])
    with pytest.raises(ValueError, match="available must name at least one CPU"):
        host_cpus(0, 2, [])
    with pytest.raises(ValueError, match=r"num_hosts must be >= 1; got 0"):
        host_cpus(0, 0, [0])
    for bad in (0.5, True, "0"):
        with pytest.raises(ValueError, match="index must be an integer"):
            host_cpus(bad, 2, [0, 1])
    for bad in ([-1, 0], ["0", "1"], [0.0]):
        with pytest.raises(ValueError, match="available must be CPU numbers"):
            host_cpus(0, 2, bad)
    # a CPU named twice counts once: two hosts on [0, 0, 1] get one CPU each, not one and two
    assert [host_cpus(i, 2, [0, 0, 1]) for i in range(2)] == [(0,), (1,)]
    assert [host_cpus(i, 2, [3, 3]) for i in range(2)] == [(3,), (3,)]
    # no namespaces are made until start(): the commands can be read without root
    pinned = Cluster(3, "20mbit", pin_cpus=True)
    cpus = sorted(os.sched_getaffinity(0))
    for host in pinned.hosts:
        assert host.cpus == host_cpus(host.index, 3, cpus)
        assert pinned.command(host, ["python", "x.py"]) == [
            "ip", "netns", "exec", host.netns, "taskset", "-c", ",".join(map(str, host.cpus)), "python", "x.py"]  # fmt: skip
    free = Cluster(2, "20mbit")
    assert free.hosts[0].cpus == () and free.command(free.hosts[0], ["x"]) == ["ip", "netns", "exec", free.hosts[0].netns, "x"]


def test_pinned_hosts_need_taskset(monkeypatch):
    import gradzip.lab.cluster.netns as netns

    real = netns.shutil.which
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "taskset" else real(tool))
    # refused before any namespace is made (so no root is needed to see it)
    with pytest.raises(ClusterError, match=r"^emulated hosts need the 'taskset' command \(util-linux\)"):
        Cluster(2, "20mbit", pin_cpus=True).start()
    if PROBLEM is None:  # where hosts can be made, unpinned ones do without taskset
        assert support_problem() is None
        assert "'taskset' command" in support_problem(pin_cpus=True)


@pytest.mark.e2e
@pytest.mark.skipif(PROBLEM is not None or support_problem(pin_cpus=True) is not None,
                    reason=PROBLEM or str(support_problem(pin_cpus=True)))
def test_pinned_hosts_run_on_their_cpus():
    script = "import os; print(sorted(os.sched_getaffinity(0)))"
    cpus = sorted(os.sched_getaffinity(0))
    with Cluster(3, "1gbit", pin_cpus=True) as cluster:
        seen = [cluster.run(h, [sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
                for h in cluster.hosts]  # fmt: skip
    # 3 hosts: with 3 CPUs or more, every third CPU each; with 2, hosts 0 and 2 share the first
    expected = [cpus[i::3] for i in range(3)] if len(cpus) >= 3 else [[cpus[i % len(cpus)]] for i in range(3)]
    assert [json.loads(line) for line in seen] == expected


@pytest.mark.e2e
@needs_netns
def test_nothing_left_after_exit_and_killed_worker():
    with Cluster(2, "20mbit") as cluster:
        hung = cluster.popen(cluster.hosts[0], ["sleep", "300"])
        killed = cluster.popen(cluster.hosts[1], ["sleep", "300"])
        time.sleep(0.2)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert len(_ours(cluster)) == 3
    # the worker still running at exit was killed with its host; the namespaces are gone
    assert hung.poll() is not None and _dead(hung.pid)
    assert _ours(cluster) == []

    with pytest.raises(RuntimeError, match="boom"), Cluster(2, "20mbit") as cluster:
        raise RuntimeError("boom")
    assert _ours(cluster) == []


_OWNER = """
import sys, time
from gradzip.lab.cluster import Cluster
with Cluster(2, "20mbit") as cluster:
    worker = cluster.popen(cluster.hosts[1], ["sleep", "300"])
    print(cluster.suffix, worker.pid, flush=True)
    time.sleep(300)
"""


def _start_owner() -> tuple[subprocess.Popen, str, int]:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, env=env)
    suffix, worker_pid = owner.stdout.readline().split()
    return owner, suffix, int(worker_pid)


@pytest.mark.e2e
@needs_netns
def test_owner_terminated_or_killed():
    # SIGTERM: the owner's handler unwinds its `with` block, which removes everything
    owner, suffix, worker_pid = _start_owner()
    assert leftovers()[suffix]["owner_alive"]
    assert clean()[1] and len(_ours(suffix)) == 3  # clean leaves a running owner's cluster alone
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == 128 + signal.SIGTERM
    assert _ours(suffix) == [] and _dead(worker_pid)

    # SIGKILL: nothing runs in the owner; `gradzip cluster clean` removes what is left
    owner, suffix, worker_pid = _start_owner()
    owner.kill()
    owner.wait()
    assert len(_ours(suffix)) == 3 and not leftovers()[suffix]["owner_alive"]
    removed, _ = clean()
    assert sorted(removed) == sorted(f"gz-{suffix}-{r}" for r in ("h0", "h1", "sw"))
    assert _ours(suffix) == [] and _dead(worker_pid)


def _allreduce_worker(rank: int, master_addr: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{master_addr}:29517", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    x = torch.full((ALLREDUCE_NUMEL,), float(rank + 1))
    dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()
    assert torch.all(x == 3.0)
    print(f"sum={x[0].item()}")


if __name__ == "__main__" and sys.argv[1] == "allreduce":
    _allreduce_worker(int(sys.argv[2]), sys.argv[3])
