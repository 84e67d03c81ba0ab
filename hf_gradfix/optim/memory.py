"""Optimizer-state memory: what is stored (measured from the storages) and what the math needs (analytic).

The test of "state that is exactly what the math needs" compares the two.  The analytic formulas are
also what a memory planner needs (per matrix ``(m, n)``, rank ``r``, reduced dimension ``d``, other ``k``):

* AdamW: ``2 m n`` elements in the parameter dtype, plus the fp32 ``step``;
* GaLore: moments ``2 k r`` + basis ``d r`` (fp32), ``step`` (fp32) and ``side`` (int8);
* APOLLO: moments ``2 k r`` (fp32), ``proj_seed`` (int64), ``step``, ``side``, and the limiter's norm (fp32).

This module imports only torch.
"""

from __future__ import annotations

import torch

from . import projection as proj

__all__ = ["state_bytes", "expected_state_bytes", "adamw_state_elements", "galore_state_elements", "eight_bit_moment_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _tensors_in(value, depth: int = 0):
    """Tensors in a state value, also inside containers and plain objects (galore-torch keeps its basis in a
    projector object); bounded depth so cycles cannot loop."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4:
        if isinstance(value, dict):
            items = value.values()
        elif isinstance(value, (list, tuple, set)):
            items = value
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            items = vars(value).values()
        else:
            return
        for item in items:
            yield from _tensors_in(item, depth + 1)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every distinct storage referenced by ``optimizer.state`` (local shards for DTensors), including
    tensors held inside objects stored there.

    Counting storages, not tensor sizes, is what exposes a small view that keeps a large factor alive
    (galore-torch's ``Vh[:r]`` slice of a full SVD, held in its projector object).

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(10, 10)); opt = torch.optim.AdamW([p]); p.grad = torch.ones(10, 10); opt.step()
    >>> state_bytes(opt)   # two fp32 10x10 moments + the fp32 step
    804
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for st in optimizer.state.values():
        for value in _tensors_in(st):
            storage = _local(value).untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def adamw_state_elements(shape: tuple[int, ...]) -> int:
    """Moment elements of plain AdamW for a parameter of ``shape`` (both moments)."""
    n = 1
    for s in shape:
        n *= s
    return 2 * n


def galore_state_elements(shape: tuple[int, int], rank: int, side: int) -> tuple[int, int]:
    """``(moment elements, basis elements)`` of one projected matrix.

    >>> galore_state_elements((4096, 11008), 1024, proj.RIGHT)   # Llama-7B up_proj.T-like: moments 2*4096*1024
    (8388608, 11272192)
    """
    d = shape[proj.reduced_dim(side)]
    k = shape[1 - proj.reduced_dim(side)]
    return 2 * k * rank, d * rank


def eight_bit_moment_bytes(numel: int, min_8bit_size: int = 4096, blocksize: int = 256) -> int:
    """Bytes of two Adam moments of ``numel`` elements in bitsandbytes' blockwise 8-bit state: uint8 codes plus one fp32
    absmax per block of 256 (fp32 moments below ``min_8bit_size`` elements, as bitsandbytes does).

    >>> eight_bit_moment_bytes(4096), eight_bit_moment_bytes(100)
    (8320, 800)
    """
    if numel < min_8bit_size:
        return 2 * numel * 4
    blocks = numel // blocksize + bool(numel % blocksize)
    return 2 * numel + 2 * blocks * 4


def expected_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What the math needs for every parameter that has optimizer state, from shapes and settings only.

    Works for :class:`~hf_gradfix.optim.GaLoreAdamW`, :class:`~hf_gradfix.optim.GaLoreAdamW8bit`,
    :class:`~hf_gradfix.optim.ApolloAdamW` and
    ``torch.optim.AdamW`` (non-fused, non-amsgrad).
    """
    plans = getattr(optimizer, "_plans", {})
    kind = type(optimizer).__name__
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                continue
            lp = _local(p)
            if p not in plans:
                if "8bit" in kind:
                    total += 4 + eight_bit_moment_bytes(lp.numel(), group["min_8bit_size"])
                    continue
                total += adamw_state_elements(tuple(lp.shape)) * lp.element_size() + 4  # moments + fp32 step
                continue
            side = plans[p].side
            local_shape = tuple(lp.shape)
            moments, basis = galore_state_elements(local_shape, group["rank"], side)
            if "8bit" in kind:
                total += 4 + 1 + basis * lp.element_size() + eight_bit_moment_bytes(moments // 2, group["min_8bit_size"])
                continue
            moment_size = lp.element_size() if group["compat"] != "torch" else 4
            total += 4 + 1  # step (fp32), side (int8)
            if "Apollo" in kind:
                total += moments * moment_size + 8  # moments + proj_seed (int64)
                total += 4 if group.get("norm_growth_limit") is not None else 0
            else:
                total += moments * moment_size + basis * moment_size
                total += 4 if group["on_switch"] == "reset" else 0
    return total
