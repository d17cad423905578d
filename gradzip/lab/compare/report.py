"""What ``gradzip compare`` writes: ``report.md``, ``results.json``, ``loss_vs_time.png``,
``loss_vs_bytes.png`` and, when some entry is a per-layer schedule, ``layer_ratios.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradzip.lab.compare.analysis import LIMIT
from gradzip.lab.compare.runner import RunResult

#: every file this module writes into a comparison's folder (``layer_ratios.png`` only under a
#: per-layer schedule)
FILES = ("report.md", "results.json", "loss_vs_time.png", "loss_vs_bytes.png", "layer_ratios.png")


def _num(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _seconds(value: float | None, none: str = "-") -> str:
    if value is None:
        return none
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _spread(value: str, span: list[float] | None, fmt) -> str:
    """``value`` with the smallest and largest round after it, when there were several rounds."""
    return value if not span or value == "-" else f"{value} ({fmt(span[0])} to {fmt(span[1])})"


def _machine(cpu_count: int, world_size: int, host_cpus: list[list[int]] | None) -> str:
    """The cores and how the workers were placed on them: pinned per host, or (None) by the kernel."""
    if not host_cpus:
        return f"{cpu_count} CPU cores shared by all {world_size} workers, placed by the kernel"
    return f"{cpu_count} CPU cores for {world_size} workers, each host's pinned to CPUs (`taskset`): " + "; ".join(
        f"host {i} on {', '.join(map(str, cpus))}" for i, cpus in enumerate(host_cpus))


def table(rows: Sequence[dict[str, Any]], *, wire: bool) -> str:
    """The Markdown table of ``report.md`` (and of the README)."""
    head = ["compressor", "status", "wall s", "step s", "speedup", "of limit", "time to target s", "compute util", "vs none", "final val loss",
            "compute / codec / comm s", "payload MB/rank", "sent MB/rank"]  # fmt: skip
    if wire:
        head += ["wire MB/rank", "wire for exchange MB/rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ttt = r["time_to_target_s"]
        is_limit = r["compressor"] == LIMIT
        cells = [
            f"`{r['compressor']}`",
            r["status"],
            _seconds(r["wall_s"]),
            _num(r["step_s"], ".3f"),
            _num(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
            _num(r["fraction_of_limit"], ".0%"),
            "n/a" if is_limit else _spread(_seconds(ttt, "not reached"), r.get("time_to_target_s_range"), _seconds),
            # the limit's utilisation is 100% by definition in every round: no range
            # to a tenth of a point, the range as the median: a bar such as 90% is not met at
            # 89.9%, and a round of 94.6% must not read 95% beside a median of 94.8%
            _spread(_num(r.get("compute_utilisation"), ".1%"), None if is_limit else r.get("compute_utilisation_range"),
                    lambda v: format(v, ".1%")),
            _num(r["time_to_target_speedup"], ".2f") + ("x" if r["time_to_target_speedup"] is not None else ""),
            _num(r["final_val_loss"], ".4f") + (" (replicas apart)" if is_limit else ""),
            # a hook that counts nothing (PyTorch's) times nothing either: its codec and comm are unknown
            " / ".join(_num(r[k], ".3f") if k == "compute_s" or r["payload_bytes"] is not None else "-"
                       for k in ("compute_s", "compress_s", "communicate_s")),
            _mb(r["payload_bytes"]) if r["payload_bytes"] is not None else "unknown",
            _mb(r["sent_bytes"]) if r["sent_bytes"] is not None else "unknown",
        ]
        if wire:
            cells += [_mb(r["wire_bytes"]), _mb(r["wire_bytes_exchange"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_lines(rows: Sequence[dict[str, Any]], target_loss: float | None) -> list[str]:
    """The end of a comparison on the terminal: the target and, per entry, the figures a reader
    looks for first, in aligned columns (``report.md`` has them all)."""
    head = ("compressor", "step s", "speedup", "time to target s", "final val loss", "sent MB/rank")
    body = []
    for r in rows:
        is_limit = r["compressor"] == LIMIT
        body.append((
            r["compressor"] + ("" if r["status"] == "ok" else f" ({r['status']})"),
            _num(r["step_s"], ".3f"),
            _num(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
            "n/a" if is_limit else _seconds(r["time_to_target_s"], "not reached"),
            _num(r["final_val_loss"], ".4f"),
            _mb(r["sent_bytes"]) if r["sent_bytes"] is not None else "unknown",
        ))
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [f"target validation loss {_num(target_loss, '.4f', 'none')}", fmt.format(*head),
            *(fmt.format(*row) for row in body)]


def write_results(out: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path = out / "results.json"
    path.write_text(json.dumps(list(rows), indent=2) + "\n")
    return path


def write_report(out: Path, rows: Sequence[dict[str, Any]], setup: dict[str, Any], target: dict[str, Any]) -> Path:
    """``report.md``: the setup, the table, the target, what failed, the caveats."""
    emulated = setup["network"] == "emulated"
    has_limit = any(r["compressor"] == LIMIT for r in rows)
    lines = [f"# gradzip compare: time to loss, {setup['world_size']} workers, {setup['link']}", ""]
    lines += ["## Setup", ""]
    if emulated:
        per_host = setup.get("ranks_per_host", 1)
        hosts = setup["world_size"] // per_host
        placed = "" if per_host == 1 else (
            f" with {per_host} workers each (their traffic inside a host is not limited; wire bytes are per host; "
            "DiLoCo entries run one replica per host)")
        # runs written before the setup recorded the bucket say nothing of it
        bucket = setup.get("tbf_burst_bytes")
        lines.append(
            f"- Network: {hosts} emulated hosts{placed} (Linux network namespaces on one bridge), each link "
            f"limited to {setup['bandwidth']} in each direction by a `tbf` qdisc"
            f"{f' (a bucket of {bucket:,} bytes)' if bucket else ''}; real TCP between real processes. "
            "No latency is emulated (`netem` is not available in this kernel)."
        )
    else:
        lines.append(
            f"- Network: **loopback** (all workers on this machine's `lo`, no bandwidth limit; "
            f"`--bandwidth {setup['bandwidth']}` was not applied). Reason: {setup['network_reason']}"
        )
    lines += [
        f"- Main job: `gradzip train`, {setup['steps']} steps, seed {setup['seed']}, the same data order in every "
        f"run; training options: {setup['train_options'] or 'defaults'}.",
        f"- Machine: {_machine(setup['cpu_count'], setup['world_size'], setup.get('host_cpus'))}"
        + (" (compute alone is measured on the same workers in the `limit` row)." if has_limit else
           "; no `limit` row (`--no-limit`), so compute alone was not measured."),
        *([f"- Link schedule: `{setup['link_schedule']}` (STEP:RATE) in every run, each run starting at "
             f"{setup['bandwidth']}; the changes as made are listed below."] if setup.get("link_schedule") else []),
        f"- Command: `{setup['command']}`",
        *([f"- This report: `{setup['report_command']}`, from the runs above without training again."]
          if setup.get("report_command") else []),
        f"- Target validation loss: {_num(target['target_loss'], '.4f', 'none')} ({target['target_source']}).",
        "",
        "## Results",
        "",
        table(rows, wire=emulated),
        "",
    ]
    if setup.get("link_schedule"):
        lines += ["## Link changes", "",
                  "Per run, each change of the link's rate as made: the step it was asked for, and the last step "
                  "recorded before it began and after it ended (the first step at the new rate is one after one of "
                  "them).", ""]  # fmt: skip
        for r in rows:
            changes = r.get("link_changes") or []
            made = "; ".join(f"{c['rate']} for step {c['step']} (recorded {c['recorded_before']} -> "
                             f"{c['recorded_after']}, {c['seconds']:.1f} s)" for c in changes)  # fmt: skip
            lines.append(f"- `{r['compressor']}`: {made or 'none made'}")
        lines.append("")
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        lines += ["## Runs that did not finish", ""]
        lines += [f"- `{r['compressor']}`: **{r['status']}** after {r['steps']} steps: {r['error']}" for r in bad]
        lines.append("")
    lines += [
        "## How to read it",
        "",
        "- `wall s`: training wall time (start-up and the first evaluation excluded). "
        "`step s`: median wall time of one training step on rank 0. `speedup`: step time of `none` / this run's. "
        + ("`of limit`: speedup / the `limit` row's speedup, where `limit` trains with no gradient exchange at all "
           "(compute alone, the largest speedup any compression could give on this link)." if has_limit else
           "`of limit` and `compute util` need the `limit` row, which this comparison left out."),
        "- `time to target s`: training wall time at the first validation pass (every "
        f"{setup['eval_every']} steps) at or below the target; `vs none`: time of `none` / this run's. "
        + ("`compute util`: mean step time of `limit` (compute alone) / this run's mean step time (means, since "
           "a DiLoCo entry exchanges on one step in H, which a median hides); above 100% where this run's steps "
           "were quicker than the limit's own, which happens when the exchange is nearly free and the machine's "
           "noise decides (on loopback, on shared cores)." if has_limit else ""),
        "- `compute / codec / comm s`: compute alone (forward + backward, measured before training), compress + "
        "decompress, and time with a collective in flight (overlaps the backward pass), medians per step.",
        "- `payload MB/rank`: bytes the hook handed to collectives over the run; `sent MB/rank`: what those "
        "collectives send per rank by their formulas (a ring all_reduce 2 (N-1)/N times its payload, an all_gather "
        "N-1 times). PyTorch's PowerSGD hook reports neither (`unknown`).",
    ]
    if emulated:
        lines.append(
            "- `wire MB/rank`: bytes each host's interface sent during the run (`tx_bytes`, Ethernet frames with "
            "IP/TCP headers and ACKs), mean over hosts, start-up included; "
            + ("`wire for exchange` subtracts the `limit` row's (same rendezvous and initial parameter broadcast, "
               "no gradient exchange); it exceeds `sent` by the Ethernet, IP and TCP headers and the ACKs (about "
               "5 %)." if has_limit else "`wire for exchange` needs the `limit` row, which this comparison left out.")
        )
    else:
        lines.append("- Wire bytes are not counted on loopback (other processes share the interface).")
    lines += [
        *(["- The `limit` row's workers never exchange gradients, so their replicas drift apart; its loss is not "
           "a result, only its step time is."] if has_limit else []),
        *(["- Timings come from one run each on a shared machine; step times are medians, time to target is a "
           "single measurement."] if setup.get("repeats", 1) == 1 else [
           f"- Every row ran {setup['repeats']} times, in rounds (each round runs every row once, in the order of "
           "the table), on a shared machine. Each round's figures are compared within the round (compute "
           "utilisation against that round's `limit`); the table gives the median over the rounds, and in "
           "brackets the smallest and largest round of compute utilisation and time to target. Losses and bytes "
           "are those of the first round (losses do not depend on timing), as are the plots."]),
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _cumulative_bytes(result: RunResult, row: dict[str, Any], wire: bool) -> list[float] | None:
    """Bytes per rank after each step: the run's measured exchange bytes spread over the steps in
    proportion to the per-step payload, or the payload itself; None where the per-step payload
    is unknown (the run is then drawn as one point at its total)."""
    payload = [r.get("payload_bytes", 0) for r in result.records]
    if row["payload_bytes"] is None or sum(payload) == 0:
        return None
    total = row["wire_bytes_exchange"] if wire else None
    scale = total / sum(payload) if total else 1.0
    out, acc = [], 0.0
    for value in payload:
        acc += value * scale
        out.append(acc)
    return out


def write_plots(out: Path, results: Sequence[RunResult], rows: Sequence[dict[str, Any]], setup: dict[str, Any],
                target_loss: float | None) -> list[Path]:  # fmt: skip
    """``loss_vs_time.png`` and ``loss_vs_bytes.png``: validation loss of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wire = setup["network"] == "emulated"
    title = f"{setup['world_size']} workers, {setup['link']}"
    paths = []
    fig_t, ax_t = plt.subplots(figsize=(8, 4.8))
    fig_b, ax_b = plt.subplots(figsize=(8, 4.8))
    for i, (result, row) in enumerate(zip(results, rows)):
        val = [r for r in result.records if r.get("val_loss") is not None]
        if not val:
            continue
        color = f"C{i % 10}"
        style = "--" if row["compressor"] == LIMIT else "-"
        label = row["compressor"] + ("" if row["status"] == "ok" else f" ({row['status']})")
        start = (result.summary or {}).get("initial_val_loss")
        times = ([0.0] if start is not None else []) + [r["elapsed_s"] for r in val]
        losses = ([start] if start is not None else []) + [r["val_loss"] for r in val]
        ax_t.plot(times, losses, style, marker="o", markersize=3, color=color, label=label)
        if row["compressor"] == LIMIT:
            continue
        cumulative = _cumulative_bytes(result, row, wire)
        if cumulative:
            index = {r["step"]: k for k, r in enumerate(result.records)}
            xs = [cumulative[index[r["step"]]] / 1e6 for r in val]
            ax_b.plot(xs, [r["val_loss"] for r in val], style, marker="o", markersize=3, color=color, label=label)
        elif wire and row["wire_bytes_exchange"] and row["final_val_loss"] is not None:
            ax_b.plot([row["wire_bytes_exchange"] / 1e6], [row["final_val_loss"]], marker="*", markersize=10,
                      linestyle="none", color=color, label=f"{label} (end of run only)")  # fmt: skip
    for ax in (ax_t, ax_b):
        if target_loss is not None:
            ax.axhline(target_loss, color="grey", linestyle=":", linewidth=1, label=f"target {target_loss:.3f}")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_t.set_xlabel("training wall time (s)")
    ax_t.set_title(f"Loss against time: {title}")
    ax_b.set_xscale("log")
    ax_b.set_xlabel("MB per rank on the wire for the exchange (tx_bytes)" if wire else "payload MB per rank (hook count)")
    ax_b.set_title(f"Loss against bytes: {title}")
    for fig, name in ((fig_t, "loss_vs_time.png"), (fig_b, "loss_vs_bytes.png")):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    per_layer = _plot_layer_ratios(out / "layer_ratios.png", results, title)
    return paths + ([per_layer] if per_layer else [])


def _plot_layer_ratios(path: Path, results: Sequence[RunResult], title: str) -> Path | None:
    """``layer_ratios.png``: a heatmap per entry that ran a per-layer schedule (as each run's own
    ``layer_ratios.png``), one colour scale for all; None, writing nothing, without such an entry."""
    import matplotlib.pyplot as plt

    from gradzip.lab.train import layer_ratios

    panels = [(r.label, ratios) for r in results if (ratios := layer_ratios.layer_ratios(r.records)) is not None]
    if not panels:
        return None
    norm = layer_ratios.color_scale([ratios for _, ratios in panels])
    height = max(layer_ratios.height(ratios) for _, ratios in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1.5, height), squeeze=False,
                             layout="constrained")  # fmt: skip
    for i, (ax, (label, ratios)) in enumerate(zip(axes[0], panels)):
        mesh = layer_ratios.draw(ax, ratios, norm)
        ax.set_title(label, fontsize=9)
        if i:
            ax.set_ylabel("")
    fig.colorbar(mesh, ax=list(axes[0]), label="compression ratio (dense / payload bytes)")
    fig.suptitle(f"Compression ratio per layer: {title}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
