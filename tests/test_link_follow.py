"""A link that drops and recovers mid-run, on the emulated cluster: ``auto`` and ``kimad`` move to
stronger compression within 10 steps of the drop and back within 10 steps of the recovery.

Two emulated hosts, one ``gradzip train`` rank each (gloo over the veths). The ``tbf`` rate of
every host and switch port is 4 Gbit/s, drops to 20 Mbit/s once step ``DROP - 1`` is recorded,
and returns to 4 Gbit/s once step ``RECOVER - 1`` is (:class:`LinkSchedule`). The model's
gradient is 1.9 MB per step.

Why these rates make the right choice differ, far from any threshold:

- at 4 Gbit/s (about 3 Gbit/s through gloo on a 2-core machine) the dense exchange takes about
  5 ms: Kimad's budget (the step's compute time, tens of ms, at the link rate: tens of MB) holds
  the gradient many times over, so every layer stays on its floor (``fp16``: light, 2x); for ``auto``, ``qsgd:bits=4``'s encoding and decoding (20 ms
  on an idle core, several times that on a loaded one) costs more than the 4 ms it would save,
  and ``fp16`` saves a few ms, under 5% of the step, so it keeps ``none`` or ``fp16`` (light:
  2x at most);
- at 20 Mbit/s the dense exchange takes about 0.75 s: Kimad's budget (tens of ms at 2.5 MB/s)
  is a few hundred kB at most, so it must compress several times; ``auto`` saves most of that with ``qsgd:bits=4`` (6.3x), far more than
  its encoding costs (``fp16`` would still take 0.38 s).

``auto``'s candidates are ``none``, ``fp16`` and ``qsgd:bits=4``, whose relative errors (about
0 and 0.09) are far under the error budget of 0.6, so the budget never decides here; the link
does. The compression level of a step is its ``compression_ratio`` (dense bytes over payload
bytes, rank 0's record): light at most 2, strong at least 3.5 (Kimad's `int8` on every layer is
3.9x, which a slow compute step's budget at 20 Mbit/s can hold).

The link estimate once settled on the slow link (the median of those in force from step
``DROP + 10`` to ``RECOVER - 1``) is checked against the ``tbf`` rate: within 25% for both, as
the issue asks. ``auto`` reads it from a probe it sends every window right after its figure
all_reduce, which the ranks issue together; its estimate read 11.5-15.5 Mbit/s here when it
came from the running exchange itself: ``qsgd:bits=4``'s encode takes 20 to 70 ms and differs
between the ranks, and a rank that issues its all_gather tens of ms after its peer makes gloo's
collective take longer on both than the link does (300 kB between two of these hosts: 167 ms
on the rank that waited least with one rank 40 ms late, 128 ms issued together). With the
probe: 18.3-20.0 Mbit/s in nine runs. Kimad reads it from its exchange, whose encodes are light:
17.8-20.3 in nine. On the 4 Gbit/s link the estimates spread from about 0.5 to 20 Gbit/s (an exchange
of 1 to 5 ms is mostly latency and scheduling noise) and are not checked.

Needs root and network namespaces; skipped elsewhere with the reason. Each case takes about 30 s
on a loaded 2-core machine, about 18 s of it the trainer's start-up (two ranks importing torch
and transformers' GPT-2).
"""

from __future__ import annotations

import statistics
import sys

import pytest
from helpers.tiny_run import write_corpus

from gradzip.lab.cluster import Cluster, parse_bandwidth, support_problem
from gradzip.lab.cluster.schedule import LinkSchedule, parse_link_schedule
from gradzip.lab.compare.runner import Emulated, launch_run, train_command
from gradzip.lab.train.layer_ratios import layer_ratios

PROBLEM = support_problem() if sys.platform.startswith("linux") else "emulated hosts need Linux"
needs_netns = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

FAST, SLOW = "4gbit", "20mbit"
DROP, RECOVER = 10, 24
STEPS = RECOVER + 13  # the steps past RECOVER + FOLLOW show the choice held
FOLLOW = 10  # steps within which the compression must follow a change of the link
LIGHT, STRONG = 2.0, 3.5  # compression ratios
# the settled estimate of the slow link against its tbf rate: at most this factor either way
ESTIMATE_FACTOR = {"kimad": 1.25, "auto": 1.25}
MODEL = dict(n_layer=2, n_embd=128, n_head=2, seq_len=64, batch_size=8, vocab_size=512, eval_every=1000,
             eval_batches=1, threads=1, warmup_steps=2)
OPTIONS = {
    "auto": ["--adapt-every", "4", "--auto-candidates", "none;fp16;qsgd:bits=4"],
    "kimad": [],
}


def _run(compressor: str, tmp_path):
    from gradzip.lab.train.data import Corpus

    data = write_corpus(tmp_path / "corpus.txt")
    Corpus.load(data, MODEL["vocab_size"])  # tokenized once here, so the two ranks find it cached
    out = tmp_path / compressor
    argv = train_command(compressor, out_dir=out, steps=STEPS, seed=0, collective_timeout_s=120, no_exchange=False,
                         options={**MODEL, "data": data}) + OPTIONS[compressor]  # fmt: skip
    changes = parse_link_schedule(f"{DROP}:{SLOW},{RECOVER}:{FAST}")
    with Cluster(2, FAST) as cluster, LinkSchedule(cluster, changes, out / "metrics.jsonl") as schedule:
        result = launch_run(compressor, argv, world_size=2, out_dir=out, network=Emulated(cluster), run_index=0,
                            timeout_s=240)  # fmt: skip
    return result, schedule


def _summary(records, drop: int, recover: int) -> str:
    """One line per step: ratio and estimate, and the decisions taken at that step (``auto``
    events: what was proposed and why), for the failure message and the log."""
    lines = []
    for r in records:
        link = r.get("link")
        est = f"{link['mbit']:8.1f} Mbit/s (step {link['step']})" if link else "-"
        mark = " <- drop" if r["step"] == drop else " <- recovery" if r["step"] == recover else ""
        lines.append(f"step {r['step']:2d}: ratio {r['compression_ratio']:5.2f}, step {r['step_s'] * 1e3:6.0f} ms, "
                     f"estimate {est}{mark}")
        for event in r.get("events", []):
            if event.get("kind") == "auto":
                reasons = "; ".join(event.get("reasons", {}).values())
                lines.append(f"    decided: {event.get('note', '')} {reasons}"[:300])
    return "\n".join(lines)


@pytest.mark.e2e
@needs_netns
@pytest.mark.parametrize("compressor", ["auto", "kimad"])
def test_compression_follows_a_link_that_drops_and_recovers(compressor, tmp_path):
    result, schedule = _run(compressor, tmp_path)
    assert result.status == "ok", result.error
    assert schedule.error is None, schedule.error
    assert [a.change.step for a in schedule.applied] == [DROP, RECOVER]
    # the first step that can have run at each new rate (the change lands during it or the next)
    drop, recover = (a.first_step for a in schedule.applied)
    records = result.records
    assert [r["step"] for r in records] == list(range(STEPS))
    ratio = {r["step"]: r["compression_ratio"] for r in records}
    log = _summary(records, drop, recover)
    strong_at = next((s for s in range(drop, STEPS) if ratio[s] >= STRONG), None)
    light_at = next((s for s in range(recover, STEPS) if ratio[s] <= LIGHT), None)
    slow_est = statistics.median(records[s]["link"]["mbit"] for s in range(drop + FOLLOW, recover))
    fast_est = records[-1]["link"]["mbit"]
    print(f"\n{compressor}: drop lands in step {drop}, recovery in step {recover}; strong from step {strong_at}, "
          f"light again from step {light_at}; estimate {slow_est:.1f} Mbit/s settled (tbf {SLOW}), "
          f"{fast_est:.0f} Mbit/s at step {STEPS - 1} (tbf {FAST})\n{log}")

    # light on the fast link before the drop (once the first decision is made)
    assert all(ratio[s] <= LIGHT for s in range(drop - 3, drop)), log
    # strong by drop + FOLLOW, and held until the recovery
    assert all(ratio[s] >= STRONG for s in range(drop + FOLLOW, recover)), log
    # light again by recover + FOLLOW, and held to the end
    assert all(ratio[s] <= LIGHT for s in range(recover + FOLLOW, STEPS)), log

    # the link estimate once settled on the slow link, against the tbf rate
    slow_mbit = parse_bandwidth(SLOW) / 1e6
    factor = ESTIMATE_FACTOR[compressor]
    assert 1 / factor <= slow_est / slow_mbit <= factor, log

    # the ratio per layer (layer_ratios.png) under Kimad's per-layer plans only; the layers' bytes
    # make up each step's: the step's ratio is sum(numel) / sum(numel / layer ratio)
    per_layer = layer_ratios(records)
    assert (per_layer is not None) == (compressor == "kimad") == (result.out_dir / "layer_ratios.png").exists()
    if per_layer is not None:
        for i, record in enumerate(records):
            payload = sum(n / row[i] for n, row in zip(per_layer.numels, per_layer.ratios))
            assert sum(per_layer.numels) / payload == pytest.approx(record["compression_ratio"], rel=1e-9), record
