"""The machinery shared by GaLoreAdamW and ApolloAdamW: parameter intake, validation, state, refresh
schedule, distributed basis agreement and the plain-AdamW path.

State per projected matrix (tensors only, so ``torch.load(..., weights_only=True)`` and Trainer resume
work): ``step`` (fp32 scalar, like torch's AdamW), ``side`` (int8 scalar), ``exp_avg``/``exp_avg_sq``
(the low-rank moments), and the basis ``proj`` (GaLore) or ``proj_seed`` (APOLLO).  Nothing else: no SVD
factor is kept alive and no full-size copy is made outside ``step()``.

FSDP2 / DTensor parameters: the optimizer works on the local shard.  The side is chosen so that the
reduced dimension is not sharded (``auto`` = in-features, unless those are sharded), so projection,
moments and back-projection are shard-local; only the refresh gathers the full gradient.  Moments are
stored as DTensors with the parameter's placements, so distributed checkpointing sees them as sharded.

This module imports only torch.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import projection as proj
from ..diagnostics.finite import tensors_finite
from ..errors import InvalidArgumentError, InvalidTypeError, NonFiniteError, UsageError
from ..torch_private import require
from .groups import OptimizerConfigError, low_rank_param_groups, select_targets

__all__ = ["LowRankAdamW"]

_METHODS = ("auto", "svd", "randomized", "identity")
_ON_SWITCH = ("keep", "reset", "reproject")
_SIDES = ("auto", "right", "left", "std", "reverse_std")
_COMPAT = ("torch", "galore_torch", "apollo_torch")
_BUCKET_BYTES = 25 * 1024**2  # all-reduce bucket of the low-rank accumulators
_ON_NONFINITE = ("warn", "skip", "error")
_SEED_MAX = 2**32 - 1


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _sharded_dims(p: torch.Tensor) -> frozenset[int]:
    if not _is_dtensor(p):
        return frozenset()
    return frozenset(pl.dim for pl in p.placements if pl.is_shard())


_FOREACH = ("_foreach_norm", "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_",
            "_foreach_add_", "_foreach_addcdiv_")


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


class _LowRankHook:
    """A post-accumulate-grad hook that holds its optimizer weakly: a model never keeps a dropped optimizer (and
    its state) alive, and a hook whose optimizer is gone leaves the gradient alone."""

    __slots__ = ("_optimizer",)

    def __init__(self, optimizer: "LowRankAdamW") -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._lowrank_hook(p)


class _GradVersionHook:
    """Records a gradient's version counter and sum once backward has accumulated it (weakly, like _LowRankHook).
    At ``step()`` a version that moved *and* a sum that changed mean something rescaled ``.grad`` in place in
    between (torch's ``clip_grad_norm_`` under a Trainer's ``max_grad_norm``, ``GradScaler.unscale_``), which the
    rank-r accumulators never see.  The sum tells a real rescale from transformers 5.x's ``clip_grad_norm_(..., inf)``
    (its grad-norm log), which multiplies by exactly 1.0: the same tensor summed twice gives the same bits.  Skipped
    when hf_gradfix's Trainer integration routes the clip (``clipping_routed``): no cost there."""

    __slots__ = ("_optimizer",)

    def __init__(self, optimizer: "LowRankAdamW") -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or not optimizer._accumulating or optimizer.clipping_routed or optimizer._clip_called:
            return
        if p.grad is None:
            optimizer._grad_versions.pop(p, None)
        else:
            optimizer._grad_versions[p] = (p.grad._version, p.grad.detach().sum())


def _callers_max_grad_norm(depth: int = 40) -> float | None:
    """``args.max_grad_norm`` of the nearest caller frame that holds such an ``args`` (a Trainer's training loop, a
    script's parsed arguments), None when none does (bounded walk; reads locals only)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        value = getattr(frame.f_locals.get("args"), "max_grad_norm", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        frame, depth = frame.f_back, depth - 1
    return None


def _remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


# id(parameter) -> (the parameter, the optimizer whose low-rank hooks it carries), both held weakly: a second
# low-rank optimizer on the same weights takes them over instead of two hooks each projecting and freeing the same
# gradient.  (Keyed by id, checked by identity: tensors compare elementwise, so they cannot be weak dict keys.)
_HOOK_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _hook_owner(p: torch.Tensor) -> "LowRankAdamW | None":
    entry = _HOOK_OWNER.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


@dataclass
class _Plan:
    """Construction-time decision for one projected matrix."""

    name: str
    index: int  # position among all parameters (seeds)
    offset: int  # first refresh step when refreshes are staggered
    side: int


class LowRankAdamW(torch.optim.Optimizer):
    """Base class; use :class:`hf_gradfix.optim.GaLoreAdamW` or :class:`hf_gradfix.optim.ApolloAdamW`."""

    _name = "LowRankAdamW"
    #: the basis is the gradient's own singular vectors (GaLore), so the rank is bounded by the matrix's smaller side
    #: too; a random projection (APOLLO) is bounded only by the projected side
    _basis_from_gradient = False
    _extra_defaults: dict[str, Any] = {}
    _keeps_state_dtype = False  # also the unprojected parameters' state keeps its saved dtype on load (8-bit)

    def __init__(
        self,
        params: nn.Module | Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        rank: int = 128,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        proj_side: str = "auto",
        proj_method: str = "auto",
        on_switch: str = "keep",
        min_size: int = 0,
        stagger: bool | None = None,
        targets: str | list[str] | None = None,
        exclude: list[str] | tuple[str, ...] = (),
        no_decay: Iterable[str] | None = None,
        oversample: int = 8,
        niter: int = 2,
        seed: int = 0,
        compat: str = "torch",
        sync_basis: bool = True,
        lowrank_grads: bool = False,
        initial_basis: str = "accumulated",
        on_nonfinite: str = "warn",
        **extra: Any,
    ) -> None:
        if stagger is None:  # low-rank accumulation only saves memory when few matrices refresh per step
            stagger = bool(lowrank_grads)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            project=True,
            rank=rank,
            update_proj_gap=update_proj_gap,
            scale=scale,
            proj_side=proj_side,
            proj_method=proj_method,
            on_switch=on_switch,
            min_size=min_size,
            stagger=stagger,
            oversample=oversample,
            niter=niter,
            compat=compat,
        )
        for key, value in self._extra_defaults.items():
            defaults[key] = extra.pop(key, value)
        if extra:
            raise InvalidTypeError(f"{self._name}: unexpected keyword argument(s) {sorted(extra)}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX:
            raise OptimizerConfigError(f"{self._name}: seed={seed!r} must be an integer in [0, 2**32 - 1]")
        if on_nonfinite not in _ON_NONFINITE:
            raise OptimizerConfigError(
                f"{self._name}: on_nonfinite={on_nonfinite!r} is not one of {', '.join(map(repr, _ON_NONFINITE))}"
            )
        self._seed = int(seed)
        self._sync_basis = bool(sync_basis)
        self.on_nonfinite = on_nonfinite
        # Set by hf_gradfix's Trainer guard, which then owns the non-finite check (one warning, one decision).
        self.nonfinite_checked_by_caller = False
        groups, names = self._intake(params, targets, exclude, weight_decay, no_decay)
        require(torch, _FOREACH, feature=type(self).__name__)  # torch private ops: one clear line if gone
        require(torch._utils, ("_flatten_dense_tensors", "_unflatten_dense_tensors"), feature=type(self).__name__)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            self._validate_group(group)
        self._names: dict[torch.Tensor, str] = names
        self._plans: dict[torch.Tensor, _Plan] = {}
        self._warned: set[str] = set()
        self._make_plans(explicit=targets not in (None, "all-linear") or not names)
        self._deepspeed_check()
        # Low-rank gradient accumulation (GaLore): per-parameter rank-r accumulators filled by backward hooks.
        self._lowrank_acc: dict[torch.Tensor, torch.Tensor] = {}
        self._lowrank_hooks: list = []
        # the hooks go when the optimizer goes (the handles hold no reference to it)
        weakref.finalize(self, _remove_handles, self._lowrank_hooks)
        self._ddp_model: weakref.ref | None = None  # the model whose DDP ignore list names the projected weights
        self._ddp_ignored_names: list[str] = []  # the names this optimizer added to it
        self._lowrank_reduced = False
        # Set by hf_gradfix's Trainer integration, which routes max_grad_norm to clip_grad_norm_ (or by a caller
        # who clips only .grad on purpose); else a step on accumulators that no clip_grad_norm_ of ours saw warns
        # once (torch's clip does not see them), and a step after .grad was changed in place is refused.
        self.clipping_routed = False
        self._clip_called = False
        # parameter -> (version, sum) of its .grad after the last backward (see _GradVersionHook); checked at step()
        self._grad_versions: dict[torch.Tensor, tuple[int, torch.Tensor]] = {}
        self.lowrank_grads = bool(lowrank_grads)
        self.initial_basis = initial_basis
        self.bytes_all_reduced = 0  # by this optimizer (low-rank accumulators, refreshing full gradients)
        if initial_basis not in ("accumulated", "first_microbatch"):
            raise OptimizerConfigError(
                f"{self._name}: initial_basis={initial_basis!r} is not one of 'accumulated', 'first_microbatch'"
            )
        if self.lowrank_grads:
            self._setup_lowrank_grads(params if isinstance(params, nn.Module) else None)

    # ------------------------------------------------------------------ construction

    def _intake(self, params, targets, exclude, weight_decay, no_decay) -> tuple[list[dict], dict]:
        """Normalize the accepted inputs to param groups; remember names where they are given."""
        if isinstance(params, nn.Module):
            groups = low_rank_param_groups(
                params, targets=targets, exclude=exclude, weight_decay=weight_decay, no_decay=no_decay
            )
            if not any(g["project"] for g in groups):
                from .groups import _adapter_param_names

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

    # ------------------------------------------------------------------ low-rank gradient accumulation

    def _setup_lowrank_grads(self, model: nn.Module | None) -> None:
        """Register the post-accumulate-grad hooks that fold each micro-batch's gradient into a rank-r accumulator."""
        for p, plan in self._plans.items():
            if _is_dtensor(p):
                raise OptimizerConfigError(
                    f"{self._name}: lowrank_grads=True with FSDP2 / DTensor parameters ({plan.name}) is not supported: "
                    "FSDP2 reduce-scatters each full gradient inside its own backward hooks, before any per-parameter "
                    "hook sees it, so the projection cannot replace that communication, and the gradient it keeps "
                    "is already 1/world of the matrix. Use lowrank_grads with DDP or one process, or keep FSDP2 "
                    "with lowrank_grads=False"
                )
        self._plan_group = {p: self._group_of(p) for p in self._plans}
        self._window_basis: set = set()  # matrices whose first basis came from this window's first micro-batch
        self.attach_lowrank_hooks(model)
        if _world() > 1:
            # DDP broadcasts rank 0's weights at construction, except the ones it ignores: do it for those.
            for p in self._plans:
                torch.distributed.broadcast(p.data, src=0)

    def exclude_from_ddp(self, model: nn.Module) -> None:
        """Tell DDP not to all-reduce the projected weights' full gradients (this optimizer all-reduces their
        rank-r accumulators instead).  Call before wrapping ``model`` in ``DistributedDataParallel``; done
        automatically when the optimizer is built from the model."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise OptimizerConfigError(
                f"{self._name}: lowrank_grads=True needs the model before it is wrapped in DistributedDataParallel "
                "(DDP would all-reduce the full gradients the optimizer projects away); build the optimizer from "
                "the bare model, then wrap it (the Trainer and accelerate.prepare do it in that order)"
            )
        ids = {id(p) for p in self._plans}
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        added = [n for n in names if n not in existing]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, existing + added)
        self._ddp_model = weakref.ref(model)
        self._ddp_ignored_names = sorted(set(self._ddp_ignored_names) | set(added))

    def _restore_ddp(self) -> None:
        """Give the projected weights back to DDP: a later DDP wrap (another trainer, a plain loop) all-reduces them."""
        model = self._ddp_model() if self._ddp_model is not None else None
        if model is None or not self._ddp_ignored_names:
            return
        ours = set(self._ddp_ignored_names)
        kept = [n for n in getattr(model, "_ddp_params_and_buffers_to_ignore", []) if n not in ours]
        model._ddp_params_and_buffers_to_ignore = kept
        for name, p in model.named_parameters():
            if name in ours and name not in kept and getattr(p, "_ddp_ignored", False):
                p._ddp_ignored = False
        self._ddp_ignored_names = []

    @property
    def lowrank_hooks_attached(self) -> bool:
        """Whether the backward hooks that fill the rank-r accumulators are on the weights now."""
        return bool(self._lowrank_hooks)

    def attach_lowrank_hooks(self, model: nn.Module | None = None) -> None:
        """(Re-)register the low-rank accumulation hooks (``lowrank_grads=True`` only; idempotent).

        ``model``: the bare model, whose DDP ignore list then names the projected weights (their rank-r
        accumulators are all-reduced by this optimizer instead).  A low-rank optimizer that held hooks on these
        weights before gives them up.  Done at construction; hf_gradfix's Trainer integration calls it at the start
        of every ``train()`` and :meth:`detach_lowrank_hooks` at its end.
        """
        if not self.lowrank_grads or self._lowrank_hooks:
            return
        for key in [k for k, (pr, owner) in _HOOK_OWNER.items() if pr() is None or owner() is None]:
            del _HOOK_OWNER[key]
        hook = _LowRankHook(self)
        for p in self._plans:
            previous = _hook_owner(p)
            if previous is not None and previous is not self:
                previous.detach_lowrank_hooks()
            self._lowrank_hooks.append(p.register_post_accumulate_grad_hook(hook))
            _HOOK_OWNER[id(p)] = (weakref.ref(p), weakref.ref(self))
        # Versions of the gradients after backward: the projected weights' (when they keep a full gradient to refresh
        # their basis) and, in one process, the plain ones' too (under DDP the reducer copies reduced buckets into
        # plain .grad after these hooks, so only the projected weights, which DDP ignores, are watched there).
        version_hook = _GradVersionHook(self)
        watched = list(self._plans)
        if _world() == 1:
            watched += [p for g in self.param_groups for p in g["params"] if p.requires_grad and p not in self._plans]
        for p in watched:
            self._lowrank_hooks.append(p.register_post_accumulate_grad_hook(version_hook))
        if model is None and self._ddp_model is not None:
            model = self._ddp_model()
        if model is not None:
            self.exclude_from_ddp(model)

    def detach_lowrank_hooks(self) -> None:
        """Take the hooks off the weights (end of training, an exception, another optimizer): the weights get full
        gradients again, DDP all-reduces them again, and a half-filled window's accumulators are dropped.
        ``lowrank_grads`` stays set, so :meth:`attach_lowrank_hooks` (the next ``train()``) turns accumulation back on."""
        _remove_handles(self._lowrank_hooks)
        for p in self._plans:
            if _hook_owner(p) is self:
                del _HOOK_OWNER[id(p)]
        self._lowrank_acc.clear()
        self._lowrank_reduced = False
        if hasattr(self, "_window_basis"):
            self._window_basis.clear()
        self._restore_ddp()

    def remove_lowrank_hooks(self) -> None:
        """Remove the backward hooks for good (the optimizer then steps on full gradients, like ``lowrank_grads=False``)."""
        self.detach_lowrank_hooks()
        self.lowrank_grads = False

    @property
    def _accumulating(self) -> bool:
        return self.lowrank_grads and bool(self._lowrank_hooks)

    def _needs_full_grad(self, p: torch.Tensor, state: dict, group: dict, plan: _Plan) -> bool:
        if p in self._window_basis:
            return False
        return self._refresh_due(state, group, plan) if state else True

    def _lowrank_hook(self, p: torch.Tensor) -> None:
        if p.grad is None or not self._accumulating:
            return
        plan, group = self._plans[p], self._plan_group[p]
        state = self.state[p]
        if self._needs_full_grad(p, state, group, plan):
            if self._has_basis(state) or self.initial_basis == "accumulated":
                return  # this matrix refreshes its basis at the coming step: keep its full gradient
            self._first_basis_from(p, group, plan)  # initial_basis="first_microbatch"
            self._window_basis.add(p)
        # accumulated in the gradient's dtype, as autograd accumulates a full gradient (fp32 stays fp32)
        r = self._project_for_accumulation(p, state, group).to(p.grad.dtype)
        acc = self._lowrank_acc.get(p)
        if acc is None:
            self._lowrank_acc[p] = r
        else:
            acc.add_(r)
        p.grad = None  # the full gradient is freed here: only the rank-r accumulator lives on

    def _first_basis_from(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _project_for_accumulation(self, p: torch.Tensor, state: dict, group: dict) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def _reduce_lowrank_grads(self) -> None:
        """Average the accumulators (and refreshing matrices' full gradients) over the processes, once per step."""
        if self._lowrank_reduced:
            return
        self._lowrank_reduced = True
        if _world() == 1:
            return
        tensors = []
        for p, plan in self._plans.items():
            if not getattr(p, "_ddp_ignored", False):
                raise OptimizerConfigError(
                    f"{self._name}: lowrank_grads=True under torch.distributed needs DDP to leave the projected "
                    f"weights to it ({plan.name} is not excluded): build the optimizer from the model before "
                    "wrapping it in DDP, or call optimizer.exclude_from_ddp(model) first"
                )
            if p in self._lowrank_acc:
                tensors.append(self._lowrank_acc[p])
            elif p.grad is not None:
                tensors.append(p.grad)
            else:  # unused on this rank this window: contribute zeros of the kind the other ranks hold
                state, group = self.state[p], self._plan_group[p]
                if self._needs_full_grad(p, state, group, plan):
                    p.grad = torch.zeros_like(p)
                    tensors.append(p.grad)
                else:
                    acc = torch.zeros(state["exp_avg"].shape, dtype=p.dtype, device=p.device)
                    self._lowrank_acc[p] = acc
                    tensors.append(acc)
        world = _world()
        # buckets of at most 25 MiB per dtype (DDP's bucket size): the flat copy never doubles the accumulators
        buckets: list[list[torch.Tensor]] = []
        open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
        for t in tensors:
            bucket, size = open_bucket.setdefault(t.dtype, ([], [0]))
            if bucket and size[0] + t.numel() * t.element_size() > _BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = open_bucket[t.dtype] = ([], [0])
            bucket.append(t)
            size[0] += t.numel() * t.element_size()
        buckets += [b for b, _ in open_bucket.values() if b]
        for bucket in buckets:
            flat = torch._utils._flatten_dense_tensors(bucket)
            torch.distributed.all_reduce(flat)
            flat.div_(world)
            self.bytes_all_reduced += flat.numel() * flat.element_size()
            for t, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                t.copy_(reduced)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, parameters: Iterable[torch.Tensor] | torch.Tensor | None = None, norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip what this optimizer will step on; returns the total norm before clipping.

        With ``lowrank_grads=True`` that is: the full gradients of plain parameters and of the matrices refreshing
        their basis this step, and the rank-r accumulators ``P^T G`` / ``G P`` of the other projected matrices.
        Projection is linear, so scaling an accumulator is scaling the full gradient it stands for; only the norm
        differs from the full-gradient norm (``||G P|| <= ||G||``: the norm of what Adam consumes).  Without
        ``lowrank_grads`` it is ``torch.nn.utils.clip_grad_norm_``.  Under DDP the accumulators are all-reduced
        first.

        >>> import torch
        >>> from hf_gradfix.optim import GaLoreAdamW
        >>> m = torch.nn.Linear(16, 16, bias=False); opt = GaLoreAdamW([m.weight], rank=4, lowrank_grads=True)
        >>> m(torch.randn(2, 16)).sum().backward()   # first step: the full gradient is kept for the first basis
        >>> bool(opt.clip_grad_norm_(1.0) > 0)
        True
        """
        self._clip_called = True
        if self._accumulating:
            self._reduce_lowrank_grads()
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = list(parameters) if parameters is not None else [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        grads += [self._lowrank_acc[p] for p in params if p in self._lowrank_acc]
        if not grads:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        if max_norm != float("inf"):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
        return total

    def _refuse_outside_clipping(self) -> None:
        """Refuse a step after something scaled ``.grad`` in place that the rank-r accumulators never see.

        A stock Trainer's ``max_grad_norm`` calls torch's ``clip_grad_norm_`` on ``.grad``: it clips the first step
        (every projected weight still holds its full gradient for its first basis) and, from the second on, only the
        plain weights, while Adam consumes unclipped rank-r accumulators.  Found by the gradients' version counters
        and sums (exact comparisons, no tolerance), at the first step that clips, before its update."""
        if self._clip_called or self.clipping_routed:
            return
        touched = [p for p, (version, total) in self._grad_versions.items()
                   if p.grad is not None and p.grad._version != version and not torch.equal(p.grad.detach().sum(), total)]
        self._grad_versions.clear()
        if touched:
            raise UsageError(
                f"{self._name}(lowrank_grads=True): the gradients were changed in place between backward and step() "
                "(torch.nn.utils.clip_grad_norm_ / accelerator.clip_grad_norm_, which a stock Trainer's max_grad_norm "
                "calls, or GradScaler.unscale_), which cannot reach the rank-r accumulators Adam steps on "
                f"({len(self._plans)} projected weights): this run would clip only its first step. Fix: with a Trainer "
                "use hf_gradfix.patch() or GradFixCallback (max_grad_norm then reaches the accumulators), in a loop "
                "call optimizer.clip_grad_norm_(max_norm) instead, or set max_grad_norm=0 / lowrank_grads=False; no "
                "update was applied")

    def _refuse_a_clipping_caller(self) -> None:
        """Refuse a step on rank-r accumulators that the caller means to clip with torch's ``clip_grad_norm_``.

        The version check above sees a clip only where it scaled ``.grad``. Where ``.grad`` alone was under the
        threshold, torch's clip multiplies by exactly 1.0 (as transformers 5.x's grad-norm log at ``inf`` does), yet
        the accumulators this step consumes can carry the norm past it: a stock Trainer with ``max_grad_norm 1.0``
        stepped on norms above 1.0 (and under DDP ``.grad`` of the projected weights is never watched). The caller's
        intent is read from the training loop that called ``step()``: a local ``args`` with ``max_grad_norm > 0``
        (transformers' ``_inner_training_loop``, the accelerate example scripts); 0 (no clipping) or no such caller
        (a hand-written loop) keeps the one warning below."""
        wanted = _callers_max_grad_norm()
        if wanted is not None and wanted > 0:
            raise UsageError(
                f"{self._name}(lowrank_grads=True): the loop that called step() clips at max_grad_norm={wanted:g} with "
                "torch's clip_grad_norm_ on .grad, which cannot reach the rank-r accumulators this step consumes "
                f"({len(self._lowrank_acc)} projected weights): their norm would go unclipped. Fix: with a Trainer use "
                "hf_gradfix.patch() or GradFixCallback (max_grad_norm then reaches the accumulators), in a loop call "
                "optimizer.clip_grad_norm_(max_norm) instead, or set max_grad_norm=0 / lowrank_grads=False; no update "
                "was applied")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_versions.clear()
        self._lowrank_acc.clear()
        self._lowrank_reduced = False
        if hasattr(self, "_window_basis"):
            self._window_basis.clear()
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ introspection

    @property
    def projected_names(self) -> list[str]:
        """Names (or positions) of the matrices this optimizer projects."""
        return [plan.name for plan in self._plans.values()]

    def is_projected(self, p: torch.Tensor) -> bool:
        return p in self._plans

    # ------------------------------------------------------------------ state

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _wrap_like(self, p: torch.Tensor, local: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
        """A low-rank moment as a DTensor with the parameter's placements (the reduced dim is never sharded)."""
        if not _is_dtensor(p):
            return local
        from torch.distributed.tensor import DTensor

        stride = (global_shape[1], 1)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(global_shape), stride=stride)

    def _init_moments(self, p: torch.Tensor, state: dict, side: int, rank: int, dtype: torch.dtype) -> None:
        lp = _local(p)
        m, n = p.shape
        lm, ln = lp.shape
        local_shape, global_shape = ((lm, rank), (m, rank)) if side == proj.RIGHT else ((rank, ln), (rank, n))
        state["exp_avg"] = self._wrap_like(p, torch.zeros(local_shape, dtype=dtype, device=lp.device), global_shape)
        state["exp_avg_sq"] = self._wrap_like(p, torch.zeros(local_shape, dtype=dtype, device=lp.device), global_shape)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Make every rank hold rank 0's tensor: one basis for all, bit for bit (a 3e-10 difference in a
        gradient can otherwise pick a different top-r subspace near a spectral gap)."""
        if self._sync_basis and _world() > 1:
            torch.distributed.broadcast(t, src=0)
        return t

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_loaded_state(state_dict)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype on load; the low-rank state keeps its own dtype.
        saved = state_dict["state"]
        for i, p in enumerate(pp for g in self.param_groups for pp in g["params"]):
            if (p in self._plans or self._keeps_state_dtype) and i in saved:
                for key, value in saved[i].items():
                    cur = self.state[p].get(key)
                    if isinstance(value, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.dtype != value.dtype:
                        # Take the saved tensor, not the cast one cast back: the round trip through the parameter
                        # dtype is lossy (an int64 proj_seed through fp32, fp32 moments through bf16).
                        self.state[p][key] = value.to(device=cur.device)

    def _check_loaded_state(self, state_dict: dict) -> None:
        """Refuse, naming the matrix, a state this optimizer cannot continue from: a full-rank optimizer's (AdamW's
        moments have the matrix's shape) or one saved at another rank (torch would load it and fail later in a
        matmul, or not at all)."""
        saved = state_dict.get("state") if isinstance(state_dict, dict) else None
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict) or not isinstance(groups, list):
            raise UsageError(f"{self._name}.load_state_dict: expected an optimizer state_dict with 'state' and "
                             f"'param_groups', got {type(state_dict).__name__} with keys "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else '-'}")
        params = [p for g in self.param_groups for p in g["params"]]
        rank_of = {id(p): g["rank"] for g in self.param_groups for p in g["params"] if "rank" in g}
        for i, p in enumerate(params):
            plan = self._plans.get(p)
            entry = saved.get(i)
            if plan is None or not isinstance(entry, dict) or not torch.is_tensor(entry.get("exp_avg")):
                continue
            got = tuple(entry["exp_avg"].shape)
            if got == tuple(p.shape):
                raise UsageError(
                    f"{self._name}.load_state_dict: {plan.name}: the saved moments have the matrix's full shape {got}: "
                    f"this state was saved by a full-rank optimizer (AdamW?), not by {self._name}; resume with the "
                    "optimizer that saved it, or start this optimizer fresh (do not load the state)")
            rank = rank_of.get(id(p))
            m, n = p.shape
            want = (m, rank) if plan.side == proj.RIGHT else (rank, n)
            if rank is not None and got != want:
                raise UsageError(
                    f"{self._name}.load_state_dict: {plan.name}: the saved low-rank moments are {got}, this optimizer "
                    f"(rank {rank}) keeps {want}: the state was saved at another rank or projection side; resume with "
                    "the rank it was saved with")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step (projected matrices: low-rank Adam; everything else: AdamW)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._accumulating:
            self._refuse_outside_clipping()
            self._reduce_lowrank_grads()
            if self._lowrank_acc and not (self._clip_called or self.clipping_routed):
                self._refuse_a_clipping_caller()
                self._warn_once("unclipped", (
                    f"{self._name}(lowrank_grads=True) stepped on rank-r accumulators that no clip_grad_norm_ of its "
                    f"own saw: torch.nn.utils.clip_grad_norm_ / accelerator.clip_grad_norm_ (what a stock Trainer's "
                    f"max_grad_norm calls) see only .grad, so they leave {len(self._lowrank_acc)} projected weights "
                    "unclipped and out of grad_norm. Fix: with a Trainer use hf_gradfix.patch() or GradFixCallback "
                    "(they route max_grad_norm to the optimizer), in a loop call optimizer.clip_grad_norm_(max_norm) "
                    "before step(); a loop that does not clip can ignore this"))
        if not self.nonfinite_checked_by_caller and not self._grads_finite():
            message = (
                f"{self._name}: a gradient is NaN or infinite at optimizer step {self._steps_taken() + 1}"
            )
            if self.on_nonfinite == "error":
                raise NonFiniteError(f"{message}; on_nonfinite='error': no update was applied")
            if self.on_nonfinite == "skip":
                self._lowrank_acc.clear()  # the skipped window's accumulated low-rank gradients go with it
                warnings.warn(f"{message}; update skipped (on_nonfinite='skip'): weights and optimizer state unchanged",
                              RuntimeWarning, stacklevel=2)
                return loss
            warnings.warn(f"{message}; the update is applied as torch's AdamW would (weights become NaN); pass "
                          "on_nonfinite='skip' to skip such steps or 'error' to stop", RuntimeWarning, stacklevel=2)
        for group in self.param_groups:
            plain = []
            for p in group["params"]:
                if p in self._lowrank_acc:
                    self._step_projected(p, group, self._plans[p])
                    continue
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise UsageError(f"{self._name} does not support sparse gradients")
                if p in self._plans:
                    self._step_projected(p, group, self._plans[p])
                else:
                    plain.append(p)
            if plain:
                self._step_plain(plain, group)
        self._lowrank_acc.clear()  # consumed: the next window starts from zero (Trainer calls model.zero_grad())
        self._lowrank_reduced = False
        if hasattr(self, "_window_basis"):
            self._window_basis.clear()
        return loss

    def _grads_finite(self) -> bool:
        """Every gradient finite on every rank (a 2-norm per tensor, the max-abs only where one overflows; one
        all-reduce under torch.distributed)."""
        grads = [_local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads += [_local(acc) for acc in self._lowrank_acc.values()]  # low-rank accumulated gradients
        if grads and _is_fake(grads[0]):
            return True  # traced under fake tensors (hf-gradfix plan --simulate): values do not exist
        ok = tensors_finite(grads)
        if _world() > 1:
            dist = torch.distributed
            device = grads[0].device if grads and dist.get_backend() != "gloo" else torch.device("cpu")
            flag = torch.tensor([0.0 if ok else 1.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok = bool(flag.item() == 0)
        return ok

    def _steps_taken(self) -> int:
        steps = [int(st["step"]) for st in self.state.values() if "step" in st]
        return max(steps) if steps else 0

    def _step_plain(self, params: list[torch.Tensor], group: dict) -> None:
        """AdamW, arithmetic of ``torch.optim.AdamW`` (foreach) or of galore-torch's copy of the old HF AdamW."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(float(state["step"]))
        grads = [p.grad for p in params]
        if group["compat"] != "torch":
            for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = v.sqrt().add_(eps)
                step_size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
                p.add_(m / denom, alpha=-step_size)
                if wd > 0:
                    p.add_(p, alpha=-lr * wd)
            return
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = [-(lr / (1 - beta1**t)) for t in steps]
        bc2_sqrt = [math.sqrt(1 - beta2**t) for t in steps]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _refresh_due(self, state: dict, group: dict, plan: _Plan) -> bool:
        step = int(state["step"])
        if not self._has_basis(state):
            return True
        return step >= plan.offset and (step - plan.offset) % group["update_proj_gap"] == 0

    # Subclasses implement these.
    def _has_basis(self, state: dict) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _step_projected(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ shared Adam arithmetic

    @staticmethod
    def _adam_direction(
        r: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict, t: float
    ) -> tuple[torch.Tensor, float]:
        """Update the moments with ``r``; return ``(direction, step_size)``: the update is ``-step_size * direction``.

        torch arithmetic: direction = m_hat / (sqrt(v_hat) + eps), step_size = lr.
        galore_torch / apollo_torch arithmetic: direction = m / (sqrt(v) + eps), step_size = lr sqrt(bc2) / bc1.
        """
        beta1, beta2 = group["betas"]
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        if group["compat"] == "torch":
            m.lerp_(r, 1 - beta1)
            v.mul_(beta2).addcmul_(r, r, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
            return (m / bc1) / denom, group["lr"]
        m.mul_(beta1).add_(r, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(r, r, value=1.0 - beta2)
        denom = v.sqrt().add_(group["eps"])
        return m / denom, group["lr"] * math.sqrt(bc2) / bc1

    @staticmethod
    def _apply(p_local: torch.Tensor, update: torch.Tensor, step_size: float, group: dict) -> None:
        """Decoupled weight decay and the update, in torch's order (decay first) or galore-torch's (decay last)."""
        lr, wd = group["lr"], group["weight_decay"]
        if group["compat"] == "torch":
            if wd != 0:
                p_local.mul_(1 - lr * wd)
            p_local.add_(update.to(p_local.dtype), alpha=-step_size)
        else:
            p_local.add_(update.to(p_local.dtype), alpha=-step_size)
            if wd > 0:
                p_local.add_(p_local, alpha=-lr * wd)
