"""The two process groups of hierarchical DiLoCo: inside a replica and between replicas.

A replica is ``replica_size`` consecutive ranks that train one model copy together (plain DDP,
or a gradzip DDP hook, on the replica's group: the fast links inside a host); the outer
exchange runs between the ranks that hold the same position in every replica (the slow links
between hosts). With 4 ranks and ``replica_size=2``: replicas ``{0, 1}`` and ``{2, 3}``,
outer groups ``{0, 2}`` and ``{1, 3}``. Every rank of a replica takes the same outer step, so
the replica stays identical.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from gradzip.compressors import check_int


def replica_groups(world_size: int, replica_size: int, *,
                   timeout: timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Build every replica group and every outer group, in one order on every rank (as
    ``dist.new_group`` requires), and return this rank's ``(replica_group, outer_group)``.

    Args:
        world_size: ranks in the default group (``dist.get_world_size()``).
        replica_size: ranks per replica, in ``[1, world_size]``, dividing ``world_size``.
        timeout: how long a collective of these groups waits for a rank that stopped before it
            fails. Pass the one given to ``init_process_group``: a new group does not inherit
            it, and None leaves PyTorch's default (30 minutes on gloo).

    Raises:
        ValueError: for a ``replica_size`` out of range or not dividing ``world_size``, or a
            ``world_size`` other than the default group's.
    """
    check_int(world_size, name="world_size", low=1)
    check_int(replica_size, name="replica_size", low=1, high=world_size)
    if world_size % replica_size:
        raise ValueError(f"replica_size must divide world_size={world_size}; got {replica_size}")
    if world_size != dist.get_world_size():
        raise ValueError(f"world_size must be the default group's, {dist.get_world_size()}; got {world_size}")
    rank = dist.get_rank()
    replicas = world_size // replica_size
    mine: dict[str, dist.ProcessGroup] = {}
    for r in range(replicas):
        ranks = list(range(r * replica_size, (r + 1) * replica_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine["replica"] = group
    for position in range(replica_size):
        ranks = [r * replica_size + position for r in range(replicas)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine["outer"] = group
    return mine["replica"], mine["outer"]
