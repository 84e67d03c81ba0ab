"""Per-file test time, for splitting the CI run into balanced streams (scripts/test.sh reads these files).

Set ``HF_GRADFIX_TIMINGS_DIR`` and each pytest process writes ``timings-<pid>.json`` there at its end:
``{"tests/test_x.py": seconds, ...}`` (setup + call + teardown of every test in the file). Off by default.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

_seconds_per_file: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    if os.environ.get("HF_GRADFIX_TIMINGS_DIR"):
        _seconds_per_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("HF_GRADFIX_TIMINGS_DIR")
    if folder and _seconds_per_file:
        Path(folder).mkdir(parents=True, exist_ok=True)
        rounded = {name: round(s, 1) for name, s in sorted(_seconds_per_file.items(), key=lambda kv: -kv[1])}
        (Path(folder) / f"timings-{os.getpid()}.json").write_text(json.dumps(rounded, indent=1) + "\n")
