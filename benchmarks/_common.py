"""What the benchmark scripts share: where they live and write, the repository on ``sys.path``, the command and
version line a results file opens with, markdown table rows, and small timing / memory readings.

Apart so each script keeps only what it measures.  A script imports it as ``from _common import ...``:
``python benchmarks/<script>.py`` puts ``benchmarks/`` first on ``sys.path``.  Standard library only
(:func:`versions` imports the modules it names: the script's own, already loaded).

>>> md_row(["a", 1, 2.5])
'| a | 1 | 2.5 |'
>>> results_path("x.md").endswith("benchmarks/results/x.md")
True
"""

from __future__ import annotations

import importlib
import platform
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent  # benchmarks/
ROOT = HERE.parent  # the repository: hf_gradfix/ and tests/ live here
RESULTS = HERE / "results"





def results_path(name: str) -> str:
    """``benchmarks/results/<name>`` as a string: the default of a script's ``--out``."""
    return str(RESULTS / name)


def on_path(*folders: Path | str) -> None:
    """Put folders first on ``sys.path`` (the repository root: hf_gradfix from this checkout without installing it;
    ``tests/support``: the harness a report script reuses)."""
    for folder in reversed(folders):
        sys.path.insert(0, str(folder))


def versions(*modules: str) -> str:
    """``"torch 2.x, transformers 5.y"``: the modules' versions, in the order given."""
    return ", ".join(f"{m} {importlib.import_module(m).__version__}" for m in modules)


def cpu_name() -> str:
    """The processor as ``platform`` names it (its machine type where it does not)."""
    return platform.processor() or platform.machine()


def command_line() -> str:
    """``python benchmarks/<script>.py <its arguments>``, as this process was started."""
    return f"python {' '.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}"


def quoted_command(script: str, argv: Iterable[str]) -> str:
    """``python benchmarks/<script> <argv, shell-quoted>``: the command that reproduces a results file."""
    return " ".join([f"python benchmarks/{script}", *map(shlex.quote, argv)])


def md_row(cells: Iterable) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def best_time(fn: Callable[[], object], repeats: int = 1, before: Callable[[], object] | None = None):
    """``(fastest seconds, last result)`` of ``repeats`` calls of ``fn``; ``before`` runs untimed ahead of each."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def median_time(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """The median seconds of ``repeats`` calls of ``fn``; ``before`` runs untimed ahead of each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
