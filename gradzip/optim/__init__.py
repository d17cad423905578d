"""Optimizers that own their communication: 1-bit Adam and 0/1 Adam.

Ordinary ``torch.optim.Optimizer``s with ``torch.optim.AdamW``'s parameter groups, weight decay
and ``state_dict`` (error-feedback buffers included). See :mod:`gradzip.optim.base` for how they
work with and without DDP.
"""

from gradzip.optim.base import CompressedAdamBase, grad_sync
from gradzip.optim.onebit_adam import OneBitAdam
from gradzip.optim.zeroone_adam import ZeroOneAdam

__all__ = ["CompressedAdamBase", "OneBitAdam", "ZeroOneAdam", "grad_sync"]
