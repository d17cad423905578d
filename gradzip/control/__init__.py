"""Controllers, schedules and monitors: what to compress how much, and how well compression is doing.

- :mod:`.auto`: ``--compressor auto`` (a bandwidth-aware per-bucket choice with a quality budget)
  and Accordion.
- :mod:`.auto_reducer`: the reducer that carries out a controller's per-bucket choices.
- :mod:`.schedules`: the per-layer schedules, ``--compressor kimad``, ``legacy`` and ``edgc``
  (:mod:`.kimad`, :mod:`.legacy`, :mod:`.edgc`; what they share in :mod:`.layers`), run by
  :mod:`.layer_reducer`.
- :mod:`.link`: the link's latency and bandwidth from measured exchanges, whatever codec runs.
- :mod:`.knapsack`: the multiple-choice knapsack that splits a byte budget across layers.
- :mod:`.figures`: what controllers see (probe, layer, bucket and window figures) and answer (a plan).
- :mod:`.monitor`: quality figures into metrics.jsonl, TensorBoard and the summary, with a warning
  when the norm ratio stays low.
- :mod:`.sparsity`: Deep Gradient Compression's exponential sparsity warm-up.
"""
