"""Test setup: the build-time `generator` package is imported from the source tree; `redfuser_ops` is always the
installed package (the source tree's copy has no compiled library). `python -m pytest` puts the working directory
first on sys.path; it is moved to the end, so that the installed package wins and `generator` is still found."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_here = {str(ROOT), "", "."}
sys.path[:] = [p for p in sys.path if p not in _here and os.path.abspath(p or ".") != str(ROOT)]
sys.path.append(str(ROOT))
