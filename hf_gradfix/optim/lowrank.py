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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import projection as proj
from ..errors import InvalidArgumentError, InvalidTypeError, NonFiniteError, UsageError
from .groups import OptimizerConfigError, low_rank_param_groups, select_targets

__all__ = ["LowRankAdamW"]

_METHODS = ("auto", "svd", "randomized", "identity")
_ON_SWITCH = ("keep", "reset", "reproject")
_SIDES = ("auto", "right", "left", "std", "reverse_std")
_COMPAT = ("torch", "galore_torch", "apollo_torch")
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
    _extra_defaults: dict[str, Any] = {}

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
        stagger: bool = False,
        targets: str | list[str] | None = None,
        exclude: list[str] | tuple[str, ...] = (),
        no_decay: Iterable[str] | None = None,
        oversample: int = 8,
        niter: int = 2,
        seed: int = 0,
        compat: str = "torch",
        sync_basis: bool = True,
        on_nonfinite: str = "warn",
        **extra: Any,
    ) -> None:
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
        super().__init__(groups, defaults)
        for group in self.param_groups:
            self._validate_group(group)
        self._names: dict[torch.Tensor, str] = names
        self._plans: dict[torch.Tensor, _Plan] = {}
        self._warned: set[str] = set()
        self._make_plans(explicit=targets not in (None, "all-linear") or not names)
        self._deepspeed_check()

    # ------------------------------------------------------------------ construction

    def _intake(self, params, targets, exclude, weight_decay, no_decay) -> tuple[list[dict], dict]:
        """Normalize the accepted inputs to param groups; remember names where they are given."""
        if isinstance(params, nn.Module):
            groups = low_rank_param_groups(
                params, targets=targets, exclude=exclude, weight_decay=weight_decay, no_decay=no_decay
            )
            if not any(g["project"] for g in groups):
                raise OptimizerConfigError(f"{self._name}: targets={targets!r} select no 2-D trainable weight")
            names = {p: n for g in groups for p, n in zip(g["params"], g.pop("param_names"))}
            return groups, names
        if isinstance(params, torch.Tensor):
            raise InvalidTypeError(f"{self._name}: params must be an iterable of tensors, named tensors or groups, or a model")
        items = list(params)
        if not items:
            raise InvalidArgumentError(f"{self._name}: got an empty parameter list")
        raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
        groups, names = [], {}
        for g in raw_groups:
            g = dict(g)
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

    def _validate_group(self, g: dict) -> None:
        n = self._name

        def bad(key: str, why: str) -> None:
            raise OptimizerConfigError(f"{n}: {key}={g[key]!r} {why}")

        if not (isinstance(g["lr"], (int, float, torch.Tensor)) and float(g["lr"]) >= 0):
            bad("lr", "must be >= 0")
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            bad("betas", "must both be in [0, 1)")
        if not g["eps"] >= 0:
            bad("eps", "must be >= 0")
        if not g["weight_decay"] >= 0:
            bad("weight_decay", "must be >= 0")
        if not (isinstance(g["rank"], int) and g["rank"] >= 1):
            bad("rank", "must be an integer >= 1")
        if not (isinstance(g["update_proj_gap"], int) and g["update_proj_gap"] >= 1):
            bad("update_proj_gap", "must be an integer >= 1 (optimizer steps between basis refreshes)")
        if not (isinstance(g["scale"], (int, float)) and math.isfinite(g["scale"]) and g["scale"] > 0):
            bad("scale", "must be a finite number > 0")
        if not (math.isfinite(float(g["lr"])) and math.isfinite(g["eps"]) and math.isfinite(g["weight_decay"])):
            bad("lr", "lr, eps and weight_decay must be finite")
        for key, allowed in (("proj_side", _SIDES), ("proj_method", _METHODS), ("on_switch", _ON_SWITCH), ("compat", _COMPAT)):
            if g[key] not in allowed:
                bad(key, f"is not one of {', '.join(map(repr, allowed))}")
        if not (isinstance(g["min_size"], int) and g["min_size"] >= 0):
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
            if group["rank"] >= d and group["proj_method"] != "identity":
                if explicit:
                    raise OptimizerConfigError(
                        f"{self._name}: rank={group['rank']} is not below the projected dimension {d} of {name} "
                        f"(shape {tuple(p.shape)}); lower the rank, or set min_size={d + 1} so matrices this small "
                        "stay plain AdamW"
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
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype on load; the low-rank state keeps its own dtype.
        saved = state_dict["state"]
        for i, p in enumerate(pp for g in self.param_groups for pp in g["params"]):
            if p in self._plans and i in saved:
                for key, value in saved[i].items():
                    cur = self.state[p].get(key)
                    if isinstance(value, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.dtype != value.dtype:
                        # Take the saved tensor, not the cast one cast back: the round trip through the parameter
                        # dtype is lossy (an int64 proj_seed through fp32, fp32 moments through bf16).
                        self.state[p][key] = value.to(device=cur.device)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step (projected matrices: low-rank Adam; everything else: AdamW)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.nonfinite_checked_by_caller and not self._grads_finite():
            message = (
                f"{self._name}: a gradient is NaN or infinite at optimizer step {self._steps_taken() + 1}"
            )
            if self.on_nonfinite == "error":
                raise NonFiniteError(f"{message}; on_nonfinite='error': no update was applied")
            if self.on_nonfinite == "skip":
                warnings.warn(f"{message}; update skipped (on_nonfinite='skip'): weights and optimizer state unchanged",
                              RuntimeWarning, stacklevel=2)
                return loss
            warnings.warn(f"{message}; the update is applied as torch's AdamW would (weights become NaN); pass "
                          "on_nonfinite='skip' to skip such steps or 'error' to stop", RuntimeWarning, stacklevel=2)
        for group in self.param_groups:
            plain = []
            for p in group["params"]:
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
        return loss

    def _grads_finite(self) -> bool:
        """Every gradient finite on every rank (one max-abs per tensor; one all-reduce under torch.distributed)."""
        grads = [_local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads and _is_fake(grads[0]):
            return True  # traced under fake tensors (hf-gradfix plan --simulate): values do not exist
        ok = all(bool(torch.isfinite(n).all()) for n in torch._foreach_norm(grads, float("inf"))) if grads else True
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
