"""The suite's folders on sys.path: tests/support and every room's folder (tests/loss, tests/packing, ...).

Test modules import the support modules, and a few other rooms' test modules (tolerances, references), by bare name.
tests/conftest.py calls :func:`add` for pytest; code outside pytest that imports them (benchmarks/, scripts/gpu_check)
puts tests/support on sys.path and calls it too. Basenames are unique across these folders (pytest's default prepend
import mode needs that).
"""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent


def folders() -> list[Path]:
    """tests/support first, then the rooms in name order (every folder of tests/ but support and hidden ones)."""
    rooms = sorted(p for p in TESTS.iterdir()
                   if p.is_dir() and p.name != "support" and not p.name.startswith((".", "__")))
    return [SUPPORT, *rooms]


def add() -> None:
    """Put :func:`folders` at the front of sys.path (each once, in that order)."""
    for folder in reversed(folders()):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
