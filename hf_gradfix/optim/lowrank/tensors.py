"""Helpers on the tensors the low-rank optimizer meets: FSDP2 DTensors (the optimizer works on the local shard),
fake tensors (``hf-gradfix plan --simulate``), and the process count.  Apart because the optimizer, its pieces and
the subclasses (GaLore, APOLLO) all need them.

This module imports only torch.
"""

from __future__ import annotations

import torch


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _sharded_dims(p: torch.Tensor) -> frozenset[int]:
    if not _is_dtensor(p):
        return frozenset()
    return frozenset(pl.dim for pl in p.placements if pl.is_shard())


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - torch without fake tensors
        return False
    return bool(is_fake(t))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

