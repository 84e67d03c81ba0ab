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

This module holds :class:`LowRankAdamW`'s public surface: the constructor, ``step()`` (with the non-finite check),
the plain-AdamW path and the Adam arithmetic the subclasses share.  Intake and validation of the groups
(:mod:`.intake`), the per-matrix plan (:mod:`.plan`), the low-rank accumulation hooks and their all-reduce
(:mod:`.accumulation`), clipping (:mod:`.clipping`) and the moments / checkpoint loading (:mod:`.state`) are
mixins composed here.

This module imports only torch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...diagnostics.finite import tensors_finite
from ...errors import InvalidTypeError, NonFiniteError, UsageError
from ...torch_private import require
from ..groups import OptimizerConfigError
from .accumulation import LowRankAccumulation
from .clipping import AccumulatorClipping
from .intake import ParamGroupIntake
from .plan import MatrixPlans, _Plan
from .state import LowRankState
from .tensors import _is_fake, _local, _world

__all__ = ["LowRankAdamW"]

_ON_NONFINITE = ("warn", "skip", "error")
_SEED_MAX = 2**32 - 1
_FOREACH = ("_foreach_norm", "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_",
            "_foreach_add_", "_foreach_addcdiv_")


class LowRankAdamW(ParamGroupIntake, MatrixPlans, LowRankAccumulation, AccumulatorClipping, LowRankState,
                   torch.optim.Optimizer):
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
        self._init_clipping()
        self._init_accumulation(lowrank_grads, initial_basis, params if isinstance(params, nn.Module) else None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_versions.clear()
        self._lowrank_acc.clear()
        self._lowrank_reduced = False
        if hasattr(self, "_window_basis"):
            self._window_basis.clear()
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


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
