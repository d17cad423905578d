"""The alpha-beta formulas, checked against hand-computed values."""

import math

import pytest

from gradzip.lab.simulate.collectives import (
    Fabric,
    Link,
    all_to_all_s,
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
    single_level,
    tree_all_reduce_s,
)

# a = 10 us per step, b = 1 ns per byte (1 GB/s bus bandwidth)
LINK = Link(alpha_s=1e-5, bus_bytes_per_s=1e9)


def test_ring_all_reduce_hand_computed():
    # 2 (p-1) a + 2 (p-1)/p n b with p = 4, n = 1 MB: 6e-5 + 1.5e-3
    assert ring_all_reduce_s(1_000_000, 4, LINK) == pytest.approx(1.56e-3, rel=1e-12)
    # p = 3, n = 3 MB: 4e-5 + 2 * 2/3 * 3e-3 = 4e-5 + 4e-3
    assert ring_all_reduce_s(3_000_000, 3, LINK) == pytest.approx(4.04e-3, rel=1e-12)


def test_gather_scatter_all_to_all_hand_computed():
    # (p-1) a + (p-1)/p N b with p = 4, N = 4 MB: 3e-5 + 3e-3
    assert ring_all_gather_s(4_000_000, 4, LINK) == pytest.approx(3.03e-3, rel=1e-12)
    assert ring_reduce_scatter_s(4_000_000, 4, LINK) == pytest.approx(3.03e-3, rel=1e-12)
    assert all_to_all_s(4_000_000, 4, LINK) == pytest.approx(3.03e-3, rel=1e-12)
    # p = 5, N = 5 MB: 4e-5 + 4e-3
    assert ring_all_gather_s(5_000_000, 5, LINK) == pytest.approx(4.04e-3, rel=1e-12)


def test_tree_hand_computed():
    # 2 ceil(log2 p) a + 2 n b; p = 5 -> 3 levels: 6e-5 + 2e-3
    assert tree_all_reduce_s(1_000_000, 5, LINK) == pytest.approx(2.06e-3, rel=1e-12)
    assert tree_all_reduce_s(1_000_000, 8, LINK) == pytest.approx(2.06e-3, rel=1e-12)
    assert tree_all_reduce_s(1_000_000, 2, LINK) == pytest.approx(2.02e-3, rel=1e-12)


def test_one_worker_or_no_bytes_costs_nothing():
    for fn in (ring_all_reduce_s, ring_all_gather_s, ring_reduce_scatter_s, all_to_all_s, tree_all_reduce_s):
        assert fn(1e9, 1, LINK) == 0.0
        assert fn(0, 8, LINK) == 0.0


# g = 4 GPUs per node; NVLink a = 1 us, 100 GB/s; NICs a = 10 us, 10 GB/s per node
FABRIC = Fabric(gpus_per_node=4, intra=Link(1e-6, 100e9), inter=Link(1e-5, 10e9))


def test_fabric_all_reduce_algorithms_hand_computed():
    n, p = 1e9, 8  # two nodes
    # reduce_scatter in node 3e-6 + 3/4 * 1e9 / 1e11; all_reduce of n/4 over 2 nodes at 10e9 / 4
    # per GPU: 2e-5 + 2 * 1/2 * 2.5e8 / 2.5e9; all_gather in node as the reduce_scatter
    hierarchical = 2 * (3e-6 + 7.5e-3) + 2e-5 + 0.1
    # flat ring: slower level's bandwidth, inter latency: 2*7*1e-5 + 2*7/8*1e9/1e10
    ring = 1.4e-4 + 0.175
    # tree: chain 2*3*1e-6, tree over 2 nodes 2*1*1e-5, bandwidth 2 n / 1e10
    tree = 6e-6 + 2e-5 + 0.2
    assert FABRIC.all_reduce_s(n, p, "hierarchical") == pytest.approx(hierarchical, rel=1e-12)
    assert FABRIC.all_reduce_s(n, p, "ring") == pytest.approx(ring, rel=1e-12)
    assert FABRIC.all_reduce_s(n, p, "tree") == pytest.approx(tree, rel=1e-12)
    assert FABRIC.all_reduce_s(n, p, "auto") == pytest.approx(min(hierarchical, ring, tree), rel=1e-12)


def test_fabric_inside_one_node_uses_nvlink_only():
    n = 1e9
    assert FABRIC.all_reduce_s(n, 4, "ring") == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * n / 100e9, rel=1e-12)
    assert FABRIC.all_reduce_s(n, 4, "hierarchical") == FABRIC.all_reduce_s(n, 4, "ring")
    assert FABRIC.all_gather_s(n, 4) == pytest.approx(3e-6 + 3 / 4 * n / 100e9, rel=1e-12)


def test_fabric_all_to_all_is_bound_by_the_shared_nics():
    nbytes, p = 8e8, 8
    # 7 steps of the inter latency; NVLink share 3/8 N / 1e11 = 3e-3; NIC share 4 * 4/8 * N / 1e10 = 0.16
    assert FABRIC.all_to_all_s(nbytes, p) == pytest.approx(7e-5 + 0.16, rel=1e-12)
    # all_gather across nodes: a ring on the slower level
    assert FABRIC.all_gather_s(nbytes, p) == pytest.approx(7e-5 + 7 / 8 * nbytes / 1e10, rel=1e-12)
    assert FABRIC.reduce_scatter_s(nbytes, p) == FABRIC.all_gather_s(nbytes, p)
    assert FABRIC.nodes(8) == 2 and FABRIC.nodes(9) == 3


def test_single_level_fabric_equals_the_flat_formulas():
    fabric = single_level(LINK)
    for p in (2, 3, 4, 7):
        assert fabric.all_reduce_s(1e6, p, "ring") == pytest.approx(ring_all_reduce_s(1e6, p, LINK), rel=1e-12)
        assert fabric.all_gather_s(1e6, p) == pytest.approx(ring_all_gather_s(1e6, p, LINK), rel=1e-12)
        assert fabric.all_to_all_s(1e6, p) == pytest.approx(all_to_all_s(1e6, p, LINK), rel=1e-12)
        assert fabric.collective_s("reducescatter", 1e6, p) == pytest.approx(ring_reduce_scatter_s(1e6, p, LINK))


def test_bad_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="world_size"):
        ring_all_reduce_s(1, 0, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        FABRIC.all_reduce_s(1, 8, "butterfly")
    with pytest.raises(ValueError, match="collective"):
        FABRIC.collective_s("broadcast", 1, 8)
    with pytest.raises(ValueError, match="bus_bytes_per_s"):
        Link(0.0, 0.0)
    with pytest.raises(ValueError, match="alpha_s"):
        Link(math.nan, 1.0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Fabric(0, LINK, LINK)
