"""MkDocs hooks: the codec table from the registry, and the measured studies as pages.

- ``<!-- codec-table -->`` in a page becomes the table of every registered codec, from
  :func:`gradzip.compressors.catalog.codec_rows` (the rows ``gradzip list`` prints), so the
  page cannot drift from the code.
- ``<!-- host-reads-table -->`` becomes the table of what each codec's path through a hook still
  reads on the host on CUDA (its ``host_reads`` declaration, which tests check on meta tensors).
- ``benchmarks/results/<study>/`` lives beside the scripts that produce it, outside ``docs/``.
  Its files join the site under ``benchmarks/results/...``, so a page links to a study with the
  same relative path (``../benchmarks/results/<study>/README.md``) that works in the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- codec-table -->"
HOST_READS_MARKER = "<!-- host-reads-table -->"


def codec_table() -> str:
    """The registry's codecs as a Markdown table (built with their default parameters)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # document this checkout, not another installed copy
    from gradzip.compressors.catalog import EXAMPLE_NUMEL, codec_rows

    yes = {True: "yes", False: "-"}
    lines = [
        "| codec | defaults | what it does | paper | aggregatable | unbiased | shared seed "
        "| error feedback | bytes for 1 M fp32 | ratio |",
        "|---|---|---|---|---|---|---|---|---:|---:|",
    ]
    for r in codec_rows():
        name = r["codec"].split(":")[0]
        paper = f"[arXiv {r['arxiv']}](https://arxiv.org/abs/{r['arxiv']})" if r["arxiv"] else "-"
        matrix = f" ({r['example'].replace('x', ' x ', 1)})" if "matrix" in r["example"] else ""
        summary = r["summary"].replace("|", "\\|")
        lines.append(
            f"| `{name}` | `{r['defaults'] or '-'}` | {summary} | {paper} | {yes[r['aggregatable']]} "
            f"| {yes[r['unbiased']]} | {yes[r['shared_seed']]} | {yes[r['error_feedback']]} "
            f"| {r['payload_bytes_1m']:,}{matrix} | {r['compression_ratio']:.1f}x |"
        )
    lines.append("")
    lines.append(
        f"Bytes: the payload for a {EXAMPLE_NUMEL:,} element fp32 tensor "
        f"({EXAMPLE_NUMEL * 4:,} bytes dense), or for the matrix named where a codec compresses matrices."
    )
    return "\n".join(lines)


def host_reads_table() -> str:
    """What each registered codec reads on the host on CUDA, as a Markdown table."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from gradzip.compressors import REGISTRY

    lines = ["| codec | reads on the host on CUDA (each read waits for the device) |", "|---|---|"]
    for name in sorted(REGISTRY):
        reads = REGISTRY[name].host_reads
        lines.append(f"| `{name}` | {reads if reads else 'nothing'} |")
    return "\n".join(lines)


def on_files(files: Files, config) -> Files:
    """Add every file of ``benchmarks/results/`` to the site (pages for its Markdown)."""
    docs_dir = Path(config["docs_dir"]).resolve()
    for path in sorted(RESULTS.rglob("*")):
        if not path.is_file() or path.suffix not in {".md", ".png", ".json", ".txt"}:
            continue
        rel = path.relative_to(ROOT).as_posix()
        dest = rel[: -len(".md")] + ".html" if rel.endswith(".md") else rel
        if rel.endswith("/README.md"):
            dest = rel[: -len("README.md")] + "index.html"
        src_uri = Path("..", *Path(rel).parts).as_posix()  # relative to docs/, as pages link to it
        assert (docs_dir / src_uri).resolve() == path
        # Not in the nav: docs/studies.md lists the studies and links each one.
        files.append(
            File(
                src_uri, src_dir=str(docs_dir), dest_dir=config["site_dir"], use_directory_urls=False,
                dest_uri=dest, inclusion=InclusionLevel.NOT_IN_NAV,
            )
        )
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, codec_table())
    if HOST_READS_MARKER in markdown:
        markdown = markdown.replace(HOST_READS_MARKER, host_reads_table())
    return markdown
