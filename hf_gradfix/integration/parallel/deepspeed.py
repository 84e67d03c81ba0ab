"""The Trainer under DeepSpeed ZeRO: no silent clipping, and ``loss.on_nonfinite`` told what the engine did.

Under DeepSpeed the Trainer neither clips nor steps the optimizer itself: accelerate's wrapper runs the engine's
``step()`` inside the backward of the window's last micro-batch, and the engine clips at its own
``gradient_clipping``. :func:`attach` (called by ``patch()`` and ``GradFixCallback`` next to the non-finite guard)
adds a callback that, when training begins (the engine exists):

- compares the engine's clipping with ``TrainingArguments.max_grad_norm`` and raises one line naming both values and
  the fix on a mismatch (``gradient_clipping: 0`` in an accelerate YAML is dropped and DeepSpeed clips at 1.0);
- hands the engine to the non-finite guard: DeepSpeed's ZeRO optimizers drop a step whose gradient norm is NaN/inf
  themselves (weights, optimizer state and lr schedule unchanged), before ``on_pre_optimizer_step``; the guard reads
  ``engine.was_step_applied()`` to report what happened, and refuses to pretend when the engine applied such a step.

The loss itself needs nothing DeepSpeed-specific: the engine averages gradients over the data-parallel ranks like
DDP, and the plugin's window count (``num_items_in_batch`` x world size) is exact under ZeRO 1, 2 and 3.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer, TrainerCallback

from ...config import GradFixConfig
from ...parallel.deepspeed import check_clipping
from ..diagnostics.explained_warnings import explain

logger = logging.getLogger("hf_gradfix")

_ATTR = "_gradfix_deepspeed"


def deepspeed_engine(trainer: Trainer) -> Any | None:
    """The trainer's DeepSpeed engine once ``train()`` has prepared it, else None (no DeepSpeed import needed)."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine = getattr(trainer, "model_wrapped", None)
    if engine is None or not hasattr(engine, "was_step_applied") or not hasattr(engine, "gradient_clipping"):
        return None
    return engine


class DeepSpeedGuard(TrainerCallback):
    """Checks made when a DeepSpeed engine starts training (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.engine: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        engine = deepspeed_engine(self.trainer)
        self.engine = engine
        if engine is None:
            return control
        check_clipping(float(engine.gradient_clipping() or 0.0), getattr(args, "max_grad_norm", 0.0))
        from ..diagnostics.nonfinite import guard_of

        guard = guard_of(self.trainer)
        if guard is not None:
            guard.engine = engine
        return control


#: accelerate's logger and line (accelerator.py, ``_prepare_deepspeed``) for every Trainer under DeepSpeed with GA > 1
ACCELERATE_LOGGER = "accelerate.accelerator"
GA_MISMATCH = "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has "
GA_MISMATCH_NOTE = (
    " [hf_gradfix: expected with transformers' Trainer, not an error: the Trainer runs accelerate with 1 and counts "
    "the window itself, and hands its gradient_accumulation_steps to DeepSpeed, whose engine then marks each "
    "window's end; the loss is exact (tests/parallel/test_deepspeed.py)]"
)


def explain_accelerate_warnings() -> None:
    """Explain accelerate's mismatch line (it looks like an error and is the normal path), once per process. Only the
    Trainer's own case (accelerate at 1): a DeepSpeed file that pins another value than TrainingArguments is refused
    by transformers before this line. Idempotent; ``unpatch()`` takes it off (:mod:`..diagnostics.explained_warnings`)."""
    explain(ACCELERATE_LOGGER, GA_MISMATCH, GA_MISMATCH_NOTE)


def attach(trainer: Trainer, config: GradFixConfig) -> DeepSpeedGuard | None:
    """Add the DeepSpeed checks to ``trainer`` when it runs under DeepSpeed (idempotent). Returns the guard or None."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    explain_accelerate_warnings()
    from ..internal_callbacks import add_internal_callback

    guard = trainer.__dict__.get(_ATTR)
    if guard is None:
        guard = DeepSpeedGuard(trainer)
        trainer.__dict__[_ATTR] = guard
    add_internal_callback(trainer, guard)  # out of the user's callback list; idempotent
    return guard


__all__ = ["DeepSpeedGuard", "attach", "deepspeed_engine", "explain_accelerate_warnings"]
