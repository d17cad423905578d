"""Watch what compression does to the gradients: figures per bucket into metrics.jsonl,
TensorBoard and the summary, and a warning when a bucket's figures mean trouble.

What means trouble depends on the codec family, told apart by whether the bucket's figures carry
an error-feedback ratio:

- Without error feedback, what the codec drops is lost. A check is low when the norm ratio
  ``||C(x)|| / ||x||`` is under ``threshold`` (0.9 by default): the codec throws away a large part
  of the gradient step after step.
- With error feedback, what the codec drops this step is kept and sent in later steps, so a low
  per-step norm ratio is the design (PowerSGD at rank 4 keeps well under 0.9 of each step). The
  trouble is a residual that is never paid back: with a codec whose relative error
  ``q = ||x - C(x)|| / ||x||`` stays under 1 the residual settles near at most ``q / (1 - q)``
  times the gradient (Karimireddy et al., "Error Feedback Fixes SignSGD", arXiv 1901.09847); with
  ``q >= 1`` nothing bounds it. A check is low when ``q >= 1``, or when the error-feedback ratio
  ``||e|| / ||g||`` exceeds both ``feedback_limit`` (the residual holds more than that many steps'
  worth of gradient: the updates run far behind the gradients) and twice the bound ``q / (1 - q)``
  that the codec's relative error allows: Top-K at 1% keeps ``q`` near 0.98, whose residual may
  settle near 50x without anything going wrong (as it does when ``local-adamw`` compresses AdamW's
  updates, every coordinate of which moves about ``lr`` a step).

:class:`QualityMonitor` counts, per bucket, the consecutive low checks; once a bucket reaches
``patience`` of them it is named in the warning, and it leaves the warning at its first check that
is not low. Figures come from :class:`gradzip.metrics.StepMetrics` (see there for their
definitions); the monitor runs on rank 0 and reports rank 0's figures.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from gradzip.compressors.values import check_number
from gradzip.integrations.tensorboard import summary_writer
from gradzip.keys import label
from gradzip.metrics import QUALITY_FIELDS

BUCKET_FIELDS = ("codec", "collective", "payload_bytes", "dense_bytes", "compress_s", "decompress_s", "communicate_s", "layers",
                 "unpeeled")
#: error-feedback ratio above which a check of a codec with error feedback counts as low
FEEDBACK_LIMIT = 20.0


class QualityMonitor:
    """Turns each step's metrics into record fields, warnings, TensorBoard scalars and a summary.

    Args:
        threshold: for codecs without error feedback, the norm ratio under which a check counts
            as low, in (0, 1].
        patience: consecutive low checks before a bucket is named in the warning, >= 1.
        feedback_limit: for codecs with error feedback, the error-feedback ratio ``||e|| / ||g||``
            above which a check counts as low where it also exceeds ``2 q / (1 - q)``, > 0.
        tensorboard_dir: write TensorBoard event files there (needs the ``tensorboard`` package);
            None writes none.

    Raises:
        ValueError: for a threshold, patience or feedback limit out of range.
        ImportError: if ``tensorboard_dir`` is given and ``tensorboard`` is not installed.
    """

    def __init__(self, *, threshold: float = 0.9, patience: int = 3, feedback_limit: float = FEEDBACK_LIMIT,
                 tensorboard_dir: str | Path | None = None) -> None:
        check_number(threshold, name="threshold", low=0, high=1, low_open=True)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1; got {patience!r}")
        check_number(feedback_limit, name="feedback_limit", low=0, low_open=True)
        self.threshold = float(threshold)
        self.patience = patience
        self.feedback_limit = float(feedback_limit)
        self.feedback: set[str] = set()  # buckets whose codec kept an error-feedback residual at their last check
        self.low_checks: dict[str, int] = {}
        self.warned: list[str] = []
        self.episodes: list[dict[str, Any]] = []
        self.quality: dict[str, dict[str, list[float]]] = {}
        self.verify_max: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []
        self.writer = None
        if tensorboard_dir is not None:
            self.writer = summary_writer(tensorboard_dir)

    @property
    def warning(self) -> str | None:
        """The current warning, or None."""
        parts = []
        plain = [n for n in self.warned if n not in self.feedback]
        fed = [n for n in self.warned if n in self.feedback]
        if plain:
            parts.append(f"norm ratio < {self.threshold:g} for {self.patience}+ checks: bucket {', '.join(plain)}")
        if fed:
            parts.append(f"error feedback falling behind (residual over {self.feedback_limit:g}x the gradient and "
                         f"twice what the relative error q bounds it at, q / (1 - q), or q >= 1) for {self.patience}+ "
                         f"checks: bucket {', '.join(fed)}")
        return "; ".join(parts) or None

    def observe(self, step: int, comm: dict[str, Any], record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Digest one step's metrics (what ``StepMetrics.pop`` returned).

        Args:
            step: the training step.
            comm: the popped metrics.
            record: the step's record (loss, times) for TensorBoard; not modified.

        Returns:
            fields to add to the step's record: ``buckets`` (per bucket: codec, bytes, seconds,
            ``layers`` under a per-layer schedule, and ``quality`` / ``verify`` on the steps that
            have them), ``events`` when there are
            any, ``norm_warning`` while the warning stands.
        """
        buckets: dict[str, dict[str, Any]] = {}
        checked: list[str] = []
        for key, entry in comm.get("buckets", {}).items():
            name = label(key)
            out = {f: entry[f] for f in BUCKET_FIELDS if f in entry}
            if "quality" in entry:
                out["quality"] = entry["quality"]
                checked.append(name)
                self._check(name, entry["quality"])
                series = self.quality.setdefault(name, {f: [] for f in QUALITY_FIELDS})
                for f in QUALITY_FIELDS:
                    if f in entry["quality"]:
                        series[f].append(entry["quality"][f])
            if "verify" in entry:
                out["verify"] = entry["verify"]
                diff = entry["verify"]["relative_difference"]
                self.verify_max[name] = max(self.verify_max.get(name, 0.0), diff)
            buckets[name] = out
        if checked:
            self._update_warning(step)
        fields: dict[str, Any] = {"buckets": buckets}
        events = comm.get("events") or []
        if events:
            fields["events"] = events
            self.events.extend(events)
        if self.warning is not None:
            fields["norm_warning"] = self.warning
        if self.writer is not None:
            self._tensorboard(step, buckets, record or {})
        return fields

    def _check(self, name: str, quality: dict[str, float]) -> None:
        if "feedback_ratio" in quality:
            self.feedback.add(name)
            q = quality["relative_error"]
            low = q >= 1.0 or quality["feedback_ratio"] > max(self.feedback_limit, 2 * q / (1 - q))
        else:  # (auto may change a bucket's codec: the latest check tells its family)
            self.feedback.discard(name)
            low = quality["norm_ratio"] < self.threshold
        if low:
            self.low_checks[name] = self.low_checks.get(name, 0) + 1
        else:
            self.low_checks[name] = 0

    def _update_warning(self, step: int) -> None:
        warned = sorted((n for n, c in self.low_checks.items() if c >= self.patience), key=_bucket_order)
        if warned and warned != self.warned:
            self.episodes.append({"step": step, "buckets": warned})
        if not warned and self.warned:
            self.episodes.append({"step": step, "buckets": [], "cleared": True})
        self.warned = warned

    def _tensorboard(self, step: int, buckets: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        for field in ("loss", "val_loss", "step_s", "compression_ratio", "communicate_s"):
            if field in record:
                self.writer.add_scalar(f"train/{field}", record[field], step)
        for name, b in buckets.items():
            for f in ("payload_bytes", "compress_s", "decompress_s", "communicate_s"):
                if f in b:
                    self.writer.add_scalar(f"bucket{name}/{f}", b[f], step)
            for f, value in b.get("quality", {}).items():
                self.writer.add_scalar(f"bucket{name}/{f}", value, step)
            if "verify" in b:
                self.writer.add_scalar(f"bucket{name}/verify_relative_difference", b["verify"]["relative_difference"], step)

    def summary(self) -> dict[str, Any]:
        """For summary.json: the route each bucket took from which step and why, per-bucket medians
        and extremes of the quality figures, the largest verify difference, warning episodes, the
        warning at the end, and the auto decisions."""
        quality = {}
        for name, series in sorted(self.quality.items(), key=lambda kv: _bucket_order(kv[0])):
            q = {}
            for f, values in series.items():
                if values:
                    q[f + "_median"] = statistics.median(values)
            if series["norm_ratio"]:
                q["norm_ratio_min"] = min(series["norm_ratio"])
                q["checks"] = len(series["norm_ratio"])
            if series["feedback_ratio"]:
                q["feedback_ratio_max"] = max(series["feedback_ratio"])
            quality[name] = q
        decisions = [e for e in self.events if e.get("kind") in ("switch", "auto")]
        routes: dict[str, dict[str, Any]] = {}
        for e in self.events:
            if e.get("kind") == "route":
                routes.setdefault(e["bucket"], {"taken": []})["taken"].append(
                    {"step": e["step"], "route": e["route"], "why": e["why"]})
        return {
            "routes": dict(sorted(routes.items(), key=lambda kv: _bucket_order(kv[0]))),
            "quality": quality,
            "verify_max_relative_difference": dict(self.verify_max),
            "norm_warning_threshold": self.threshold,
            "feedback_warning_limit": self.feedback_limit,
            "norm_warning_episodes": self.episodes,
            "norm_warning": self.warning,
            "auto_decisions": decisions,
        }

    def summary_lines(self) -> list[str]:
        """Lines for the end-of-run table."""
        s = self.summary()
        lines = []
        for name, q in s["quality"].items():
            if "feedback_ratio_median" in q:
                lines.append(
                    f"bucket {name}: error-feedback residual {q['feedback_ratio_median']:.2f}x the gradient (median; "
                    f"max {q['feedback_ratio_max']:.2f}), relative error {q['relative_error_median']:.3f}, "
                    f"norm ratio {q['norm_ratio_median']:.3f}, cosine {q['cosine_median']:.3f} over {q['checks']} checks"
                )
            elif "norm_ratio_median" in q:
                lines.append(
                    f"bucket {name}: norm ratio {q['norm_ratio_median']:.3f} (min {q['norm_ratio_min']:.3f}), "
                    f"cosine {q.get('cosine_median', float('nan')):.3f}, relative error "
                    f"{q.get('relative_error_median', float('nan')):.3f} over {q['checks']} checks"
                )
        if any("feedback_ratio_median" in q for q in s["quality"].values()):
            lines.append(
                "  with error feedback a low norm ratio is by design (what a step drops is sent in later steps); "
                f"trouble is a residual that is never paid back: a warning above {self.feedback_limit:g}x the "
                "gradient and twice the q / (1 - q) its relative error q allows, or at q >= 1"
            )
        if any("feedback_ratio_median" not in q and "norm_ratio_median" in q for q in s["quality"].values()):
            lines.append(
                "  without error feedback the norm ratio is the share of the gradient's length that arrives: "
                f"a warning under {self.threshold:g}"
            )
        for name, entry in s["routes"].items():
            for taken in entry["taken"]:
                lines.append(f"bucket {name}: {taken['route']} from step {taken['step']}: {taken['why']}")
        for name, diff in sorted(s["verify_max_relative_difference"].items(), key=lambda kv: _bucket_order(kv[0])):
            lines.append(f"bucket {name}: exactness check, largest relative difference from dense {diff:.3g}")
        for e in s["auto_decisions"]:
            if e.get("kind") == "switch":
                reason = e.get("reason") or ""
                if reason.startswith(f"bucket {e['bucket']}:"):  # a controller's reason names the change itself
                    lines.append(f"step {e['step']}: {reason}")
                else:
                    lines.append(f"step {e['step']}: bucket {e['bucket']}: {e['from']} -> {e['to']}"
                                 + (f" ({reason})" if reason else ""))
            elif e.get("note") and e["note"] != "no change":
                lines.append(f"step {e['step']}: {e.get('schedule', 'auto')}: {e['note']}")
        if s["norm_warning"]:
            lines.append(f"WARNING: {s['norm_warning']}")
        elif any(not ep.get("cleared") for ep in s["norm_warning_episodes"]):
            lines.append(f"quality warning raised and cleared during the run ({len(s['norm_warning_episodes'])} changes)")
        return lines

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _bucket_order(name: str):
    return (0, int(name)) if name.lstrip("-").isdigit() else (1, name)
