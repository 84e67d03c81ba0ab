"""The per-matrix plan of a low-rank optimizer: which 2-D parameters are projected, on which side, under which
name, with which staggered refresh offset; decided once at construction.  Apart from the groups (what the
constructor accepted) and the step (what it does with the plan).

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import projection as proj
from ..groups import OptimizerConfigError
from .tensors import _sharded_dims


@dataclass
class _Plan:
    """Construction-time decision for one projected matrix."""

    name: str
    index: int  # position among all parameters (seeds)
    offset: int  # first refresh step when refreshes are staggered
    side: int


class MatrixPlans:
    """Mixin of :class:`~hf_gradfix.optim.lowrank.LowRankAdamW`: builds ``self._plans`` (parameter -> :class:`_Plan`)
    from ``self.param_groups`` and ``self._names``, and answers which matrices are projected."""

    def _make_plans(self, explicit: bool) -> None:
        index = 0
        candidates: list[tuple[torch.Tensor, dict, int]] = []
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if not group["project"] or p.dim() != 2:
                    continue
                if min(p.shape) < group["min_size"]:
                    continue
                candidates.append((p, group, index))
        skipped = []
        for p, group, index in candidates:
            name = self._names.get(p, f"param[{index - 1}] {tuple(p.shape)}")
            try:
                side = proj.resolve_side(tuple(p.shape), group["proj_side"], _sharded_dims(p))
            except ValueError as err:
                raise OptimizerConfigError(f"{self._name}: {err}") from None
            if {0, 1} <= _sharded_dims(p):
                raise OptimizerConfigError(
                    f"{self._name}: both dimensions of {name} are sharded ({p.placements}: FSDP2 rows x tensor-parallel "
                    "columns), so projecting it on either side would need a collective every step. Leave these "
                    "weights out of the low-rank targets (optimizer.exclude, e.g. [o_proj, down_proj] for a Llama "
                    "tp plan) or run the low-rank optimizer on a mesh without tp"
                )
            if proj.reduced_dim(side) in _sharded_dims(p):
                raise OptimizerConfigError(
                    f"{self._name}: proj_side={group['proj_side']!r} reduces dimension {proj.reduced_dim(side)} of {name}, "
                    f"which is sharded ({p.placements}); projecting it would need a collective every step. "
                    "Use proj_side='auto' (reduces the unsharded side)"
                )
            d = p.shape[proj.reduced_dim(side)]
            # a basis of the gradient's own singular vectors (GaLore) has at most min(m, n) directions: a 3 x 32 head
            # cannot hold a rank-4 basis on its 32 side either
            over_svd = self._basis_from_gradient and group["rank"] > min(p.shape)
            if (group["rank"] >= d or over_svd) and group["proj_method"] != "identity":
                if explicit:
                    what = (f"above the smaller side {min(p.shape)} of {name} (its SVD basis has at most that many "
                            "directions)" if over_svd and group["rank"] < d else
                            f"not below the projected dimension {d} of {name}")
                    raise OptimizerConfigError(
                        f"{self._name}: rank={group['rank']} is {what} (shape {tuple(p.shape)}); lower the rank, or "
                        f"set min_size={min(p.shape) + 1 if over_svd else d + 1} so matrices this small stay plain AdamW"
                    )
                skipped.append(name)
                continue
            self._plans[p] = _Plan(name=name, index=index, offset=0, side=side)
        if candidates and not self._plans:
            g = candidates[0][1]
            raise OptimizerConfigError(
                f"{self._name}: rank={g['rank']} is not below the projected dimension of any selected matrix "
                f"(e.g. {self._names.get(candidates[0][0], 'param')} {tuple(candidates[0][0].shape)}); lower the rank"
            )
        self.skipped_small = skipped  # matrices auto-selected but too small for the rank: plain AdamW
        # Staggered refreshes: spread the K projected matrices evenly over the gap.
        plans = list(self._plans.items())
        for k, (p, plan) in enumerate(plans):
            group = self._group_of(p)
            if group["stagger"]:
                plan.offset = (k * group["update_proj_gap"]) // max(1, len(plans))

    def _group_of(self, p: torch.Tensor) -> dict:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter not in optimizer")

    def _deepspeed_check(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if hasattr(p, "ds_id") or hasattr(p, "ds_numel"):
                    raise OptimizerConfigError(
                        f"{self._name} does not support DeepSpeed ZeRO (it flattens and partitions weights, so no 2-D "
                        "gradient exists to project). Use FSDP2 (accelerate fsdp_version: 2) or DDP"
                    )

    # ------------------------------------------------------------------ introspection

    @property
    def projected_names(self) -> list[str]:
        """Names (or positions) of the matrices this optimizer projects."""
        return [plan.name for plan in self._plans.values()]

    def is_projected(self, p: torch.Tensor) -> bool:
        return p in self._plans
