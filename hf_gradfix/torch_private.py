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
import inspect
from typing import Any, Callable, NamedTuple

from .errors import HfGradfixError

__all__ = ["TESTED_TORCH", "UnsupportedTorchError", "VarlenAttention", "private", "require", "varlen_attention"]

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


class VarlenAttention(NamedTuple):
    """torch's own varlen FlashAttention kernel, as :func:`varlen_attention` found it."""

    fn: Callable[..., Any] | None
    """``torch.nn.attention.varlen.varlen_attn``, or ``None`` where this torch cannot serve packing."""
    enable_gqa: bool
    """It takes ``enable_gqa`` (torch >= 2.12); without it, key/value heads are repeated to the query heads."""
    why: str
    """One line: what was found (or what is missing)."""


#: the keywords of ``varlen_attn`` packing needs: the softmax scale (Gemma 2, Qwen 3...) and the (left, right)
#: window that expresses causal and sliding-window attention (torch 2.11; torch 2.10 had ``is_causal`` only).
VARLEN_KEYWORDS = ("scale", "window_size")


def varlen_attention() -> VarlenAttention:
    """``torch.nn.attention.varlen.varlen_attn`` where this torch has the keywords packing passes, else ``fn=None``
    and why. Gated by its signature, not by version numbers (the API moved between 2.9 and 2.12: ``is_causal`` in
    2.9/2.10, ``scale`` and ``window_size`` from 2.11, ``enable_gqa`` from 2.12).

    >>> found = varlen_attention()
    >>> found.fn is None or found.why.startswith("torch.nn.attention.varlen.varlen_attn")
    True
    """
    import torch

    try:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return VarlenAttention(None, False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                                            "(torch >= 2.11 has it)")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C function without a signature
        return VarlenAttention(None, False, f"torch {torch.__version__}: varlen_attn has no readable signature")
    missing = [k for k in VARLEN_KEYWORDS if k not in params]
    if missing:
        return VarlenAttention(None, False, f"torch {torch.__version__}: varlen_attn lacks {', '.join(missing)} "
                                            "(torch >= 2.11 has them)")
    gqa = "enable_gqa" in params
    return VarlenAttention(fn, gqa, f"torch.nn.attention.varlen.varlen_attn of torch {torch.__version__} "
                                    f"({'enable_gqa' if gqa else 'no enable_gqa: K/V heads repeated'})")
