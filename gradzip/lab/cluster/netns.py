"""Emulated hosts on a slow link: Linux network namespaces, veth pairs, a bridge and ``tbf``.

Layout of one cluster (suffix ``S`` = owner pid as 6 hex digits + 2 random hex digits)::

    netns gz-S-h0  eth0 10.77.0.1/24 --veth-- h0 ┐
    netns gz-S-h1  eth0 10.77.0.2/24 --veth-- h1 ├ br0   (in netns gz-S-sw)
    ...                                          ┘

Every host's ``eth0`` has a ``tbf`` qdisc at ``bandwidth`` (its egress); the switch-side end of
each veth has one too (its ingress), so each host sees a full-duplex link of that rate, like a
NIC on a switch port; :meth:`Cluster.set_bandwidth` changes all of them in place while the
cluster runs. Each ``tbf`` lets through a burst of 1 ms at the rate, at least 4 KiB
(:func:`burst_bytes`), so an exchange gets the rate it is set to, not more. ``netem`` is not
available in the kernels this runs on, so latency is not emulated. Nothing is created in the
root namespace: the hosts reach only each other, and two clusters never clash (same addresses,
different namespaces). Deleting the switch namespace destroys every veth pair.

Hosts may be pinned to CPUs (``pin_cpus``): each host's processes then run on their own share of
this machine's cores, through ``taskset`` (:func:`host_cpus`), as real hosts do not take each
other's cores.

Needs root, ``ip`` and ``tc`` (iproute2), and ``taskset`` (util-linux) for pinned hosts. Standard
library only.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gradzip.compressors.values import shown

PREFIX = "gz-"
SUBNET = "10.77.0"  # 10.77.0.1 .. 10.77.0.N; private, and only inside the cluster's namespaces
IFNAME = "eth0"  # the host's interface inside its namespace (GLOO_SOCKET_IFNAME)
MAX_HOSTS = 250
_NAME = re.compile(r"^gz-(?P<suffix>(?P<pid>[0-9a-f]{6})[0-9a-f]{2})-(?P<role>sw|h\d+)$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
# The token bucket: 1 ms at the rate, so that high rates are not capped by the timer
# granularity, and at least a few full-size frames (below one, tbf drops every packet). Not
# more: a full bucket passes its bytes at the veth's speed, so a larger one makes every exchange
# that starts on an idle link faster than the rate (a 32 KiB bucket per stage, at 20 Mbit/s,
# carried a 120 kB exchange at 26 Mbit/s).
_MIN_BURST_BYTES = 4 * 1024
_QUEUE_LATENCY_MS = 50  # tbf queue limit, as the time the queue takes to drain at the rate


class ClusterError(RuntimeError):
    """The cluster could not be created (not root, no netns support, a failed ``ip``/``tc``)."""


#: the fastest link rate taken, bits per second: 10 Tbit/s, well past any NIC, and low enough that
#: the ``tbf`` bucket (1 ms at the rate, :func:`burst_bytes`) fits tc's 32-bit byte count (past
#: about 34 Tbit/s it does not, and tc refuses the link)
MAX_BANDWIDTH = 10**13


def parse_bandwidth(text: str | int) -> int:
    """Bits per second from ``100mbit``, ``1gbit``, ``500kbit`` or a plain number of bit/s.

    Raises:
        ValueError: naming ``bandwidth`` for a malformed or non-positive value.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = (re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?(?:/s)?\s*", text.lower(), re.ASCII)
                 if isinstance(text, str) else None)
        if not match:
            raise ValueError(f"bandwidth must look like 20mbit, 100mbit or 1gbit; got {text!r}")
        # exact decimal arithmetic: 1.001mbit is 1,001,000 bit/s, not float's 1,000,999
        rate = Fraction(match.group(1)) * _UNITS[match.group(2)]
        value = round(rate) if rate <= MAX_BANDWIDTH else MAX_BANDWIDTH + 1
    if not 64_000 <= value <= MAX_BANDWIDTH:
        raise ValueError(f"bandwidth must be between 64kbit and {MAX_BANDWIDTH // 10**9}gbit; got {shown(text)}")
    return value


def format_bandwidth(bits_per_s: int) -> str:
    """``100000000`` -> ``100mbit`` (the form ``tc`` and the CLI accept)."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


def _sh(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def _missing_tool(pin_cpus: bool) -> str | None:
    """One line naming the first command emulated hosts need that is not installed, or None."""
    tools = [("ip", "iproute2"), ("tc", "iproute2")] + ([("taskset", "util-linux")] if pin_cpus else [])
    for tool, package in tools:
        if shutil.which(tool) is None:
            return f"emulated hosts need the '{tool}' command ({package}), which is not installed"
    return None


def support_problem(*, pin_cpus: bool = False) -> str | None:
    """One line saying why emulated hosts cannot be made here, or None when they can.

    Checks root, the ``ip`` and ``tc`` tools (and ``taskset`` for hosts pinned to CPUs), and
    creates and deletes a namespace holding a veth pair with a ``tbf`` qdisc.
    """
    if os.geteuid() != 0:
        return f"emulated hosts need root (network namespaces and tc); running as uid {os.geteuid()}"
    missing = _missing_tool(pin_cpus)
    if missing:
        return missing
    probe = f"{PREFIX}{os.getpid():06x}{secrets.token_hex(1)}-sw"
    try:
        _sh(["ip", "netns", "add", probe])
        try:
            _sh(["ip", "-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"])
            _sh(["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", *_tbf_args(10**8)])
        finally:
            _sh(["ip", "netns", "delete", probe], check=False)
    except ClusterError as exc:
        return f"network namespaces with veth and tbf are not available here ({exc})"
    return None


def burst_bytes(bits_per_s: int) -> int:
    """The ``tbf`` bucket of a link of ``bits_per_s``: 1 ms at the rate, at least 4 KiB."""
    return max(_MIN_BURST_BYTES, bits_per_s // 8 // 1000)


def _tbf_args(bits_per_s: int) -> list[str]:
    return ["rate", f"{bits_per_s}bit", "burst", str(burst_bytes(bits_per_s)), "latency", f"{_QUEUE_LATENCY_MS}ms"]


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its address on the cluster's subnet, its interface."""

    index: int
    netns: str
    address: str
    ifname: str = IFNAME
    cpus: tuple[int, ...] = ()  # what its processes run on (``taskset``); empty: any CPU


def host_cpus(index: int, num_hosts: int, available: Sequence[int]) -> tuple[int, ...]:
    """The CPUs of host ``index`` of ``num_hosts`` when hosts are pinned, from ``available``.

    With at least one CPU per host, every ``num_hosts``-th CPU from the ``index``-th (disjoint
    shares, differing by one CPU at most); with fewer, the single CPU ``index % len(available)``,
    which the hosts placed there share. When the hosts do not divide evenly among the CPUs, some
    CPUs carry one host more than others (3 hosts on 2 CPUs: two share one, the third has the
    other alone), and a synchronous job runs at the pace of the shared ones. Real hosts do not
    take each other's cores; on a machine with fewer cores than workers, leaving placement to
    the kernel gave one of 4 workers on 2 cores 9% more CPU than the others, and a synchronous
    job then waits for the slower three. A CPU named twice in ``available`` counts once.

    Raises:
        ValueError: if ``num_hosts`` is not an integer >= 1, ``index`` not an integer in
            ``[0, num_hosts)``, or ``available`` is empty or names something other than CPU
            numbers (integers >= 0).
    """
    for name, value in (("num_hosts", num_hosts), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer; got {value!r}")
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1; got {num_hosts}")
    if not 0 <= index < num_hosts:
        raise ValueError(f"index must be in [0, {num_hosts}); got {index}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in available):
        raise ValueError(f"available must be CPU numbers (integers >= 0); got {list(available)!r}")
    cpus = sorted(set(available))
    if not cpus:
        raise ValueError("available must name at least one CPU")
    if len(cpus) >= num_hosts:
        return tuple(cpus[index::num_hosts])
    return (cpus[index % len(cpus)],)


class _Terminated(SystemExit):
    """Raised in the main thread on SIGTERM/SIGHUP so that ``with`` blocks unwind and clean up."""


class Cluster:
    """``num_hosts`` emulated hosts joined by a switch, each link limited to ``bandwidth``.

    Use as a context manager; everything is removed on exit, on Ctrl-C, on SIGTERM/SIGHUP (while
    the ``with`` block runs in the main thread) and at interpreter exit. After a hard kill of the
    owner, :func:`clean` (``gradzip cluster clean``) removes what is left.

        with Cluster(2, "100mbit") as cluster:
            proc = cluster.popen(cluster.hosts[1], ["python", "worker.py"])
            before = cluster.tx_bytes()
            ...

    Args:
        num_hosts: 1 to 250.
        bandwidth: link rate in each direction, ``100mbit``, ``1gbit`` or bit/s.
        pin_cpus: run each host's processes on its own share of this process's CPUs
            (:func:`host_cpus`, through ``taskset``), as real hosts have their own; False lets
            the kernel place them anywhere.

    Raises:
        ValueError: for a bad ``num_hosts`` or ``bandwidth``.
        ClusterError: from :meth:`start` when the hosts cannot be made (see :func:`support_problem`).
    """

    def __init__(self, num_hosts: int, bandwidth: str | int = "100mbit", *, pin_cpus: bool = False) -> None:
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {MAX_HOSTS}]; got {num_hosts}")
        self.bandwidth_bits = parse_bandwidth(bandwidth)
        self.suffix = f"{os.getpid():06x}{secrets.token_hex(1)}"
        self.switch = f"{PREFIX}{self.suffix}-sw"
        available = list(os.sched_getaffinity(0)) if pin_cpus else []
        self.hosts = [
            Host(i, f"{PREFIX}{self.suffix}-h{i}", f"{SUBNET}.{i + 1}",
                 cpus=host_cpus(i, num_hosts, available) if pin_cpus else ())
            for i in range(num_hosts)
        ]
        self._created: list[str] = []
        self._popened: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._closed = False

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Create the namespaces, links and qdiscs. On failure removes what it made and raises
        :class:`ClusterError`."""
        missing = _missing_tool(any(host.cpus for host in self.hosts))
        if missing:
            raise ClusterError(missing)
        atexit.register(self.close)
        try:
            self._netns_add(self.switch)
            _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            self._quiet_namespace(self.switch)
            _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            tbf = _tbf_args(self.bandwidth_bits)
            for host in self.hosts:
                port = f"h{host.index}"
                self._netns_add(host.netns)
                self._quiet_namespace(host.netns)
                _sh(["ip", "link", "add", "name", port, "netns", self.switch, "type", "veth",
                     "peer", "name", host.ifname, "netns", host.netns])  # fmt: skip
                _sh(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
                _sh(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", "tbf", *tbf])
                _sh(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname])
                _sh(["ip", "-n", host.netns, "link", "set", host.ifname, "up"])
                _sh(["ip", "-n", host.netns, "link", "set", "lo", "up"])
                _sh(["tc", "-n", host.netns, "qdisc", "add", "dev", host.ifname, "root", "tbf", *tbf])
        except BaseException:
            self.close()
            raise
        return self

    def _netns_add(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._created.append(name)

    @staticmethod
    def _quiet_namespace(netns: str) -> None:
        # IPv6 neighbour discovery and MLD would add packets to tx_bytes that no worker sent.
        _sh(["ip", "netns", "exec", netns, "sysctl", "-q", "-w",
             "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"], check=False)  # fmt: skip

    def close(self) -> None:
        """Kill every process in the hosts, then delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        hosts_first = [n for n in self._created if n != self.switch] + [n for n in self._created if n == self.switch]
        _remove_namespaces(hosts_first)
        for proc in self._popened:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._created.clear()

    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            return self.start()
        except BaseException:
            self._restore_handlers()
            raise

    def __exit__(self, *exc) -> None:
        # A second Ctrl-C or SIGTERM must not interrupt the teardown half way.
        masked = {}
        if threading.current_thread() is threading.main_thread():
            masked = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.close()
        finally:
            for sig, handler in masked.items():
                signal.signal(sig, handler)
            self._restore_handlers()

    def _on_signal(self, signum: int, frame) -> None:
        raise _Terminated(128 + signum)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def set_bandwidth(self, bandwidth: str | int) -> None:
        """Change every link's rate to ``bandwidth`` while the cluster runs: the ``tbf`` of each
        host's ``eth0`` and of each switch port is changed in place (``tc qdisc change``), so
        connections stay up and packets already queued are kept; a run in progress sees the new
        rate from its next packets on. Host by host, so for a moment links differ.

        Raises:
            ValueError: for a malformed ``bandwidth`` (see :func:`parse_bandwidth`).
            ClusterError: if the cluster is not running or ``tc`` fails.
        """
        bits = parse_bandwidth(bandwidth)
        if self._closed or not self._created:
            raise ClusterError("set_bandwidth needs a running cluster (inside its with block)")
        tbf = _tbf_args(bits)
        for host in self.hosts:
            _sh(["tc", "-n", host.netns, "qdisc", "change", "dev", host.ifname, "root", "tbf", *tbf])
            _sh(["tc", "-n", self.switch, "qdisc", "change", "dev", f"h{host.index}", "root", "tbf", *tbf])
        self.bandwidth_bits = bits

    # -- running commands ---------------------------------------------------------------------
    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``'s namespace (on its CPUs, if it is pinned)."""
        pin = ["taskset", "-c", ",".join(map(str, host.cpus))] if host.cpus else []
        return ["ip", "netns", "exec", host.netns, *pin, *argv]

    def popen(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (its own session, so a terminal's Ctrl-C reaches only
        this process, which then tears everything down). Keyword arguments go to ``Popen``."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(host, argv), env=dict(env) if env is not None else None, **kwargs)
        self._popened.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (keyword arguments go to ``subprocess.run``)."""
        return subprocess.run(self.command(host, argv), **kwargs)

    def kill_processes(self) -> int:
        """Kill every process running in any host; returns how many there were."""
        pids = [pid for host in self.hosts for pid in _netns_pids(host.netns)]
        _kill_all(pids)
        return len(pids)

    # -- measuring ----------------------------------------------------------------------------
    def tx_bytes(self) -> list[int]:
        """Bytes each host's interface has sent so far (Ethernet frames, as the kernel counts
        them), indexed by host."""
        return [self._link_stats(host)["tx"]["bytes"] for host in self.hosts]

    def rx_bytes(self) -> list[int]:
        """Bytes each host's interface has received so far, indexed by host."""
        return [self._link_stats(host)["rx"]["bytes"] for host in self.hosts]

    def _link_stats(self, host: Host) -> dict:
        out = _sh(["ip", "-j", "-s", "-n", host.netns, "link", "show", "dev", host.ifname]).stdout
        return json.loads(out)[0]["stats64"]

    def qdiscs(self) -> list[dict]:
        """The root qdisc of each host's interface, as ``tc -j`` reports it (``kind``, ``options``)."""
        rows = []
        for host in self.hosts:
            out = _sh(["tc", "-j", "-n", host.netns, "qdisc", "show", "dev", host.ifname]).stdout
            rows.append(next(q for q in json.loads(out) if q.get("root")))
        return rows

    @property
    def names(self) -> list[str]:
        """Every namespace this cluster owns (hosts then switch)."""
        return [h.netns for h in self.hosts] + [self.switch]


# -- leftovers ---------------------------------------------------------------------------------
def _netns_pids(netns: str) -> list[int]:
    proc = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_all(pids: list[int], grace_s: float = 2.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no namespace
    except (FileNotFoundError, IndexError):
        return False


def _remove_namespaces(names: Sequence[str]) -> None:
    for name in names:
        _kill_all(_netns_pids(name))
    for name in names:
        _sh(["ip", "netns", "delete", name], check=False)


def list_namespaces() -> list[str]:
    """Every network namespace whose name has the cluster's form."""
    proc = _sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if _NAME.match(n))


def leftovers() -> dict[str, dict]:
    """Clusters present on this machine: ``suffix -> {owner_pid, owner_alive, namespaces}``."""
    found: dict[str, dict] = {}
    for name in list_namespaces():
        match = _NAME.match(name)
        entry = found.setdefault(
            match["suffix"], {"owner_pid": int(match["pid"], 16), "owner_alive": False, "namespaces": []}
        )
        entry["namespaces"].append(name)
    for entry in found.values():
        entry["owner_alive"] = _alive(entry["owner_pid"])
    return found


def clean(*, force: bool = False) -> tuple[list[str], list[str]]:
    """Remove clusters whose owning process is gone (every cluster with ``force``).

    Returns:
        (removed namespaces, namespaces kept because their owner is alive).
    """
    removed, kept = [], []
    for entry in leftovers().values():
        if entry["owner_alive"] and not force:
            kept.extend(entry["namespaces"])
            continue
        names = sorted(entry["namespaces"], key=lambda n: n.endswith("-sw"))  # hosts, then switch
        _remove_namespaces(names)
        removed.extend(names)
    return removed, kept
