"""``gradzip compare``: time to loss of several compressors side by side on one (slow) network.

Each entry runs the main job (``gradzip train``) with the same seed and data order on the same
workers: on emulated hosts with limited links where root and network namespaces allow (see
:mod:`gradzip.lab.cluster`), else on loopback, which the report states. A ``limit`` row trains with
no gradient exchange, so every speedup can be read against the largest one possible.
"""

from gradzip.lab.compare.analysis import compare_rows, time_to_target
from gradzip.lab.compare.core import CompareConfig, rewrite_report, run_compare, split_compressors

__all__ = ["CompareConfig", "compare_rows", "rewrite_report", "run_compare", "split_compressors", "time_to_target"]
