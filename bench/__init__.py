"""Benchmarks, the static SASS check and the GPU run script of redfuser-ops (see docs/benchmarks.md).

Everything here measures the INSTALLED package. `python -m bench.<tool>` run from the repository root puts
the root first on sys.path, where the source tree's `redfuser_ops/` (which holds no compiled library)
would shadow the installed one; importing `bench` therefore moves the root to the end of sys.path, as
tests/conftest.py does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _installed_package_first() -> None:
    here = {str(ROOT), "", "."}
    keep = [p for p in sys.path if p not in here and os.path.abspath(p or ".") != str(ROOT)]
    if len(keep) != len(sys.path) or sys.path[-1:] != [str(ROOT)]:
        sys.path[:] = keep + [str(ROOT)]


_installed_package_first()
