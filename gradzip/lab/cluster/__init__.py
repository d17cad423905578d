"""Emulated hosts with limited links, for real measurements of gradient exchange.

:class:`Cluster` makes N hosts as network namespaces on one bridge, each link limited by a
``tbf`` qdisc; workers run inside a host with :meth:`Cluster.popen`, and :meth:`Cluster.tx_bytes`
reads the bytes each host put on its link. :meth:`Cluster.set_bandwidth` changes every link's
rate while a run goes on, and :class:`gradzip.lab.cluster.schedule.LinkSchedule` does it at given
steps of a run. :func:`support_problem` says in one line why that is impossible here (not root,
no namespaces), and :func:`clean` removes what a killed run left.
"""

from gradzip.lab.cluster.netns import (
    IFNAME,
    Cluster,
    ClusterError,
    Host,
    burst_bytes,
    clean,
    format_bandwidth,
    leftovers,
    parse_bandwidth,
    support_problem,
)

__all__ = [
    "IFNAME",
    "Cluster",
    "ClusterError",
    "Host",
    "burst_bytes",
    "clean",
    "format_bandwidth",
    "leftovers",
    "parse_bandwidth",
    "support_problem",
]
