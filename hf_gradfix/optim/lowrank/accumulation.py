"""Low-rank gradient accumulation (``lowrank_grads=True``, GaLore): post-accumulate-grad hooks fold each
micro-batch's gradient into a rank-r accumulator and free the full gradient; DDP is told to leave the projected
weights alone, and the optimizer all-reduces their accumulators in 25 MiB buckets once per step instead.  Apart
from the step, which only consumes the accumulators.

This module imports only torch.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..groups import OptimizerConfigError
from .clipping import _GradVersionHook
from .plan import _Plan
from .tensors import _is_dtensor, _world

_BUCKET_BYTES = 25 * 1024**2  # all-reduce bucket of the low-rank accumulators


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


class LowRankAccumulation:
    """Mixin of :class:`~hf_gradfix.optim.lowrank.LowRankAdamW`: the accumulation hooks and their all-reduce."""

    def _init_accumulation(self, lowrank_grads: bool, initial_basis: str, model: nn.Module | None) -> None:
        # Low-rank gradient accumulation (GaLore): per-parameter rank-r accumulators filled by backward hooks.
        self._lowrank_acc: dict[torch.Tensor, torch.Tensor] = {}
        self._lowrank_hooks: list = []
        # the hooks go when the optimizer goes (the handles hold no reference to it)
        weakref.finalize(self, _remove_handles, self._lowrank_hooks)
        self._ddp_model: weakref.ref | None = None  # the model whose DDP ignore list names the projected weights
        self._ddp_ignored_names: list[str] = []  # the names this optimizer added to it
        self._lowrank_reduced = False
        self.lowrank_grads = bool(lowrank_grads)
        self.initial_basis = initial_basis
        self.bytes_all_reduced = 0  # by this optimizer (low-rank accumulators, refreshing full gradients)
        if initial_basis not in ("accumulated", "first_microbatch"):
            raise OptimizerConfigError(
                f"{self._name}: initial_basis={initial_basis!r} is not one of 'accumulated', 'first_microbatch'"
            )
        if self.lowrank_grads:
            self._setup_lowrank_grads(model)

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
