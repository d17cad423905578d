"""Optimizers that own their communication: 1-bit Adam, 0/1 Adam, TSR-Adam, DeMo and local AdamW.

1-bit Adam, 0/1 Adam and TSR-Adam are ordinary ``torch.optim.Optimizer``s with
``torch.optim.AdamW``'s parameter groups, weight decay and ``state_dict`` (error-feedback
buffers, bases included). See :mod:`gradzip.optim.base` for how they work with and without DDP.
DeMo keeps a local momentum per rank and exchanges its top DCT components. Local AdamW keeps
AdamW's moments per rank and exchanges its update through any gradzip codec with error feedback.
"""

from gradzip.optim.base import CompressedAdamBase, grad_sync
from gradzip.optim.demo import DeMo
from gradzip.optim.local_adamw import LocalAdamW
from gradzip.optim.onebit_adam import OneBitAdam
from gradzip.optim.tsr_adam import TSRAdam
from gradzip.optim.zeroone_adam import ZeroOneAdam

__all__ = ["CompressedAdamBase", "DeMo", "LocalAdamW", "OneBitAdam", "TSRAdam", "ZeroOneAdam", "grad_sync"]
