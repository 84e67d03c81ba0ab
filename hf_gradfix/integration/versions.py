"""Which library versions the integration layer was written and tested against.

Every change to third-party code is checked here first: an unknown version fails loudly instead
of silently doing nothing (set ``HF_GRADFIX_ALLOW_UNTESTED=1`` to try anyway, at your own risk).

Inside the supported ranges, the versions CI tested are the lock files shipped with the package
(``hf_gradfix/requirements/lock-tf5.txt``, ``lock-tf457.txt`` for transformers 4.57; ``requirements/`` at the root of
a clone links there). :func:`untested_line` names every installed package the plugin integrates with whose version
differs from its lock, with the ``pip install -c LOCK ...`` command that installs the tested set; ``patch()`` and
``GradFixCallback`` warn with it once per process (:func:`warn_if_untested`), ``hf-gradfix env`` prints it.
"""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import HfGradfixError

SUPPORTED: dict[str, tuple[str, ...]] = {
    # transformers 4.57.x and every 5.x: the Trainer methods we extend (get_batch_samples,
    # compute_loss, training_step, prediction_step, evaluation_loop) keep their contract there.
    "transformers": (">=4.57,<4.58", ">=5.0,<6.0"),
    "accelerate": (">=1.10",),
    "torch": (">=2.6",),
}

ALLOW_UNTESTED_ENV = "HF_GRADFIX_ALLOW_UNTESTED"

# The command that fixes each library's version (the message names the library that is out of range).
_FIX = {
    "transformers": "pip install 'transformers>=5,<6'  (or 'transformers>=4.57,<4.58')",
    "accelerate": "pip install 'accelerate>=1.10'",
    "torch": "pip install 'torch>=2.6'  (the build for your CUDA: https://pytorch.org/get-started/locally/)",
}

# Trainer attributes the fix relies on, with the reason; checked so that a renamed method is an error.
REQUIRED_TRAINER_METHODS = (
    "get_batch_samples",
    "compute_loss",
    "training_step",
    "prediction_step",
    "evaluation_loop",
)


class UnsupportedVersionError(HfGradfixError, RuntimeError):
    """A library in the stack has a version hf_gradfix does not support."""


def _installed(name: str) -> Version:
    from importlib.metadata import version

    return Version(version(name))


def check_supported(names: tuple[str, ...] = ("transformers", "accelerate", "torch")) -> dict[str, str]:
    """Raise :class:`UnsupportedVersionError` unless every library is in a supported range.

    >>> sorted(check_supported())
    ['accelerate', 'torch', 'transformers']
    """
    found: dict[str, str] = {}
    problems = []
    fixes = []
    for name in names:
        installed = _installed(name)
        found[name] = str(installed)
        plain = Version(installed.base_version)  # 2.13.0+cpu -> 2.13.0
        if not any(plain in SpecifierSet(spec) for spec in SUPPORTED[name]):
            problems.append(f"{name} {installed} (supported: {' or '.join(SUPPORTED[name])})")
            fixes.append(_FIX.get(name, f"pip install '{name}{SUPPORTED[name][-1]}'"))
    if problems and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedVersionError(
            "hf_gradfix does not support " + "; ".join(problems) + ". Install a supported version: "
            + "; ".join(f"`{fix}`" for fix in fixes) + f", or set {ALLOW_UNTESTED_ENV}=1 to try an untested "
            "version at your own risk."
        )
    from transformers import Trainer

    missing = [m for m in REQUIRED_TRAINER_METHODS if not callable(getattr(Trainer, m, None))]
    if missing:
        raise UnsupportedVersionError(
            f"transformers {found.get('transformers')} Trainer lacks {missing}; hf_gradfix cannot fix its loss. "
            f"Supported transformers: {' or '.join(SUPPORTED['transformers'])}."
        )
    return found


def transformers_major() -> int:
    return _installed("transformers").major


# ------------------------------------------------------------------------------------------------ the tested set

#: the folder of the lock files, shipped inside the package (pyproject's package-data)
LOCK_DIR = Path(__file__).resolve().parent.parent / "requirements"

#: the packages hf_gradfix integrates with (patches, wraps or calls into), by distribution name: a version of one of
#: these that differs from the lock is named; torch is pinned apart from the locks (HF_GRADFIX_TORCH, whatever build
#: the machine needs), the other pins of a lock are their dependencies (counted by ``hf-gradfix env``)
INTEGRATED = ("transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "bitsandbytes")


class UntestedVersionWarning(UserWarning):
    """A package hf_gradfix integrates with is installed at a version CI did not test (within the supported ranges)."""


def _installed_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def lock_of_installed() -> Path:
    """The lock file of the installed transformers' line: ``lock-tf457.txt`` for 4.57.x, else ``lock-tf5.txt``.

    >>> lock_of_installed().name in ("lock-tf5.txt", "lock-tf457.txt")
    True
    """
    found = _installed_version("transformers")
    try:
        old = found is not None and Version(found).release[:2] == (4, 57)
    except ValueError:  # a version packaging cannot read: the current line's lock
        old = False
    return LOCK_DIR / ("lock-tf457.txt" if old else "lock-tf5.txt")


def read_lock(path: Path) -> dict[str, str]:
    """``{distribution name: pinned version}`` of a lock file (``name==version`` lines; comments skipped).

    >>> read_lock(LOCK_DIR / "lock-tf5.txt")["transformers"].startswith("5.")
    True
    """
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, pinned = (part.strip() for part in line.split("==", 1))
            pins[name] = pinned
    return pins


def _same(installed: str, pinned: str) -> bool:
    try:
        return Version(installed) == Version(pinned)
    except ValueError:
        return installed == pinned


def lock_drift(lock: Path | None = None, names: tuple[str, ...] | None = None) -> tuple[list[tuple[str, str, str]], int]:
    """``([(name, installed, locked), ...], installed pins)``: the pins of ``lock`` (the tested lock by default; only
    ``names`` when given) whose distribution is installed at another version, and how many of its pins are installed
    at all. A pin whose distribution is not installed is not counted (an optional extra nobody installed)."""
    lock = lock or lock_of_installed()
    pins = read_lock(lock)
    drift, installed_pins = [], 0
    for name, pinned in pins.items():
        if names is not None and name not in names:
            continue
        installed = _installed_version(name)
        if installed is None:
            continue
        installed_pins += 1
        if not _same(installed, pinned):
            drift.append((name, installed, pinned))
    return drift, installed_pins


def install_command(drift: list[tuple[str, str, str]], lock: Path) -> str:
    """The command that installs the tested versions of ``drift``, their dependencies constrained by the lock.

    >>> install_command([("peft", "0.22.0", "0.21.2")], Path("/x/lock-tf5.txt"))
    'pip install -c /x/lock-tf5.txt peft==0.21.2'
    """
    pins = " ".join(shlex.quote(f"{name}=={pinned}") for name, _, pinned in drift)
    return f"pip install -c {shlex.quote(str(lock))} {pins}"


def untested_versions() -> str | None:
    """Every installed package of :data:`INTEGRATED` whose version differs from the tested lock, and the command that
    installs the tested set, in words; None when each is at its tested version (or not installed)."""
    lock = lock_of_installed()
    if not lock.is_file():  # a copy of the package without its data files: nothing to compare with
        return None
    drift, _ = lock_drift(lock, INTEGRATED)
    if not drift:
        return None
    named = ", ".join(f"{name} {installed} (tested: {pinned})" for name, installed, pinned in drift)
    return f"{named}; supported, but CI ran {lock.name}'s versions. To install the tested set: {install_command(drift, lock)}"


def untested_line() -> str | None:
    """:func:`untested_versions` as the one line ``patch()`` warns with (None when there is nothing to say)."""
    found = untested_versions()
    return f"hf_gradfix: untested versions: {found}" if found else None


_warned = False


def warn_if_untested() -> None:
    """:func:`untested_line` as one :class:`UntestedVersionWarning`, once per process (``patch()`` and
    ``GradFixCallback`` call it after :func:`check_supported`)."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        line = untested_line()
    except OSError:  # an unreadable lock file must not stop training
        return
    if line:
        warnings.warn(line, UntestedVersionWarning, stacklevel=3)
