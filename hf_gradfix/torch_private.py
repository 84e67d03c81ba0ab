"""One guarded door to torch's private APIs (names starting with ``_``), which can move between torch releases.

Every private torch name the plugin uses is fetched through :func:`private`: on a torch where it is missing, the
caller gets one :class:`UnsupportedTorchError` line naming the feature, the name, the installed torch, the torch
versions the suite ran on, and the fix, instead of an ``ImportError`` from deep inside a trace.

>>> private("torch.utils._pytree", "tree_leaves", feature="hf-gradfix plan")([1, [2, 3]])
[1, 2, 3]
>>> try:
...     private("torch._no_such_module", "x", feature="hf-gradfix plan --simulate")
... except UnsupportedTorchError as err:
...     print(str(err).split(", missing")[0])
hf-gradfix plan --simulate uses torch's private torch._no_such_module.x
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import HfGradfixError

__all__ = ["TESTED_TORCH", "UnsupportedTorchError", "private", "require"]

#: torch releases the whole suite ran on (``major.minor``); see the version matrix in the docs.
TESTED_TORCH = ("2.13", "2.14")


class UnsupportedTorchError(HfGradfixError, RuntimeError):
    """The installed torch lacks a private API a feature of the plugin needs."""


def _error(feature: str, what: str, fix: str | None) -> UnsupportedTorchError:
    import torch

    return UnsupportedTorchError(
        f"{feature} uses torch's private {what}, missing in torch {torch.__version__} (the suite runs on torch "
        f"{' and '.join(TESTED_TORCH)}): {fix or 'install torch ' + TESTED_TORCH[-1] + ' (e.g. pip install torch==2.14.1)'}"
    )


def private(module: str, name: str, *, feature: str, fix: str | None = None) -> Any:
    """``module.name`` (a private torch module or attribute), or one clear :class:`UnsupportedTorchError`."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _error(feature, f"{module}.{name}", fix) from None


def require(owner: Any, names: tuple[str, ...], *, feature: str, fix: str | None = None) -> None:
    """Check that ``owner`` (e.g. ``torch``) has every private attribute in ``names`` before a feature starts.

    >>> import torch; require(torch, ("_foreach_mul_",), feature="GaLoreAdamW")
    """
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise _error(feature, ", ".join(f"{getattr(owner, '__name__', owner)}.{n}" for n in missing), fix)
