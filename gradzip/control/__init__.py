"""Controllers, schedules and monitors: what to compress how much, and how well compression is doing.

- :mod:`.auto`: ``--compressor auto`` (a bandwidth-aware per-bucket choice with a quality budget)
  and the explicit schedules (Accordion, LEGACY-style, EDGC-style).
- :mod:`.auto_reducer`: the reducer that carries out a controller's per-bucket choices.
- :mod:`.figures`: what controllers see (probe, bucket and window figures) and answer (a plan).
- :mod:`.monitor`: quality figures into metrics.jsonl, TensorBoard and the summary, with a warning
  when the norm ratio stays low.
- :mod:`.sparsity`: Deep Gradient Compression's exponential sparsity warm-up.
"""
