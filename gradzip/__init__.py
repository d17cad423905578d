"""gradzip: compressed gradient exchange for data-parallel training on ``torch.distributed``."""

from gradzip.compressors import Compressor, Payload, build, list_compressors
from gradzip.ddp import CompressionState, compression_hook
from gradzip.feedback import ErrorFeedback
from gradzip.outer import DiLoCo, replica_groups

__version__ = "0.1.0"

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
