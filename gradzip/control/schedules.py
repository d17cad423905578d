"""The per-layer schedules by name, as ``--compressor NAME[:params]`` gives them.

``kimad`` (:mod:`gradzip.control.kimad`), ``legacy`` (:mod:`gradzip.control.legacy`) and ``edgc``
(:mod:`gradzip.control.edgc`) each plan a codec per layer of every DDP bucket and run in
:class:`~gradzip.control.layer_reducer.LayerAutoReducer`.
"""

from __future__ import annotations

from typing import Any

from gradzip.control.edgc import EDGCController
from gradzip.control.kimad import KimadController
from gradzip.control.legacy import LegacyController

#: name -> controller class (``from_params`` builds one from a spec's parameters)
LAYER_SCHEDULES = {"kimad": KimadController, "legacy": LegacyController, "edgc": EDGCController}
#: schedules that slice the run and take ``total_steps`` (filled in by the trainer from ``--steps``)
SLICE_THE_RUN = ("legacy", "edgc")


def layer_controller(name: str, params: dict[str, Any], *, total_steps: int | None = None):
    """The controller of schedule ``name`` with ``params`` (``total_steps`` added where the
    schedule takes it and the spec does not give it).

    Raises:
        ValueError: naming a parameter and its range, or an unknown parameter.
    """
    params = dict(params)
    if total_steps is not None and name in SLICE_THE_RUN:
        params.setdefault("total_steps", total_steps)
    return LAYER_SCHEDULES[name].from_params(params)
