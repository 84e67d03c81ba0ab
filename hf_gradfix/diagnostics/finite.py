"""Whether tensors are finite, fast: one 2-norm per tensor, the max-abs only where a 2-norm is not.

A finite 2-norm means every element is finite (NaN and inf propagate through squares and sums), and it is the fast
pass: on CPU torch's inf-norm takes ~30x as long (3.6 vs 0.1 ms for 0.86M fp32 gradients, torch 2.13). A non-finite
2-norm may be an overflow of large finite values, so max |x| (no sum, no overflow) decides those. Shared by the
non-finite guard of the Trainer integration and the low-rank optimizers' own check.

>>> import torch
>>> tensors_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
False
>>> tensors_finite([torch.tensor([3e38, 3e38])])  # finite, but the 2-norm overflows
True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["norms_finite_flags", "tensors_finite"]


def _norms_finite(tensors: list[torch.Tensor], order: float) -> torch.Tensor:
    norms = torch._foreach_norm(tensors, order) if hasattr(torch, "_foreach_norm") else [
        torch.linalg.vector_norm(t, order) for t in tensors]
    return torch.isfinite(torch.stack([n.float() for n in norms])).all()


def _by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.detach()
        if t.numel() and t.is_floating_point():
            by_device.setdefault(t.device, []).append(t)
    return by_device


def norms_finite_flags(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The fast pass of :func:`tensors_finite` without reading it back: one boolean device tensor per device, True
    where every 2-norm there is finite (then every element is). A caller reads them together with its other values
    (one host sync) and settles a False one with :func:`tensors_finite`.

    >>> [bool(f) for f in norms_finite_flags([torch.ones(2), torch.tensor([float("inf")])])]
    [False]
    """
    return [_norms_finite(ts, 2.0) for ts in _by_device(tensors).values()]


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every floating-point tensor is finite (local values: pass a DTensor's
    ``to_local()``). One host sync per device, two only where a 2-norm overflows."""
    by_device = _by_device(tensors)
    if not by_device:
        return True
    if bool(torch.stack([_norms_finite(ts, 2.0).cpu() for ts in by_device.values()]).all()):
        return True
    return bool(torch.stack([_norms_finite(ts, float("inf")).cpu() for ts in by_device.values()]).all())
