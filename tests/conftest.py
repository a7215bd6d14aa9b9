"""Test setup: the build-time `generator` package is imported from the source tree; `redfuser_ops` is always the
installed package (the source tree's copy has no compiled library), so the repo root is appended, not prepended."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
