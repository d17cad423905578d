"""Drawing SEPARATE's projection against multiplying by it, one CPU thread, side by side.

    OMP_NUM_THREADS=1 python benchmarks/separate_projection.py

For each matrix ``m x n`` (fp32) at ``r = 4``: the median time of drawing ``A`` (``n x r``, in
the codec's row blocks) and of ``G @ A`` with ``A`` already drawn, rows interleaved, and their
ratio. Drawing is paid twice per step (encode and decode), the product once per encode.
"""

from __future__ import annotations

import statistics
import time

import torch

from gradzip.compressors.separate import project, projection_blocks


def _median_s(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    r = 4
    print(f"{'m x n':>14} {'draw A ms':>10} {'G@A ms':>9} {'project ms':>11} {'draw/matmul':>12}")
    for m, n in [(64, 4096), (256, 4096), (768, 3072), (3072, 768), (50304, 128)]:
        g = torch.randn(m, n)
        a = torch.cat([b for _, b in projection_blocks(0, 0, "k", n, r)])
        draw = matmul = whole = 0.0
        for _ in range(3):  # interleaved rounds
            draw += _median_s(lambda n=n: [b for _, b in projection_blocks(0, 0, "k", n, r)])
            matmul += _median_s(lambda a=a, g=g: (a.T @ g.T).T)
            whole += _median_s(lambda g=g: project(g, 0, 0, "k", r))
        print(f"{m:>6} x {n:<6} {draw / 3e-3:>10.3f} {matmul / 3e-3:>9.3f} {whole / 3e-3:>11.3f} {draw / matmul:>12.2f}")


if __name__ == "__main__":
    main()
