"""What a low-rank optimizer's constructor accepts, normalized to torch parameter groups: a model (grouped by
:func:`~hf_gradfix.optim.low_rank_param_groups`), tensors, ``named_parameters()``, or groups (with galore-torch's /
apollo-torch's keys translated), plus the validation of every group's settings.  Apart from the per-matrix plan
and the step, which only read the groups this produces.

This module imports only torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import InvalidArgumentError, InvalidTypeError
from ..groups import OptimizerConfigError, low_rank_param_groups, select_targets

_METHODS = ("auto", "svd", "randomized", "identity")
_ON_SWITCH = ("keep", "reset", "reproject")
_SIDES = ("auto", "right", "left", "std", "reverse_std")
_COMPAT = ("torch", "galore_torch", "apollo_torch")


class ParamGroupIntake:
    """Mixin of :class:`~hf_gradfix.optim.lowrank.LowRankAdamW`: parameter intake and group validation."""

    def _intake(self, params, targets, exclude, weight_decay, no_decay) -> tuple[list[dict], dict]:
        """Normalize the accepted inputs to param groups; remember names where they are given."""
        if isinstance(params, nn.Module):
            groups = low_rank_param_groups(
                params, targets=targets, exclude=exclude, weight_decay=weight_decay, no_decay=no_decay
            )
            if not any(g["project"] for g in groups):
                from ..groups import _adapter_param_names

                trainable = {n for n, p in params.named_parameters() if p.requires_grad}
                if trainable and trainable <= _adapter_param_names(params) | {
                        n for n, p in params.named_parameters() if p.requires_grad and p.dim() != 2}:
                    raise OptimizerConfigError(
                        f"{self._name}: the model's only trainable matrices are PEFT adapters (LoRA A/B), which a "
                        "low-rank optimizer does not project (they are low rank already); fix: train the LoRA model "
                        "with the Trainer's AdamW (remove optimizer.name), or project full weights (no PEFT, or "
                        "modules_to_save)")
                raise OptimizerConfigError(f"{self._name}: targets={targets!r} select no 2-D trainable weight")
            names = {p: n for g in groups for p, n in zip(g["params"], g.pop("param_names"))}
            return groups, names
        if isinstance(params, torch.Tensor):
            raise InvalidTypeError(f"{self._name}: params must be an iterable of tensors, named tensors or groups, or a model")
        items = list(params)
        if not items:
            raise InvalidArgumentError(f"{self._name}: got an empty parameter list")
        dict_groups = isinstance(items[0], dict)
        raw_groups = items if dict_groups else [{"params": items}]
        # galore-torch's / apollo-torch's rule: in a list of groups, a group is projected exactly when it has a
        # ``rank``.  So when any group names one (their documented recipe), groups without it stay plain AdamW;
        # when none does, every group is projected at the constructor's rank.  An explicit ``project`` wins.
        rank_marks_projection = dict_groups and any("rank" in g for g in raw_groups)
        groups, names = [], {}
        for g in raw_groups:
            g = self._translate_group_keys(dict(g))
            if "project" not in g and rank_marks_projection:
                g["project"] = "rank" in g
            plist = g["params"]
            plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
            tensors = []
            given_names = g.pop("param_names", None)
            for i, item in enumerate(plist):
                if isinstance(item, tuple):
                    names[item[1]] = item[0]
                    tensors.append(item[1])
                else:
                    if given_names is not None:
                        names[item] = given_names[i]
                    tensors.append(item)
            g["params"] = tensors
            groups.append(g)
        if targets is not None or exclude:
            named = [(names[p], p) for g in groups for p in g["params"] if p in names]
            if len(named) != sum(len(g["params"]) for g in groups):
                raise OptimizerConfigError(
                    f"{self._name}: targets={targets!r} / exclude={list(exclude)!r} need parameter names, and these "
                    "parameters came without them. Pass the model itself, model.named_parameters(), or groups "
                    "with 'param_names'; or drop targets to project every 2-D parameter of groups with project=True"
                )
            sel = select_targets(named, targets, exclude)
            projected = set(sel.projected)
            split = []
            for g in groups:
                if not g.get("project", True):
                    split.append(g)
                    continue
                yes = [p for p in g["params"] if names[p] in projected]
                no = [p for p in g["params"] if names[p] not in projected]
                if yes:
                    split.append({**g, "params": yes, "project": True})
                if no:
                    split.append({**g, "params": no, "project": False})
            groups = split
        return groups, names

    def _translate_group_keys(self, g: dict) -> dict:
        """Accept galore-torch's / apollo-torch's group keys: ``proj_type`` is our ``proj_side``; apollo-torch's
        ``proj="random"`` is what APOLLO does anyway."""
        if "proj_type" in g:
            value = g.pop("proj_type")
            if value not in _SIDES[1:]:
                raise OptimizerConfigError(
                    f"{self._name}: proj_type={value!r} (galore-torch's name for proj_side) is not one of "
                    f"{', '.join(map(repr, _SIDES[1:]))}; galore-torch's 'full' (full-rank two-sided) is not supported"
                )
            if "proj_side" in g and g["proj_side"] != value:
                raise OptimizerConfigError(
                    f"{self._name}: a group sets both proj_type={value!r} and proj_side={g['proj_side']!r}; keep one"
                )
            g["proj_side"] = value
        if "proj" in g:
            value = g.pop("proj")
            if self._name != "ApolloAdamW" or value != "random":
                raise OptimizerConfigError(
                    f"{self._name}: group key proj={value!r} is not supported (apollo-torch's projection type); "
                    "ApolloAdamW always uses a random projection, GaLoreAdamW sets proj_method"
                )
        return g

    def _validate_group(self, g: dict) -> None:
        n = self._name

        def bad(key: str, why: str) -> None:
            raise OptimizerConfigError(f"{n}: {key}={g[key]!r} {why}")

        def whole(v) -> bool:  # True / False are ints to Python, not ranks or gaps to a user
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not ((number(g["lr"]) or isinstance(g["lr"], torch.Tensor) and g["lr"].numel() == 1) and float(g["lr"]) >= 0):
            bad("lr", "must be a number >= 0")
        betas = g["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and 0.0 <= b < 1.0 for b in betas)):
            bad("betas", "must be two numbers in [0, 1)")
        if not (number(g["eps"]) and g["eps"] >= 0):
            bad("eps", "must be a number >= 0")
        if not (number(g["weight_decay"]) and g["weight_decay"] >= 0):
            bad("weight_decay", "must be a number >= 0")
        if not (whole(g["rank"]) and g["rank"] >= 1):
            bad("rank", "must be an integer >= 1")
        if not (whole(g["update_proj_gap"]) and g["update_proj_gap"] >= 1):
            bad("update_proj_gap", "must be an integer >= 1 (optimizer steps between basis refreshes)")
        if not (number(g["scale"]) and math.isfinite(g["scale"]) and g["scale"] > 0):
            bad("scale", "must be a finite number > 0")
        if not (math.isfinite(float(g["lr"])) and math.isfinite(g["eps"]) and math.isfinite(g["weight_decay"])):
            bad("lr", "lr, eps and weight_decay must be finite")
        for key, allowed in (("proj_side", _SIDES), ("proj_method", _METHODS), ("on_switch", _ON_SWITCH), ("compat", _COMPAT)):
            if g[key] not in allowed:
                bad(key, f"is not one of {', '.join(map(repr, allowed))}")
        if not (whole(g["min_size"]) and g["min_size"] >= 0):
            bad("min_size", "must be an integer >= 0")
