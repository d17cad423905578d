"""One row of properties per registered codec, shared by ``gradzip list`` and the docs' codec page.

Each codec is built with its default parameters and its payload is computed for a 1 M element
fp32 tensor. PowerSGD compresses matrices, not flat tensors: its row gives the payload for a
1024 x 1024 fp32 matrix (the same 1 M elements) at its default rank, and says so.
"""

from __future__ import annotations

import re

from gradzip.compressors import REGISTRY, build

EXAMPLE_NUMEL = 1 << 20
#: the matrix shape of the example tensor for codecs that compress matrices
EXAMPLE_MATRIX = (1024, 1024)

_ARXIV = re.compile(r"arXiv[ :]*(\d{4}\.\d{4,5})")


def codec_rows(numel: int = EXAMPLE_NUMEL) -> list[dict]:
    """One row per registered codec, sorted by name, built with its default parameters.

    Args:
        numel: elements of the example fp32 tensor (codecs with ``matrix_payload_nbytes`` use
            :data:`EXAMPLE_MATRIX` instead).

    Returns:
        Dicts with ``codec`` (canonical spec), ``defaults`` (``key=value,...``), the declared
        properties ``aggregatable``, ``unbiased``, ``shared_seed``, ``error_feedback``,
        ``payload_bytes_1m`` (bytes on the wire), ``compression_ratio`` (fp32 bytes / payload
        bytes), ``example`` (what the payload was computed for), ``summary`` (the first line of
        the codec's docstring) and ``arxiv`` (the first arXiv id its docstring cites, or "").
    """
    rows = []
    for name in sorted(REGISTRY):
        codec = build(name)
        doc = type(codec).__doc__ or ""
        matrix = hasattr(codec, "matrix_payload_nbytes")
        payload = codec.matrix_payload_nbytes(EXAMPLE_MATRIX) if matrix else codec.payload_nbytes(numel)
        paper = _ARXIV.search(doc)
        rows.append(
            {
                "codec": codec.spec,
                "defaults": ",".join(f"{k}={_text(v)}" for k, v in codec.params.items()),
                "aggregatable": codec.aggregatable,
                "unbiased": codec.unbiased,
                "shared_seed": codec.needs_shared_seed,
                "error_feedback": codec.error_feedback,
                "payload_bytes_1m": payload,
                "compression_ratio": numel * 4 / payload,
                "example": f"{EXAMPLE_MATRIX[0]}x{EXAMPLE_MATRIX[1]} matrix" if matrix else f"{numel} elements",
                "summary": doc.strip().splitlines()[0] if doc.strip() else "",
                "arxiv": paper.group(1) if paper else "",
            }
        )
    return rows


def _text(value) -> str:
    """A default as shown: booleans lower-case, floats to 4 significant digits (5/6 as 0.8333)."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:.4g}" if isinstance(value, float) else str(value)
