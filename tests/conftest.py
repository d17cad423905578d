"""Suite-wide setting: codec kernels run eagerly here, since compiling each one costs seconds
(``GRADZIP_COMPILE=0``, inherited by spawned ranks). ``tests/test_fused.py`` turns compilation on
and checks every compiled kernel bit for bit against its eager run."""

import os

os.environ.setdefault("GRADZIP_COMPILE", "0")
