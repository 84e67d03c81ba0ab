"""pytest plugin loaded (``-p peer_suites_offline``) in BOTH runs of a peer's suite, stock and patched.

It changes nothing about training; it only makes the two runs comparable and recordable:

- ``datasets.load_dataset(id, config, split=..., streaming=...)`` for an id the stand-ins hold reads the local
  parquet files instead of the hub (models need nothing here: ``HF_HUB_CACHE`` points at the stand-in hub cache and
  ``HF_HUB_OFFLINE=1``, set by the runner);
- every test's outcome goes to a JSON-lines file (``$PEER_SUITES_RECORD``): node id, phase, outcome, one-line reason;
- a test running longer than ``$PEER_SUITES_TIMEOUT`` seconds is interrupted (SIGALRM -> an exception in the test),
  so a test waiting on a network that is not there fails instead of hanging the suite;
- the session's facts (which transformers/TRL/hf_gradfix were imported, whether hf_gradfix is patched) go to
  ``$PEER_SUITES_META``, so the report can show the patched run really ran patched and the stock run stock.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

_STORE = Path(os.environ.get("PEER_SUITES_DATASETS", "/nonexistent"))
_RECORD = os.environ.get("PEER_SUITES_RECORD")
_META = os.environ.get("PEER_SUITES_META")
_TIMEOUT = float(os.environ.get("PEER_SUITES_TIMEOUT", "0") or 0)


# ----------------------------------------------------------------------------------------------------------------------
# datasets.load_dataset -> local parquet files
# ----------------------------------------------------------------------------------------------------------------------


def _install_load_dataset() -> None:
    import datasets
    import datasets.load

    original = datasets.load.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        local = _STORE / str(path).replace("/", "--") if isinstance(path, str) else None
        if local is None or not local.is_dir() or args or kwargs.get("data_files") is not None:
            return original(path, name, *args, **kwargs)
        configs = sorted(p.name for p in local.iterdir() if p.is_dir())
        config = name or kwargs.pop("name", None)
        if config is None:
            config = "default" if "default" in configs else (configs[0] if len(configs) == 1 else None)
        if config not in configs:
            raise ValueError(f"offline stand-in of {path!r} has no config {config!r} (it has {configs})")
        files = {p.stem: str(p) for p in sorted((local / config).glob("*.parquet"))}
        passed = {k: kwargs[k] for k in ("split", "streaming", "features", "keep_in_memory", "num_proc") if k in kwargs}
        return original("parquet", data_files=files, **passed)

    load_dataset.__wrapped__ = original
    datasets.load_dataset = load_dataset
    datasets.load.load_dataset = load_dataset


_install_load_dataset()  # at import (before the test modules do ``from datasets import load_dataset``)


def _install_compat() -> None:
    """Names the peers' test helpers import that the installed peer no longer has (same in both runs).

    The newest TRL tests to be had (1.10.0.dev0) are older than the installed TRL (1.16.0), whose
    ``trl.import_utils`` dropped ``is_joblib_available``; TRL's ``tests/testing_utils.py`` imports it at module
    level, so without it no TRL test file would even import. It only gates ``require_sklearn``.
    """
    import importlib.util

    try:
        import trl.import_utils as trl_imports
    except ImportError:
        return
    if not hasattr(trl_imports, "is_joblib_available"):
        trl_imports.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None


_install_compat()

_STUBBED: list[str] = []


class PeerSuitesRemovedName(Exception):
    """A test used a name its file imports from the peer that the installed peer no longer has."""


def _stub(qualname: str):
    def removed(*args, **kwargs):
        raise PeerSuitesRemovedName(f"{qualname} does not exist in the installed version (stubbed by the runner)")

    removed.__qualname__ = removed.__name__ = qualname.rsplit(".", 1)[-1]
    return removed


def _stub_removed_names(test_dirs) -> None:
    """Give every ``from trl... import NAME`` / ``from transformers... import NAME`` of the test files a stand-in
    when the installed package lacks NAME, so that one removed helper does not stop a whole file from importing: the
    tests that use it fail with ``PeerSuitesRemovedName`` in both runs; the others run. The names are reported.
    """
    import ast
    import importlib

    for directory in test_dirs:
        for path in sorted(Path(directory).glob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in ("trl", "transformers")):
                    continue
                try:
                    module = importlib.import_module(node.module)
                except Exception:
                    continue  # a whole module gone: the file fails to import in both runs, as it would anyway
                for alias in node.names:
                    if alias.name == "*" or hasattr(module, alias.name):
                        continue
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except Exception:
                        setattr(module, alias.name, _stub(f"{node.module}.{alias.name}"))
                        _STUBBED.append(f"{node.module}.{alias.name}")


def pytest_configure(config):
    dirs = {Path(str(a).split("::")[0]).resolve().parent for a in config.args}
    _stub_removed_names(sorted(dirs))


def pytest_collection_finish(session):
    # Every module the tests need is imported now. Freezing those objects keeps them out of later garbage
    # collections: the peers' fixtures call gc.collect() after every test (TRL's cleanup_gpu), and with torch,
    # dynamo and transformers loaded each full collection costs 0.5-1.5 s here. Nothing the tests create is frozen.
    import gc

    gc.collect()
    gc.freeze()


# ----------------------------------------------------------------------------------------------------------------------
# Per-test timeout
# ----------------------------------------------------------------------------------------------------------------------


class PeerSuitesTimeout(Exception):
    """The test ran past the runner's per-test limit."""


def _on_alarm(signum, frame):
    raise PeerSuitesTimeout(f"test exceeded the runner's {_TIMEOUT:g} s per-test timeout")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    armed = _TIMEOUT > 0 and hasattr(signal, "SIGALRM")
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, _TIMEOUT)
    try:
        yield
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------------------------------------------------
# Recording outcomes and session facts
# ----------------------------------------------------------------------------------------------------------------------


def _one_line(report) -> str:
    """The reason in one line: the exception of a failure (its first line), the reason of a skip."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:400]


def _write(entry: dict) -> None:
    if _RECORD:
        with open(_RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def pytest_runtest_logreport(report):
    entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
             "duration": round(report.duration, 3), "reason": ""}
    if report.outcome != "passed" or hasattr(report, "wasxfail"):
        entry["reason"] = _one_line(report) or getattr(report, "wasxfail", "")
    if hasattr(report, "wasxfail"):
        entry["xfail"] = True
    _write(entry)


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0,
                "reason": _one_line(report)})


def pytest_sessionstart(session):
    if not _META:
        return
    facts = {"python": sys.executable, "argv": sys.argv[1:]}
    for module in ("transformers", "trl", "accelerate", "datasets", "torch", "peft"):
        try:
            imported = __import__(module)
            facts[module] = {"version": getattr(imported, "__version__", "?"), "file": imported.__file__}
        except Exception as exc:  # a peer that is not installed: say so
            facts[module] = {"error": f"{type(exc).__name__}: {exc}"}
    gradfix = sys.modules.get("hf_gradfix")
    facts["stubbed_names"] = _STUBBED
    facts["hf_gradfix"] = (
        {"file": gradfix.__file__, "patched": bool(gradfix.is_patched())} if gradfix else {"imported": False}
    )
    Path(_META).write_text(json.dumps(facts, indent=1))
