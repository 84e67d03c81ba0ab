"""The lock files (requirements/lock-*.txt): what CI installs is what the locks say, and the locks stay inside the
ranges users install (pyproject.toml). ``scripts/lockfile.py`` reads and writes them; its drift report is checked
against a venv whose versions differ from a lock by construction."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hang_bound
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import lockfile  # noqa: E402

LOCKS = {"tf5": ROOT / "requirements" / "lock-tf5.txt", "tf457": ROOT / "requirements" / "lock-tf457.txt"}


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra if not r.startswith("hf-gradfix")]
    return reqs


@pytest.mark.parametrize("env", sorted(LOCKS))
def test_every_pin_is_inside_the_range_users_install(env):
    pins = lockfile.read_lock(LOCKS[env])
    assert {"transformers", "accelerate", "pyyaml", "peft", "datasets"} <= set(pins), sorted(pins)
    assert "torch" not in pins and "hf-gradfix" not in pins  # torch is pinned by HF_GRADFIX_TORCH
    checked = 0
    for req in _requirements():
        name = lockfile._canonical(req.name)
        if name in pins and req.specifier:
            assert Version(pins[name]) in req.specifier, f"{LOCKS[env].name}: {name}=={pins[name]} outside {req}"
            checked += 1
    assert checked >= 5
    major = Version(pins["transformers"]).major
    assert major == (5 if env == "tf5" else 4)


def test_the_tests_run_on_the_locked_versions():
    """The venv running this suite was installed with its lock (scripts/test.sh): no drift. The --latest route
    runs on purpose without the lock and says so."""
    if os.environ.get("HF_GRADFIX_LATEST") == "1":
        pytest.skip("bash scripts/test.sh --latest: the newest releases, not the lock (its drift is printed)")
    lock = LOCKS["tf5" if Version(transformers.__version__).major >= 5 else "tf457"]
    pins, installed = lockfile.read_lock(lock), lockfile.installed(Path(sys.prefix))
    drift = {n: (v, installed.get(n)) for n, v in pins.items() if installed.get(n) != v}
    assert not drift, f"this venv differs from {lock.name} (lock, installed): {drift}; fix: bash scripts/test.sh"


def test_drift_report_names_each_difference(tmp_path):
    lock = tmp_path / "lock.txt"
    pins = lockfile.read_lock(LOCKS["tf5"] if Version(transformers.__version__).major >= 5 else LOCKS["tf457"])
    pins = dict(pins, transformers="4.0.0", **{"no-such-package-xyz": "1.0"})
    pins.pop("accelerate")
    lock.write_text("# header\n" + "\n".join(f"{n}=={v}" for n, v in pins.items()) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "lockfile.py"), "drift", sys.prefix, str(lock)],
                         capture_output=True, text=True, check=True).stdout
    assert f"transformers: 4.0.0 (lock) -> {transformers.__version__} (newest)" in out
    assert "no-such-package-xyz: 1.0 (lock) -> not installed" in out
    assert "accelerate: not in the lock -> " in out


def test_freeze_writes_a_lock_that_reads_back(tmp_path):
    lock = tmp_path / "requirements" / "lock.txt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "lockfile.py"), "freeze", sys.prefix, str(lock)],
                   capture_output=True, text=True, check=True)
    text = lock.read_text()
    assert text.startswith("# lock.txt: ") and "pip freeze of a clean resolve" in text
    pins = lockfile.read_lock(lock)
    assert pins["transformers"] == transformers.__version__ and "torch" not in pins
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "lockfile.py"), "drift", str(tmp_path), str(lock)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == f"lockfile.py: {tmp_path} is not a virtualenv (no bin/python)"


def test_setup_env_passes_the_lock_as_constraints_and_refuses_a_missing_one(tmp_path):
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert '-c "$lock"' in script
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert 'HF_GRADFIX_LOCK="$TF5_LOCK"' in test_sh and 'HF_GRADFIX_LOCK="$TF457_LOCK"' in test_sh
    env = dict(os.environ, HF_GRADFIX_LOCK=str(tmp_path / "missing.txt"))
    # an existing venv (this one) so that nothing is created; the missing lock is refused before pip runs
    proc = hang_bound.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), str(Path(sys.prefix)), "dev"],
                          capture_output=True, text=True, env=env, step="setup_env.sh refuses a missing lock")
    assert proc.returncode == 2
    assert f"HF_GRADFIX_LOCK={tmp_path / 'missing.txt'}: no such file" in proc.stderr


def test_the_newest_release_canary_names_tests_that_exist():
    """scripts/fresh_install_check.py --newest-canary (CI's side stream) runs these on the newest releases; a node id
    that names nothing would make pytest select nothing there (exit 5, a canary that checks nothing). Read by AST."""
    import ast

    sys.path.insert(0, str(ROOT / "scripts"))
    import fresh_install_check as F

    tests = [t for t in F.CANARY_TESTS if not t.startswith("-")]
    assert tests
    for node in tests:
        path, _, name = node.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert any(n.startswith("test_") for n in defined), path
        assert not name or name in defined, node
    assert set(F.CANARY_PACKAGES) >= {"transformers", "accelerate", "peft", "trl"}
