"""What lossy codecs measurably cost in loss under AdamW, said before and after a run.

Top-K and the sign codecs drop most of each gradient and send the rest later through error
feedback. Under AdamW, which divides every coordinate by its own running magnitude, that bursty
arrival costs loss that the gradient-side remedies tried do not close (``start_step``, a scale
per group of 4096, DGC's sampled threshold; ``benchmarks/results/remedies_main_job``).
Compressing AdamW's update instead of the gradient (``--optimizer local-adamw``,
:class:`gradzip.optim.LocalAdamW`) brings Top-K at 1% and EF-signSGD within 5% of ``none``; the
figures say so beside the others. The count sketch sends a Top-K selection (at 20% kept,
within 1% of ``none`` on the demo job at seed 1; at 1% it shares Top-K's gap); SEPARATE's
random projection adds a variance that grows as its rank shrinks (and, like PowerSGD's, it loses
most of a tied embedding table's gradient, which ``embeddings=int8`` sends apart); PowerSGD at rank 4 and
Radius past its default keep less than their gap to ``none`` suggests at a glance. The optimizers
that send their own subspace (DeMo, TSR-Adam) trail AdamW by more than their bytes suggest.
So that a user does not find it out at the end of a long run, ``gradzip train`` says the measured
figures for the codec or optimizer it was given when it starts and in its summary
(``known_gap`` in ``summary.json``). They are the demo job's, not a prediction for another model.
"""

from __future__ import annotations

from gradzip.choice import Choice, CodecChoice, parse_compressor
from gradzip.lab.train.optimizers import parse_optimizer

#: the runs the figures come from (``gradzip train --world-size 3 --steps 200 --seed 1``)
SOURCE = "the demo job, 3 workers, 200 steps, AdamW; benchmarks/results/remedies_main_job"

#: codec name -> (setting, the study's run folder, final validation loss above ``none`` in %)
MEASURED: dict[str, tuple[tuple[str, str, float], ...]] = {
    "topk": (
        ("Top-K at 1% from step 0", "topk", 20.1),
        ("with start_step=20", "topk-start20", 13.1),
        ("with --optimizer local-adamw (AdamW's update compressed instead, all_gather)", "local-adamw-topk", 4.7),
    ),
    "efsignsgd": (
        ("EF-signSGD from step 0 on all_gather (the route auto takes)", "efsign-ag", 11.3),
        ("on two phases", "efsign", 25.5),
        ("with group=4096,start_step=20 on all_gather", "efsign-g4096-start20-ag", 6.6),
        ("with --optimizer local-adamw (AdamW's update compressed instead)", "local-adamw-efsign", 2.3),
    ),
    "dgc": (("DGC at 1% from step 0", "dgc", 21.6),),
    "countsketch": (
        ("the count sketch at its defaults (TAGC's 20% kept, fill=union) on every bucket", "countsketch-tagc-all-union", 0.7),
        ("with TAGC's layer policy (attention dense)", "countsketch-tagc-union", 0.8),
        ("with fill=own (TAGC's values) on every bucket", "countsketch-tagc-all", 1.5),
        ("at 1% kept", "countsketch-union", 11.3),
    ),
    "powersgd": (
        ("PowerSGD at rank 4 (its default)", "powersgd", 3.0),
        ("with factor_bits=8", "powersgd8", 3.6),
        ("rank 16 with factor_bits=8 (rank 4's bytes at fp32)", "powersgd16-8", 0.6),
        ("with factor_bits=8,embeddings=int8 (21.6x)", "powersgd8-emb-int8", 2.3),
        ("approx_rank=16,factor_bits=8,embeddings=int8 (16.8x)", "powersgd16-8-emb-int8", 0.3),
    ),
    "radius": (
        ("Radius keeping 60% of its ranges (its default)", "radius-keep60", 0.8),
        ("keeping 40%", "radius", 4.0),
        ("keeping 5% (10x)", "radius-10x", 18.8),
    ),
    "separate": (
        ("SEPARATE at rank 4 (its default)", "separate", 19.7),
        ("rank 16", "separate-r16", 11.6),
        ("rank 64", "separate-r64", 5.9),
        ("with embeddings=int8 (20.2x)", "separate-emb-int8", 4.8),
        ("rank 16 with embeddings=int8 (13.8x)", "separate-r16-emb-int8", 3.5),
    ),
}

#: the runs the optimizers' figures come from (``gradzip train --optimizer SPEC --compressor none``)
OPTIMIZER_SOURCE = "the demo job, 2 workers, 300 steps; benchmarks/results/optimizers_subspace/next_token"

#: optimizer name -> (setting, the study's run folder, final validation loss above AdamW's in %)
OPTIMIZER_MEASURED: dict[str, tuple[tuple[str, str, float], ...]] = {
    "demo": (
        ("DeMo at the paper's settings (71.4x fewer bytes)", "demo-rerun", 4.5),
        ("with compression_topk=44 (51.9x)", "demo-topk44", 5.4),
        ("compression_topk=80,compact=true (51.1x)", "demo-topk80-compact", 3.4),
        ("compression_topk=112,compact=true,value_bits=8 (52.8x; +4.3% and +2.0% at seeds 1 and 2)",
         "demo-topk112-fp8", 1.8),
    ),
    "tsr-adam": (
        ("TSR-Adam at its defaults (14.4x fewer bytes)", "tsr-adam", 11.0),
        ("approx_rank=96,power_iters=0,moment_transfer=true,scale=22.5,dense_emb=true,dense_int8=true,wire_bits=16 "
         "(15.1x; +0.1% and +2.7% at seeds 1 and 2)", "tsr96-emb-int8-bf16", 2.1),
    ),
}


def gap_note(compressor: str | Choice, optimizer: str = "adamw") -> str | None:
    """One line: the final validation loss measured for the codec ``compressor`` names (a
    main-job spec, or the choice already parsed from it) above ``none``, or for the optimizer
    ``optimizer`` names (a ``--optimizer`` spec) above AdamW, at the settings measured; None where
    nothing was measured (schedules, anchors, and the codecs that end close to ``none``)."""
    name = parse_optimizer(optimizer)[0]
    if name in OPTIMIZER_MEASURED:  # such an optimizer sends its own subspace: no codec runs
        return f"measured final validation loss above AdamW: {_figures(OPTIMIZER_MEASURED[name])} ({OPTIMIZER_SOURCE})"
    choice = parse_compressor(compressor)  # a parsed choice comes back as it is
    if not isinstance(choice, CodecChoice) or choice.codec.name not in MEASURED:
        return None
    return f"measured final validation loss above none: {_figures(MEASURED[choice.codec.name])} ({SOURCE})"


def _figures(rows: tuple[tuple[str, str, float], ...]) -> str:
    return "; ".join(f"{setting} +{gap:.1f}%" for setting, _run, gap in rows)
