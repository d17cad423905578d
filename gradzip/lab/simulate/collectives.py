"""Alpha-beta cost of the collectives, on one link level and on a two-level cluster.

A link level is ``Link(alpha_s, bus_bytes_per_s)``: ``a`` seconds of latency per algorithm step
and ``b = 1 / bus_bytes_per_s`` seconds per byte, where the bus bandwidth is the figure
nccl-tests reports (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests: the bandwidth at which the
busiest link runs, so that it is comparable across world sizes). With ``p`` workers:

=====================  =====================================================  ================
collective             seconds                                                 bytes argument
=====================  =====================================================  ================
ring all_reduce        ``2 (p-1) a + 2 (p-1)/p * n * b``                       ``n`` per worker
ring reduce_scatter    ``(p-1) a + (p-1)/p * N * b``                           ``N`` per worker in
ring all_gather        ``(p-1) a + (p-1)/p * N * b``                           ``N`` gathered out
all_to_all (pairwise)  ``(p-1) a + (p-1)/p * N * b``                           ``N`` per worker in
tree all_reduce        ``2 ceil(log2 p) a + 2 n b``                            ``n`` per worker
=====================  =====================================================  ================

The tree is the pipelined double binary tree NCCL uses (Sanders, Speck & Traeff, "Two-tree
algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 2009): log
latency, but no ``(p-1)/p`` discount on bandwidth. The ring is Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations" (JPDC 2009).

A :class:`Fabric` has two levels: ``gpus_per_node`` GPUs joined by NVLink (``intra``), nodes
joined by their NICs (``inter``, whose bandwidth is the node's NICs together). A flat ring over
nodes runs one ring per NIC in parallel, so its per-worker bus bandwidth is the smaller of the
two levels; hierarchical all_reduce is reduce_scatter inside the node, all_reduce of ``n / g``
across nodes on each GPU's share of the NICs, and all_gather inside the node; an all_to_all
sends ``(p - g) / p`` of every GPU's bytes off the node, all ``g`` GPUs through the same NICs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Link:
    """One level of the network in the alpha-beta model.

    Attributes:
        alpha_s: latency per algorithm step, seconds (>= 0).
        bus_bytes_per_s: bus bandwidth as nccl-tests defines it, bytes per second (> 0).
    """

    alpha_s: float
    bus_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"alpha_s must be a finite number >= 0; got {self.alpha_s}")
        if not (self.bus_bytes_per_s > 0 and math.isfinite(self.bus_bytes_per_s)):
            raise ValueError(f"bus_bytes_per_s must be a finite number > 0; got {self.bus_bytes_per_s}")

    @property
    def beta_s_per_byte(self) -> float:
        """``b``: seconds per byte, ``1 / bus_bytes_per_s``."""
        return 1.0 / self.bus_bytes_per_s


def _check_p(p: int) -> int:
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"world_size must be an integer >= 1; got {p!r}")
    return p


def ring_all_reduce_s(nbytes: float, p: int, link: Link) -> float:
    """Ring all_reduce: ``2 (p-1) a + 2 (p-1)/p * n * b``; ``n`` the bytes each worker holds."""
    _check_p(p)
    if p == 1 or nbytes == 0:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes * link.beta_s_per_byte


def ring_reduce_scatter_s(nbytes: float, p: int, link: Link) -> float:
    """Ring reduce_scatter: ``(p-1) a + (p-1)/p * N * b``; ``N`` the bytes each worker starts with."""
    _check_p(p)
    if p == 1 or nbytes == 0:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * nbytes * link.beta_s_per_byte


def ring_all_gather_s(nbytes: float, p: int, link: Link) -> float:
    """Ring all_gather: ``(p-1) a + (p-1)/p * N * b``; ``N`` the gathered bytes (p times each input)."""
    return ring_reduce_scatter_s(nbytes, p, link)


def all_to_all_s(nbytes: float, p: int, link: Link) -> float:
    """Pairwise all_to_all: ``(p-1) a + (p-1)/p * N * b``; each worker holds ``N`` bytes, ``N/p`` per peer."""
    return ring_reduce_scatter_s(nbytes, p, link)


def tree_all_reduce_s(nbytes: float, p: int, link: Link) -> float:
    """Pipelined double binary tree all_reduce: ``2 ceil(log2 p) a + 2 n b``."""
    _check_p(p)
    if p == 1 or nbytes == 0:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.alpha_s + 2 * nbytes * link.beta_s_per_byte


@dataclass(frozen=True)
class Fabric:
    """A two-level cluster network.

    Attributes:
        gpus_per_node: ``g``, GPUs that share a node's NVLink and NICs (>= 1).
        intra: the link among GPUs of one node.
        inter: the link between nodes; its bandwidth is all of one node's NICs together.
    """

    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1; got {self.gpus_per_node!r}")

    def nodes(self, p: int) -> int:
        """Nodes that ``p`` workers occupy (``ceil(p / g)``)."""
        return -(-_check_p(p) // self.gpus_per_node)

    def single_node(self, p: int) -> bool:
        """Whether ``p`` workers fit in one node (only the intra link is used)."""
        return _check_p(p) <= self.gpus_per_node

    def flat(self) -> Link:
        """The link a ring spanning nodes sees: the slower level's bandwidth, the inter latency."""
        return Link(
            max(self.intra.alpha_s, self.inter.alpha_s),
            min(self.intra.bus_bytes_per_s, self.inter.bus_bytes_per_s),
        )

    # all_reduce ---------------------------------------------------------------------------

    def all_reduce_s(self, nbytes: float, p: int, algorithm: str = "auto") -> float:
        """all_reduce of ``nbytes`` per worker over ``p`` workers.

        Args:
            nbytes: bytes each worker contributes (and receives back).
            p: world_size.
            algorithm: ``ring`` (flat ring), ``tree`` (NVLink chain + inter-node double binary
                tree), ``hierarchical`` (reduce_scatter in node, all_reduce across nodes,
                all_gather in node) or ``auto`` (the fastest of the three, as NCCL's tuner picks).

        Raises:
            ValueError: for an unknown ``algorithm`` or ``p < 1``.
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
        if algorithm == "auto":
            return min(self.all_reduce_s(nbytes, p, a) for a in ALGORITHMS[1:])
        if self.single_node(p):
            if algorithm == "tree":
                return tree_all_reduce_s(nbytes, p, self.intra)
            return ring_all_reduce_s(nbytes, p, self.intra)
        if algorithm == "ring":
            return ring_all_reduce_s(nbytes, p, self.flat())
        if algorithm == "tree":
            return self._tree_s(nbytes, p)
        return self._hierarchical_s(nbytes, p)

    def _tree_s(self, nbytes: float, p: int) -> float:
        # A chain through the node's GPUs feeds an inter-node double binary tree; up then down.
        g, nodes = self.gpus_per_node, self.nodes(p)
        latency = 2 * (g - 1) * self.intra.alpha_s + 2 * math.ceil(math.log2(nodes)) * self.inter.alpha_s
        return latency + 2 * nbytes * self.flat().beta_s_per_byte

    def _hierarchical_s(self, nbytes: float, p: int) -> float:
        g, nodes = self.gpus_per_node, self.nodes(p)
        # Each GPU owns n/g after the in-node reduce_scatter and drives 1/g of the node's NICs.
        per_gpu_inter = Link(self.inter.alpha_s, self.inter.bus_bytes_per_s / g)
        return (
            ring_reduce_scatter_s(nbytes, g, self.intra)
            + ring_all_reduce_s(nbytes / g, nodes, per_gpu_inter)
            + ring_all_gather_s(nbytes, g, self.intra)
        )

    # gather / scatter / all_to_all ---------------------------------------------------------

    def all_gather_s(self, nbytes: float, p: int) -> float:
        """Ring all_gather; ``nbytes`` is the gathered output (``p`` times each worker's input)."""
        link = self.intra if self.single_node(p) else self.flat()
        return ring_all_gather_s(nbytes, p, link)

    def reduce_scatter_s(self, nbytes: float, p: int) -> float:
        """Ring reduce_scatter; ``nbytes`` is each worker's input (it keeps ``nbytes / p``)."""
        link = self.intra if self.single_node(p) else self.flat()
        return ring_reduce_scatter_s(nbytes, p, link)

    def all_to_all_s(self, nbytes: float, p: int) -> float:
        """Pairwise all_to_all; each worker holds ``nbytes``, ``nbytes / p`` for each peer.

        Across nodes the in-node share moves over NVLink and the rest through the NICs, which
        all ``g`` GPUs of a node share: ``(p-1) a_inter + max((g-1)/p N b_intra, g (p-g)/p N b_inter)``.
        """
        if self.single_node(p):
            return all_to_all_s(nbytes, p, self.intra)
        if nbytes == 0:
            return 0.0
        g = self.gpus_per_node
        intra_s = (g - 1) / p * nbytes * self.intra.beta_s_per_byte
        inter_s = g * (p - g) / p * nbytes * self.inter.beta_s_per_byte
        return (p - 1) * max(self.intra.alpha_s, self.inter.alpha_s) + max(intra_s, inter_s)

    def collective_s(self, collective: str, nbytes: float, p: int, algorithm: str = "auto") -> float:
        """Seconds of one collective by name: ``allreduce``, ``allgather``, ``reducescatter``, ``alltoall``.

        ``nbytes`` follows the per-collective meaning above.

        Raises:
            ValueError: for an unknown ``collective``.
        """
        if collective == "allreduce":
            return self.all_reduce_s(nbytes, p, algorithm)
        if collective == "allgather":
            return self.all_gather_s(nbytes, p)
        if collective == "reducescatter":
            return self.reduce_scatter_s(nbytes, p)
        if collective == "alltoall":
            return self.all_to_all_s(nbytes, p)
        raise ValueError(f"collective must be allreduce, allgather, reducescatter or alltoall; got {collective!r}")


def single_level(link: Link) -> Fabric:
    """A fabric of one GPU per node: every collective runs on ``link`` with the flat formulas."""
    return Fabric(gpus_per_node=1, intra=link, inter=link)
