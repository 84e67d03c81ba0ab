"""The suite's sys.path, and per-file test time for splitting the CI run into balanced streams (scripts/test.sh reads
these files).

The test files live in one folder per room of the package (tests/loss, tests/packing, ...); the workers, harnesses and
references they share in tests/support. Test modules import support modules, and a few other rooms' test modules
(tolerances, references), by bare name, so every one of these folders goes on sys.path here, whichever file pytest is
asked to run (tests/support/suite_paths.py; their basenames are unique: pytest's default prepend import mode needs
that).

Set ``HF_GRADFIX_TIMINGS_DIR`` and each pytest process writes ``timings-<pid>.json`` there at its end:
``{"tests/<room>/test_x.py": seconds, ...}`` (setup + call + teardown of every test in the file). Off by default.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

_SUPPORT = str(Path(__file__).resolve().parent / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
import suite_paths  # noqa: E402  (tests/support/suite_paths.py)

suite_paths.add()

_seconds_per_file: dict[str, float] = defaultdict(float)

# The kernel stand-ins (pure-PyTorch causal_conv1d / fla / mamba_ssm packages) must never be imported by the suite's
# own processes: `--doctest-modules tests` would put their folder on sys.path, and transformers would then bind them
# as the installed kernels for every hybrid model. tests/packing/test_packing_hybrid_kernels.py runs them in a process
# of their own (tests/project/test_layout.py checks that this process has not imported them).
collect_ignore = ["support/kernel_standins"]


def pytest_runtest_logreport(report):
    if os.environ.get("HF_GRADFIX_TIMINGS_DIR"):
        _seconds_per_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("HF_GRADFIX_TIMINGS_DIR")
    if folder and _seconds_per_file:
        Path(folder).mkdir(parents=True, exist_ok=True)
        rounded = {name: round(s, 1) for name, s in sorted(_seconds_per_file.items(), key=lambda kv: -kv[1])}
        (Path(folder) / f"timings-{os.getpid()}.json").write_text(json.dumps(rounded, indent=1) + "\n")
