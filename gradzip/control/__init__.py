"""Controllers and schedules: how much to compress at which step.

- :mod:`.sparsity`: Deep Gradient Compression's exponential sparsity warm-up.
"""
