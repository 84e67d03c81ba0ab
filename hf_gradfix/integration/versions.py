"""Which library versions the integration layer was written and tested against.

Every change to third-party code is checked here first: an unknown version fails loudly instead
of silently doing nothing (set ``HF_GRADFIX_ALLOW_UNTESTED=1`` to try anyway, at your own risk).
"""

from __future__ import annotations

import os

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
