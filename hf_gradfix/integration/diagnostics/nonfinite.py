"""Non-finite steps: what a NaN or inf loss or gradient does to a Trainer run (``loss.on_nonfinite``).

Stock transformers applies the update of a window whose loss or gradients are NaN/inf: every weight becomes
NaN and the only signal is ``grad_norm: nan`` (the logged loss even looks finite, ``logging_nan_inf_filter``
drops the bad value).  :func:`attach` (called by ``patch()`` and ``GradFixCallback``) adds a guard to the trainer:

- every micro-batch's loss is kept as ``training_step`` returns it, remembering the step and micro-batch;
- before the optimizer step the window's losses and its gradients (an overflow in the backward of a finite loss) are
  checked, read back together (one host sync per window, none per micro-batch), and the verdict is agreed by every
  rank (one all-reduce of a flag), so all ranks take the same decision;
- ``warn`` (default): a warning naming the step and the micro-batch(es), then stock behaviour (the update is
  applied: never worse than stock, and stock stays reachable); on one process the verdict is read with the next
  window's count (one host sync per window for both), so its warning comes at the next window's start;
- ``skip``: that optimizer step is skipped: weights, optimizer state and the lr schedule stay as they were
  (the step counter advances, the window's gradients are dropped), with a warning;
- ``error``: :class:`~hf_gradfix.errors.NonFiniteError` naming the step and micro-batch(es), before the update.

The low-rank optimizers (:mod:`hf_gradfix.optim`) take the same ``on_nonfinite`` argument for plain loops; on a
Trainer the guard owns the check and tells the optimizer so (one warning, one decision).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ...config import GradFixConfig
from ...diagnostics.finite import norms_finite_flags, tensors_finite
from ...errors import InvalidArgumentError, NonFiniteError
from ..internal_callbacks import add_internal_callback
from ..state import defer_read, read_pending, take_pending_reads

logger = logging.getLogger("hf_gradfix")

_ATTR = "_gradfix_nonfinite"
MODES = ("warn", "skip", "error")


_MISSING = object()


def _put_back(optimizer: Any, previous: Any) -> None:
    """Restore the instance-level ``step`` that was there before the skipped step (or none)."""
    if previous is _MISSING:
        optimizer.__dict__.pop("step", None)
    else:
        optimizer.step = previous


class NonFiniteWarning(RuntimeWarning):
    """A step with a NaN/inf loss or gradient (``loss.on_nonfinite`` is ``warn`` or ``skip``)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def grads_finite(params: Any) -> bool:
    """True when every gradient of ``params`` is finite (this rank's shard; one 2-norm per tensor, one sync; a
    non-finite 2-norm is settled by the max-abs: :func:`hf_gradfix.diagnostics.finite.tensors_finite`).

    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([1.0, float("nan")])
    >>> grads_finite([p])
    False
    >>> p.grad = torch.tensor([3e38, 3e38])  # finite, but the 2-norm overflows
    >>> grads_finite([p])
    True
    """
    return tensors_finite(_local(p.grad) for p in params if getattr(p, "grad", None) is not None)


def agree_any(flags: list[bool], device: torch.device | None = None) -> list[bool]:
    """Each flag True when it is True on any rank (one all-reduce; identity without torch.distributed).

    >>> agree_any([True, False])
    [True, False]
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(flags)
    backend = dist.get_backend()
    dev = device if device is not None and backend != "gloo" else torch.device("cpu")
    if backend == "nccl" and (dev is None or dev.type != "cuda"):
        dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in t.tolist()]


class NonFiniteGuard(TrainerCallback):
    """The per-trainer guard (see the module docstring); ``mode`` is ``loss.on_nonfinite``."""

    def __init__(self, trainer: Trainer, mode: str) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"on_nonfinite={mode!r}; allowed: {', '.join(MODES)}")
        self.trainer = trainer
        self.mode = mode
        self.micro_batch = 0  # micro-batches seen since the last optimizer step
        self.bad: list[tuple[int, float]] = []  # (micro-batch, loss value) with a non-finite loss, this window
        # (micro-batch, its loss, detached): read back once, before the optimizer step (see _read_window)
        self.losses: list[tuple[int, torch.Tensor]] = []
        self.skipped_steps: list[int] = []
        self.flagged_steps: list[int] = []
        self._overflow_set = False
        # DeepSpeed's engine (set by hf_gradfix.integration.parallel.deepspeed): it steps inside the last backward, before
        # on_pre_optimizer_step, and drops a step with a NaN/inf gradient norm itself
        self.engine: Any = None

    # ---- per micro-batch
    def after_micro_batch(self, loss: Any) -> None:
        self.micro_batch += 1
        if torch.is_tensor(loss) and loss.numel() and loss.is_floating_point():
            self.losses.append((self.micro_batch, loss.detach()))

    def _read_window(self, params: list) -> bool:
        """Read the window's loss flags and values and the gradients' finiteness back together (one host sync; a
        second only where a 2-norm is not finite: an overflow of finite values or a NaN); sets ``self.bad``.
        Returns whether this rank's gradients are finite."""
        grads = [_local(p.grad) for p in params if getattr(p, "grad", None) is not None]
        flags = norms_finite_flags(grads)
        losses, self.losses = self.losses, []
        if not flags and not losses:
            return True
        device = flags[0].device if flags else losses[0][1].device
        parts = [f.float().reshape(1).to(device) for f in flags]
        for _, value in losses:
            value = value.to(device)
            parts += [torch.isfinite(value).all().float().reshape(1), value.float().reshape(-1)[:1]]
        read = torch.cat(parts).tolist()
        norms_ok, values = read[:len(flags)], read[len(flags):]
        for i, (micro, _) in enumerate(losses):
            if not values[2 * i]:
                self.bad.append((micro, values[2 * i + 1]))
        return all(norms_ok) or tensors_finite(grads)

    # ---- per optimizer step
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        optimizer = getattr(trainer, "optimizer", None)
        self._restore(optimizer)
        self._own_the_check(optimizer)  # also here: cheap, and independent of which handler dispatched on_train_begin
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.read_deferred()  # a previous window's verdict that no read of the plugin took along
        step = state.global_step + 1
        ga = max(1, int(getattr(trainer, "current_gradient_accumulation_steps", 0) or args.gradient_accumulation_steps))
        if self._defer(params, step, ga):
            return control
        # under DeepSpeed the gradients live in the engine's partitions (p.grad is None): its overflow check, which
        # reduces over every rank, says whether they were finite
        engine_skipped = self.engine is not None and not self.engine.was_step_applied()
        local_grads_ok = self._read_window(params) and not engine_skipped
        device = next((p.device for p in params), None)
        loss_bad_anywhere, grads_bad_anywhere = agree_any([bool(self.bad), not local_grads_ok], device)
        bad, micro = self.bad, self.micro_batch
        self.bad, self.micro_batch = [], 0
        return self._verdict(step, ga, micro, bad, loss_bad_anywhere, grads_bad_anywhere, local_grads_ok,
                             engine_skipped, control)

    def _defer(self, params: list, step: int, ga: int) -> bool:
        """``warn`` on one process: the window's verdict (loss flags and values, the gradients' 2-norms in float64,
        which overflow for no finite fp32 / half gradient) stays on the device and is read with the plugin's next
        read (the next window's count: one host sync per window for both; :func:`..state.defer_read`); its warning
        comes then, naming this step. The update is stock's either way (``warn``). Elsewhere: read now."""
        dist = torch.distributed
        if self.mode != "warn" or self.engine is not None or (
                dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        grads = [_local(p.grad).detach() for p in params if getattr(p, "grad", None) is not None]
        grads = [g for g in grads if g.numel() and g.is_floating_point()]
        if any(g.dtype == torch.float64 for g in grads):
            return False
        by_device: dict = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        losses, self.losses = self.losses, []
        micro, self.micro_batch = self.micro_batch, 0
        if not by_device and not losses:
            return True
        device = next(iter(by_device)) if by_device else losses[0][1].device
        parts = [torch.isfinite(torch.stack(torch._foreach_norm(ts, 2.0, dtype=torch.float64))).all()
                 .double().reshape(1).to(device) for ts in by_device.values()]
        for _, value in losses:
            value = value.to(device)
            parts += [torch.isfinite(value).all().double().reshape(1), value.float().reshape(-1)[:1].double()]
        norms = len(by_device)
        marks = [m for m, _ in losses]

        def on_read(flat: list[float]) -> None:
            bad = [(m, flat[norms + 2 * i + 1]) for i, m in enumerate(marks) if not flat[norms + 2 * i]]
            grads_ok = all(flat[:norms])
            self._verdict(step, ga, micro, bad, bool(bad), not grads_ok, grads_ok, False, None)

        defer_read(self.trainer, torch.cat(parts), on_read)
        return True

    def read_deferred(self) -> None:
        """Read a deferred verdict now (its own host sync): no read of the plugin took it along."""
        pending = take_pending_reads(self.trainer)
        if pending:
            read_pending(pending, torch.cat([v.detach().reshape(-1).double().cpu() for v, _ in pending]).tolist())

    def on_train_end(self, args, state, control, **kwargs):
        self.read_deferred()  # the last window's verdict
        return control

    def _verdict(self, step, ga, micro, bad, loss_bad_anywhere, grads_bad_anywhere, local_grads_ok, engine_skipped,
                 control):
        if not (loss_bad_anywhere or grads_bad_anywhere):
            return control
        self.flagged_steps.append(step)
        trainer = self.trainer
        if bad:
            where = ", ".join(f"micro-batch {m} of {max(ga, micro)} (loss {v})" for m, v in bad)
            what = f"optimizer step {step}: non-finite loss in {where}"
        elif loss_bad_anywhere:
            what = (f"optimizer step {step}: another rank had a non-finite loss (its warning names the micro-batch; "
                    "the gradient all-reduce brings it here)")
        elif not local_grads_ok:
            what = (f"optimizer step {step}: non-finite gradients although every loss of the {max(ga, micro)} "
                    "micro-batches was finite (an overflow in the backward)")
        else:
            what = f"optimizer step {step}: another rank had non-finite gradients"
        if self.engine is not None:
            return self._deepspeed_verdict(what, step, engine_skipped, control)
        if self.mode == "error":
            raise NonFiniteError(
                f"{what}; hf_gradfix.loss.on_nonfinite is 'error', so training stops before the update (the weights "
                "are still finite). Fix: check that batch's data, lower the learning rate or use bf16/fp32; or set "
                "loss.on_nonfinite: skip to drop such steps"
            )
        if self.mode == "skip":
            self._skip(getattr(trainer, "optimizer", None))
            self.skipped_steps.append(step)
            warnings.warn(
                f"hf_gradfix: {what}; the update was skipped (loss.on_nonfinite: skip): weights, optimizer state and "
                "the learning-rate schedule are unchanged, the window's gradients are dropped",
                NonFiniteWarning, stacklevel=2,
            )
            return control
        warnings.warn(
            f"hf_gradfix: {what}; the update is applied as stock transformers does, so the weights will be NaN "
            "(loss.on_nonfinite: warn). Set hf_gradfix.loss.on_nonfinite: skip to skip such steps, or error to stop",
            NonFiniteWarning, stacklevel=2,
        )
        return control

    def _deepspeed_verdict(self, what: str, step: int, engine_skipped: bool, control):
        """Under DeepSpeed the engine has already stepped (or dropped the step): report it, per ``mode``."""
        if not engine_skipped and self.mode in ("skip", "error"):
            raise NonFiniteError(
                f"{what}; DeepSpeed's engine applied this update before hf_gradfix could {self.mode} it (its overflow "
                "check found the gradient norm finite or is off: zero_optimization.compute_grad_norm false, "
                "bf16.check_grad_overflow false, or no ZeRO optimizer). Fix: keep DeepSpeed's gradient-norm check on "
                "(the defaults), or set loss.on_nonfinite: warn"
            )
        done = ("DeepSpeed's overflow check dropped the update: weights, optimizer state and the learning-rate schedule "
                "are unchanged, the window's gradients are dropped" if engine_skipped else
                "DeepSpeed applied the update as stock does")
        if self.mode == "error":
            raise NonFiniteError(
                f"{what}; {done}; hf_gradfix.loss.on_nonfinite is 'error', so training stops here (the weights are "
                "still finite). Fix: check that batch's data, lower the learning rate or use bf16/fp32; or set "
                "loss.on_nonfinite: skip to drop such steps"
            )
        if self.mode == "skip":
            self.skipped_steps.append(step)
            warnings.warn(f"hf_gradfix: {what}; {done} (loss.on_nonfinite: skip)", NonFiniteWarning, stacklevel=3)
            return control
        warnings.warn(f"hf_gradfix: {what}; {done} (loss.on_nonfinite: warn; stock DeepSpeed behaves the same)",
                      NonFiniteWarning, stacklevel=3)
        return control

    def _skip(self, optimizer: Any) -> None:
        if optimizer is None:
            return
        # torch's LR scheduler keeps its own wrapper as the instance's ``step`` (it warns "optimizer.step() has been
        # overridden" if that wrapper is gone), so ours replaces it for one call and then puts it back
        previous = optimizer.__dict__.get("step", _MISSING)

        def _skipped_step(*args: Any, **kwargs: Any) -> None:
            _put_back(optimizer, previous)  # one step only

        _skipped_step._hf_gradfix_skip = previous
        optimizer.step = _skipped_step
        if hasattr(optimizer, "_is_overflow"):
            # accelerate's AcceleratedOptimizer: step_was_skipped -> neither the Trainer nor accelerate's
            # scheduler wrapper steps the lr schedule (as for an fp16 overflow step)
            optimizer._is_overflow = True
            self._overflow_set = True

    def _restore(self, optimizer: Any) -> None:
        if optimizer is None:
            return
        ours = optimizer.__dict__.get("step")
        if ours is not None and hasattr(ours, "_hf_gradfix_skip"):  # only ever our own one-step replacement
            _put_back(optimizer, ours._hf_gradfix_skip)
        if self._overflow_set:
            optimizer._is_overflow = False
            self._overflow_set = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._own_the_check(getattr(self.trainer, "optimizer", None))
        return control

    @staticmethod
    def _own_the_check(optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if hasattr(inner, "on_nonfinite"):
            # a low-rank optimizer: the guard owns the check on a Trainer (one warning, one decision)
            inner.nonfinite_checked_by_caller = True


def attach(trainer: Trainer, config: GradFixConfig) -> NonFiniteGuard:
    """Guard ``trainer`` against non-finite steps per ``config.loss.on_nonfinite`` (idempotent; updates the mode).

    The guard runs after the trainer's callbacks without joining its callback list
    (:mod:`hf_gradfix.integration.internal_callbacks`).

    >>> import transformers
    >>> from transformers.trainer_callback import CallbackHandler
    >>> from hf_gradfix.config import GradFixConfig
    >>> t = object.__new__(transformers.Trainer); t.callback_handler = CallbackHandler([], None, None, None, None)
    >>> attach(t, GradFixConfig()).mode, t.callback_handler.callbacks
    ('warn', [])
    """
    mode = config.loss.on_nonfinite
    guard = trainer.__dict__.get(_ATTR)
    if guard is not None:
        guard.mode = mode
        add_internal_callback(trainer, guard)  # idempotent; wraps a callback handler a subclass put in since
        return guard
    guard = NonFiniteGuard(trainer, mode)
    trainer.__dict__[_ATTR] = guard

    previous = trainer.__dict__.get("training_step")  # another instance-level wrapper (e.g. verify_trainer's): kept

    def training_step(*args: Any, **kwargs: Any):
        # else looked up on the class at call time: a later class swap (hf_gradfix's fixed class) is honoured
        loss = previous(*args, **kwargs) if previous is not None else type(trainer).training_step(trainer, *args, **kwargs)
        guard.after_micro_batch(loss)
        # a callback handler a subclass built after this attach (from the old one's list) gets the dispatch too, before
        # the step's on_pre_optimizer_step, and the run's missed on_train_begin (a dictionary lookup when nothing changed)
        add_internal_callback(trainer, guard, in_training=True)
        return loss

    trainer.training_step = training_step
    add_internal_callback(trainer, guard)
    return guard


def guard_of(trainer: Trainer) -> NonFiniteGuard | None:
    """The trainer's :class:`NonFiniteGuard`, or None."""
    return trainer.__dict__.get(_ATTR)


__all__ = ["MODES", "NonFiniteGuard", "NonFiniteWarning", "agree_any", "attach", "grads_finite", "guard_of"]
