"""An alpha-beta cost model of compressed data-parallel training, projected to large clusters.

- :mod:`.collectives`: the collectives' seconds on one link level and on a two-level cluster.
- :mod:`.exchange`: what each codec puts on the wire per bucket, from the real codecs' sizes.
- :mod:`.step`: the step timeline (DDP buckets overlapped with backward, FSDP, 1-bit Adam).
- :mod:`.presets`: named clusters and models (shapes from ``transformers`` configs, no weights).
- :mod:`.project`: step time, communication share, speedup and cost per method.
- :mod:`.calibrate`: predictions beside the step times of ``gradzip compare`` runs.
- :mod:`.codec_speed`: codec throughput timed on this machine.
- :mod:`.cli`: the ``gradzip simulate`` command.
"""

from gradzip.lab.simulate.collectives import Fabric, Link
from gradzip.lab.simulate.exchange import Exchange, Method
from gradzip.lab.simulate.presets import CLUSTERS, MODELS, model_shapes
from gradzip.lab.simulate.project import Scenario, project
from gradzip.lab.simulate.step import CodecSpeed, StepResult, Workload, simulate_step

__all__ = [
    "CLUSTERS",
    "CodecSpeed",
    "Exchange",
    "Fabric",
    "Link",
    "MODELS",
    "Method",
    "Scenario",
    "StepResult",
    "Workload",
    "model_shapes",
    "project",
    "simulate_step",
]
