"""Which parameters a low-rank optimizer projects, and the parameter groups it builds from a model.

Selection rules (by behaviour, never by model class):

* only trainable (``requires_grad``) parameters are optimized at all;
* ``targets="all-linear"`` selects the weight of every ``nn.Linear`` except the output head (the module
  ``model.get_output_embeddings()`` returns, when the model has one);
* other ``targets`` are module-name patterns: a pattern selects a module when it is a substring of the
  module's dotted name or a regular expression that matches the whole name (``"attn"`` selects
  ``model.layers.0.self_attn.q_proj``);
* adapter weights of a PEFT tuner layer (LoRA A/B, ...) are never projected (they are small and already
  low-rank); its frozen ``base_layer`` is not trainable; a full trainable copy in ``modules_to_save`` is
  an ordinary weight and can be projected;
* only 2-D weights are projected; everything else in a projected group is plain AdamW.

This module imports torch only (peft is looked up in ``sys.modules``: a PEFT model has imported it).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from ..errors import HfGradfixError

__all__ = ["OptimizerConfigError", "Selection", "select_targets", "no_decay_names", "low_rank_param_groups"]


class OptimizerConfigError(HfGradfixError, ValueError):
    """An invalid low-rank optimizer setting; the message names the setting, the value and the fix."""


@dataclass
class Selection:
    """The outcome of target selection over named trainable parameters."""

    projected: list[str] = field(default_factory=list)  # parameter names chosen for projection
    plain: list[str] = field(default_factory=list)  # everything else (AdamW)


def _module_name(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _pattern_matches(pattern: str, module_name: str) -> bool:
    if pattern in module_name:
        return True
    try:
        return re.fullmatch(pattern, module_name) is not None
    except re.error:
        return False


def _adapter_param_names(model: nn.Module) -> set[str]:
    """Names of PEFT adapter parameters (inside a tuner layer but not in its ``base_layer``)."""
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    base_cls = getattr(peft_tuners, "BaseTunerLayer", None)
    if base_cls is None:
        return set()
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, base_cls):
            prefix = f"{mod_name}." if mod_name else ""
            for p_name, _ in module.named_parameters():
                if not p_name.startswith("base_layer."):
                    names.add(prefix + p_name)
    return names


def _output_head_params(model: nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    if not callable(get):
        return set()
    try:
        head = get()
    except Exception:  # some models raise NotImplementedError
        return set()
    if not isinstance(head, nn.Module):
        return set()
    return {id(p) for p in head.parameters()}


def select_targets(
    named_params: Sequence[tuple[str, torch.Tensor]],
    targets: str | Sequence[str] | None,
    exclude: Sequence[str] = (),
    model: nn.Module | None = None,
) -> Selection:
    """Split trainable named parameters into projected and plain (see the module docstring).

    ``targets=None`` means "all-linear" when ``model`` is given, else every 2-D parameter.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    >>> select_targets(list(m.named_parameters()), ["0"], model=m).projected
    ['0.weight']
    """
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]
    adapters = _adapter_param_names(model) if model is not None else set()
    heads = _output_head_params(model) if model is not None else set()
    linear_weights: set[int] = set()
    module_names: list[str] = []
    if model is not None:
        for mod_name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                linear_weights.add(id(module.weight))
    for name, _ in named_params:
        mod = _module_name(name)
        if mod not in module_names:
            module_names.append(mod)

    if targets == "all-linear" or (targets is None and model is not None):
        if model is None:
            raise OptimizerConfigError(
                "targets='all-linear' needs the model (module types); pass the model itself, or module-name "
                "patterns such as targets=['attn', 'mlp']"
            )

        def chosen(name: str, p: torch.Tensor) -> bool:
            return id(p) in linear_weights and id(p) not in heads
    elif targets is None:

        def chosen(name: str, p: torch.Tensor) -> bool:
            return True
    else:
        patterns = list(targets)
        if not patterns:
            raise OptimizerConfigError("targets=[] selects nothing; give module-name patterns or 'all-linear'")
        hits = {t: 0 for t in patterns}

        def chosen(name: str, p: torch.Tensor) -> bool:
            hit = False
            for t in patterns:
                if _pattern_matches(t, _module_name(name)):
                    hits[t] += 1
                    hit = True
            return hit

    sel = Selection()
    matched_other: set[str] = set()  # patterns that match only frozen / adapter / non-2-D parameters
    for name, p in named_params:
        if isinstance(targets, (list, tuple)):
            matched_other.update(t for t in targets if _pattern_matches(t, _module_name(name)))
        if not p.requires_grad:
            continue
        excluded = any(_pattern_matches(x, _module_name(name)) for x in exclude)
        if p.dim() == 2 and name not in adapters and not excluded and chosen(name, p):
            sel.projected.append(name)
        else:
            sel.plain.append(name)

    if isinstance(targets, (list, tuple)):
        missing = [t for t, n in hits.items() if n == 0]  # type: ignore[possibly-undefined]
        only_other = [t for t in missing if t in matched_other]
        if only_other:
            raise OptimizerConfigError(
                f"targets {only_other} match only frozen, adapter (PEFT LoRA A/B) or non-2-D parameters; low-rank "
                "optimizers project full trainable weights. With PEFT, target the modules in modules_to_save, "
                "or train the full model"
            )
        if missing:
            sample = ", ".join(repr(n) for n in module_names[:4] if n)
            raise OptimizerConfigError(
                f"targets {missing} match no trainable 2-D parameter; patterns are substrings or regular "
                f"expressions of module names, which here look like {sample}; fix the pattern or use 'all-linear'"
            )
    return sel


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameter names that get no weight decay: biases and normalization weights (transformers' rule).

    Normalization layers are recognized by behaviour-free structure: any module whose class name contains
    ``Norm`` (LayerNorm, RMSNorm, GroupNorm, ... of every architecture), plus every bias.
    """
    out: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        is_norm = isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()
        for p_name, _ in module.named_parameters(recurse=False):
            if is_norm or p_name == "bias" or p_name.endswith("bias"):
                out.add(prefix + p_name)
    return out


def low_rank_param_groups(
    model: nn.Module,
    *,
    targets: str | Sequence[str] | None = "all-linear",
    exclude: Sequence[str] = (),
    weight_decay: float = 0.0,
    no_decay: Iterable[str] | None = None,
) -> list[dict]:
    """Parameter groups for a low-rank optimizer: {decay, no decay} x {projected, plain}.

    Each group carries ``params``, ``param_names``, ``weight_decay`` and ``project``.  ``no_decay`` is a set
    of parameter names without weight decay (default: :func:`no_decay_names`).

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    >>> [(g["project"], g["weight_decay"], g["param_names"]) for g in low_rank_param_groups(m, targets=["0"], weight_decay=0.1)]
    [(True, 0.1, ['0.weight']), (False, 0.1, ['2.weight']), (False, 0.0, ['0.bias', '1.weight', '1.bias', '2.bias'])]
    """
    everything = list(model.named_parameters())
    named = [(n, p) for n, p in everything if p.requires_grad]
    sel = select_targets(everything, targets, exclude, model=model)
    nd = set(no_decay) if no_decay is not None else no_decay_names(model)
    projected = set(sel.projected)
    groups = []
    for project in (True, False):
        for decay in (True, False):
            names = [n for n, _ in named if (n in projected) == project and (n not in nd) == decay]
            if names:
                params = [p for n, p in named if n in set(names)]
                groups.append(
                    {
                        "params": params,
                        "param_names": names,
                        "weight_decay": weight_decay if decay else 0.0,
                        "project": project,
                    }
                )
    return groups
