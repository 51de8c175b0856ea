"""Makes `extproc_support` (message builders shared by these tests) importable under
pytest's importlib import mode."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
