"""Clipping what a low-rank optimizer steps on (``lowrank_grads=True``): ``clip_grad_norm_`` over the full
gradients and the rank-r accumulators, and the refusal of a step after torch's clip (which sees only ``.grad``)
would have left the accumulators unclipped.  Apart from the accumulation hooks, which only fill the accumulators.

This module imports only torch.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from ...errors import UsageError


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


class AccumulatorClipping:
    """Mixin of :class:`~hf_gradfix.optim.lowrank.LowRankAdamW`: clipping over the rank-r accumulators."""

    def _init_clipping(self) -> None:
        # Set by hf_gradfix's Trainer integration, which routes max_grad_norm to clip_grad_norm_ (or by a caller
        # who clips only .grad on purpose); else a step on accumulators that no clip_grad_norm_ of ours saw warns
        # once (torch's clip does not see them), and a step after .grad was changed in place is refused.
        self.clipping_routed = False
        self._clip_called = False
        # parameter -> (version, sum) of its .grad after the last backward (see _GradVersionHook); checked at step()
        self._grad_versions: dict[torch.Tensor, tuple[int, torch.Tensor]] = {}

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
