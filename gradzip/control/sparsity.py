"""Sparsity warm-up: start dense-ish and tighten the kept ratio exponentially.

Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training" (ICLR 2018, arXiv 1712.01887), Section 3.3: "we increase the sparsity
exponentially, 75%, 93.75%, 98.4375%, 99.6%, 99.9%" over the first epochs, so that the early,
fast-changing gradients are not held back for many steps in the accumulation.
"""

from __future__ import annotations

from gradzip.compressors import check_int, check_ratio


def warmup_ratio(step: int, *, ratio: float, warmup_steps: int, stages: int = 4) -> float:
    """The kept ratio at ``step`` of a sparsity warm-up ending at ``ratio``.

    The warm-up splits ``warmup_steps`` into ``stages`` equal stages; stage ``s`` (0-based)
    keeps ``ratio ** ((s + 1) / (stages + 1))`` (geometric steps from 1 down to ``ratio``), and
    from ``warmup_steps`` on the ratio is ``ratio``. For ``ratio=0.001`` and 4 stages this is
    DGC's schedule: 25.1%, 6.3%, 1.6%, 0.4% kept (sparsity 74.9%, 93.7%, 98.4%, 99.6%), then
    0.1%.

    Args:
        step: the training step, an integer >= 0.
        ratio: the final kept fraction, in (0, 1].
        warmup_steps: steps of the warm-up, >= 0 (0: no warm-up).
        stages: warm-up stages, >= 1.

    Returns:
        the kept fraction in [ratio, 1).

    Raises:
        ValueError: naming the argument out of its range.
    """
    check_int(step, name="step", low=0)
    ratio = check_ratio(ratio)
    check_int(warmup_steps, name="warmup_steps", low=0)
    check_int(stages, name="stages", low=1)
    if step >= warmup_steps:
        return ratio
    stage = step * stages // warmup_steps
    return ratio ** ((stage + 1) / (stages + 1))
