"""gradzip: compressed gradient exchange for data-parallel training on ``torch.distributed``."""

from gradzip.compressors import Compressor, Payload, build, list_compressors
from gradzip.ddp import CompressionState, compression_hook
from gradzip.feedback import ErrorFeedback
from gradzip.outer import DiLoCo, replica_groups

__version__ = "0.1.0"

#: subpackages imported on first use (``gradzip.optim.OneBitAdam`` after a plain ``import gradzip``)
#: rather than at ``import gradzip``; ``integrations`` imports no framework until one of its
#: modules is used
_LAZY = ("fsdp", "optim", "integrations")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"gradzip.{name}")
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")

__all__ = [
    "CompressionState",
    "Compressor",
    "DiLoCo",
    "ErrorFeedback",
    "Payload",
    "build",
    "compression_hook",
    "list_compressors",
    "replica_groups",
]
