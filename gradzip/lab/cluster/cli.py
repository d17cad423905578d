"""``gradzip cluster``: check support for emulated hosts, hold a cluster open, list or remove them."""

from __future__ import annotations

import argparse
import shlex
import signal

from gradzip.compressors.values import check_int
from gradzip.lab.cluster.netns import (
    MAX_HOSTS,
    Cluster,
    clean,
    format_bandwidth,
    leftovers,
    parse_bandwidth,
    support_problem,
)


def _check(args: argparse.Namespace) -> int:
    problem = support_problem()
    print(problem or "ok: root, ip, tc, network namespaces, veth and tbf are available")
    return 1 if problem else 0


def _status(args: argparse.Namespace) -> int:
    found = leftovers()
    if not found:
        print("no gradzip clusters")
        return 0
    for suffix, entry in sorted(found.items()):
        owner = "alive" if entry["owner_alive"] else "gone (gradzip cluster clean removes it)"
        print(f"{suffix}: owner pid {entry['owner_pid']} {owner}; namespaces {' '.join(entry['namespaces'])}")
    return 0


def _clean(args: argparse.Namespace) -> int:
    removed, kept = clean(force=args.force)
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
    if kept:
        print(f"kept {len(kept)} namespaces of running owners (--force removes them): {' '.join(kept)}")
    return 0


def _up(args: argparse.Namespace) -> int:
    check_int(args.hosts, name="--hosts", low=1, high=MAX_HOSTS)
    try:
        parse_bandwidth(args.bandwidth)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None
    problem = support_problem(pin_cpus=args.pin_cpus)
    if problem:
        raise ValueError(problem)
    with Cluster(args.hosts, args.bandwidth, pin_cpus=args.pin_cpus) as cluster:
        rate = format_bandwidth(cluster.bandwidth_bits)
        print(f"cluster {cluster.suffix}: {len(cluster.hosts)} hosts at {rate} each way")
        for host in cluster.hosts:
            print(f"  host {host.index}: {host.address} on {host.ifname}; run with: {shlex.join(cluster.command(host, ['CMD']))}")
        print("Ctrl-C removes it.", flush=True)
        signal.pause()
    return 0


def _action(actions, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with the line ``gradzip cluster --help`` lists it by."""
    return actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="emulated hosts on slow links (network namespaces + tbf; root)",
                       description="Emulated hosts on slow links: network namespaces joined by veth pairs on a "
                                   "bridge, each link limited by tbf in both directions (root).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = _action(actions, "check", "say whether emulated hosts can be made here")
    a.set_defaults(func=_check)
    a = _action(actions, "status", "list gradzip clusters present and whether their owner runs")
    a.set_defaults(func=_status)
    a = _action(actions, "clean", "remove clusters whose owning process is gone")
    a.add_argument("--force", action="store_true", help="also remove clusters of running owners")
    a.set_defaults(func=_clean)
    a = _action(actions, "up", "make a cluster and hold it until Ctrl-C")
    a.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    a.add_argument("--bandwidth", default="100mbit", help="link rate each way, e.g. 20mbit, 1gbit (default 100mbit)")
    a.add_argument("--pin-cpus", action="store_true",
                   help="give each host its own share of this machine's CPUs: the printed commands run under taskset")
    a.set_defaults(func=_up)
