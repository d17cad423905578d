"""The compression ratio of every layer at every step, under a per-layer schedule (``kimad``,
``legacy``, ``edgc``): ``layer_ratios.png`` of ``gradzip train`` and ``gradzip compare``.

The figures come from ``metrics.jsonl``: under a per-layer plan each step's record carries, per
bucket, the exchange of each of its layers (``buckets[name]["layers"]``: ``codec``, ``numel``,
``payload_bytes``, the bytes the codec handed to the collectives for that layer, PowerSGD's
factors by the layer's matrix shape), and the bucket's ``dense_bytes``. A layer's ratio is its
dense bytes over its payload bytes, the dense bytes being ``numel`` times the gradient's element
size (the bucket's ``dense_bytes`` over its elements). The bytes are those the exchange recorded,
not recomputed from the plan's specs: the same figure for every codec, PowerSGD (whose payload
depends on the layer's shape, not recorded) included. Layers are named ``bucket.layer`` (the
layer's index in its DDP bucket, which holds the parameters in reverse order of the model) with
their size; parameter names are not recorded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LayerRatios:
    """Per layer, the compression ratio at each step.

    Attributes:
        steps: the steps, in the records' order.
        labels: one per layer, ``"bucket.layer (numel)"``, buckets in numeric order.
        numels: the layers' sizes in elements, as ``labels``.
        ratios: ``ratios[layer][i]`` at ``steps[i]``: dense bytes / payload bytes (1.0 for a layer
            sent dense in fp32); NaN where the layer was not exchanged at that step.
    """

    steps: list[int]
    labels: list[str]
    numels: list[int]
    ratios: list[list[float]]


def _bucket_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _size(numel: int) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if numel >= scale:
            return f"{numel / scale:.3g}{unit}"
    return str(numel)


def layer_ratios(records: Sequence[dict[str, Any]]) -> LayerRatios | None:
    """The ratios of every layer of every per-layer bucket in ``records`` (see the module
    docstring); None when no record carries per-layer bytes (no per-layer schedule)."""
    layouts: dict[str, list[int]] = {}  # bucket -> its layers' numel (from its first record)
    for record in records:
        for name, bucket in (record.get("buckets") or {}).items():
            if bucket.get("layers") and name not in layouts:
                layouts[name] = [layer["numel"] for layer in bucket["layers"]]
    if not layouts:
        return None
    order = sorted(layouts, key=_bucket_order)
    rows = {(name, i): [] for name in order for i in range(len(layouts[name]))}
    steps = []
    for record in records:
        steps.append(record["step"])
        buckets = record.get("buckets") or {}
        for name in order:
            bucket = buckets.get(name) or {}
            layers = bucket.get("layers") or []
            numel = sum(layer["numel"] for layer in layers)
            itemsize = bucket.get("dense_bytes", 0) / numel if numel else 0
            for i in range(len(layouts[name])):
                layer = layers[i] if len(layers) == len(layouts[name]) else None
                ok = layer is not None and itemsize and layer["payload_bytes"]
                rows[(name, i)].append(layer["numel"] * itemsize / layer["payload_bytes"] if ok else math.nan)
    labels = [f"{name}.{i} ({_size(layouts[name][i])})" for name, i in rows]
    return LayerRatios(steps, labels, [layouts[name][i] for name, i in rows], list(rows.values()))


def draw(ax, ratios: LayerRatios, norm) -> Any:
    """``ratios`` as a heatmap on ``ax``: x the step, a row per layer, the colour the ratio on
    ``norm`` (a shared scale for several runs). Returns the mesh (for a colour bar)."""
    import numpy as np

    steps = np.asarray(ratios.steps, dtype=float)
    edges = np.concatenate([steps - 0.5, steps[-1:] + 0.5])
    rows = np.arange(len(ratios.labels) + 1) - 0.5
    mesh = ax.pcolormesh(edges, rows, np.ma.masked_invalid(np.asarray(ratios.ratios, dtype=float)), norm=norm,
                         cmap="viridis", shading="flat")  # fmt: skip
    # every layer named up to MAX_NAMES rows; beyond, the largest layers of each stretch, so the
    # names left out are the small ones (a GPT block alternates weights and biases)
    shown = named_rows(ratios.numels)
    ax.set_yticks(shown)
    ax.set_yticklabels([ratios.labels[i] for i in shown], fontsize=6)
    ax.invert_yaxis()  # bucket 0's first layer at the top
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("layer (bucket.index, size)")
    return mesh


#: the most layer names on the heatmap's axis (a row of 6-point text each at the figure's height)
MAX_NAMES = 90


def named_rows(numels: Sequence[int]) -> list[int]:
    """The rows whose layer is named: all up to :data:`MAX_NAMES`; beyond, the rows split into
    :data:`MAX_NAMES` equal stretches and the largest layer of each named."""
    n = len(numels)
    if n <= MAX_NAMES:
        return list(range(n))
    bounds = [round(k * n / MAX_NAMES) for k in range(MAX_NAMES + 1)]
    return [max(range(lo, hi), key=lambda i: numels[i]) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def height(ratios: LayerRatios) -> float:
    """Inches of a figure holding the heatmap of ``ratios``: a row of text per layer, within 3 to 12."""
    return max(3.0, min(12.0, 1.5 + 0.12 * len(ratios.labels)))


def color_scale(all_ratios: Sequence[LayerRatios]):
    """One logarithmic colour scale over every finite ratio of ``all_ratios`` (at least 1 to 2)."""
    from matplotlib.colors import LogNorm

    values = [v for r in all_ratios for row in r.ratios for v in row if math.isfinite(v) and v > 0]
    low, high = (min(values), max(values)) if values else (1.0, 2.0)
    return LogNorm(vmin=min(low, 1.0), vmax=max(high, 2.0))


def plot(records: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """``path`` (a PNG) with the heatmap of :func:`layer_ratios`; False, writing nothing, when the
    records carry no per-layer bytes."""
    ratios = layer_ratios(records)
    if ratios is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, height(ratios)))
    mesh = draw(ax, ratios, color_scale([ratios]))
    fig.colorbar(mesh, ax=ax, label="compression ratio (dense / payload bytes)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
