"""Outer loops: DiLoCo and Streaming DiLoCo, their pseudo-gradients exchanged through the same
reducers as the DDP hook, so any gradzip codec runs on the link between replicas.

- :mod:`~gradzip.outer.diloco`: the wrapper around an inner optimizer.
- :mod:`~gradzip.outer.schedule`: fragments and their staggered schedule.
- :mod:`~gradzip.outer.exchange`: one fragment's exchange through a reducer.
- :mod:`~gradzip.outer.nesterov`: the outer Nesterov SGD step.
- :mod:`~gradzip.outer.groups`: replica and outer process groups for several ranks per replica.
"""

from gradzip.outer.diloco import DiLoCo
from gradzip.outer.groups import replica_groups

__all__ = ["DiLoCo", "replica_groups"]
