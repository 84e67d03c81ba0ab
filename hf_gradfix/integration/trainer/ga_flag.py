"""``loss_is_scaled_for_ga``: whether the Trainer divides the loss by the accumulation steps. The fixed class answers
True while its loss is window-normalized, and the trainer's own value (the user's, the class's) otherwise.

Apart because the value the trainer would have had is read from several places (the property, the stock rule for
batches without labels, TRL's policy-gradient detection) and moved aside before the class swap.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from ..state import state_of
from .layers import below_top


def loss_is_scaled_for_ga(trainer: Trainer) -> Any:
    """The fixed class's ``loss_is_scaled_for_ga``."""
    # transformers 5.x: our compute_loss returns window-normalized losses, so training_step must not
    # divide by the accumulation steps. When the fix is off, the user's or the class's own value.
    state = state_of(trainer)
    if state is not None and state.config.loss.enabled and state.disabled_reason is None and not state.stock_window:
        return True
    return _own_loss_is_scaled_for_ga(trainer)


def set_loss_is_scaled_for_ga(trainer: Trainer, value: Any) -> None:
    """Its setter: the value is the trainer's own, read back by :func:`_own_loss_is_scaled_for_ga`."""
    trainer.__dict__["_gradfix_loss_is_scaled_for_ga"] = value


def _we_divide_by_ga(trainer: Trainer, num_items: Any) -> bool:
    """Batches without labels: divide by the accumulation steps exactly when stock transformers would.

    On 5.x our ``loss_is_scaled_for_ga`` property says True, so the Trainer never divides and we apply the
    stock rule (the class's or user's own ``loss_is_scaled_for_ga``, e.g. TRL's GRPO sets it). On 4.57 the
    Trainer divides by itself whenever no count is passed, which is the stock behaviour already.
    """
    if not hasattr(Trainer, "loss_is_scaled_for_ga"):
        return False
    scaled = _own_loss_is_scaled_for_ga(trainer)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    return not scaled


_GA_FLAG = "_gradfix_loss_is_scaled_for_ga"


def _own_loss_is_scaled_for_ga(trainer: Trainer) -> Any:
    """The trainer's own ``loss_is_scaled_for_ga``: set on the instance (after the class swap, through our setter;
    before it, e.g. by a subclass before ``super().__init__()``, as a plain instance attribute that our property
    would otherwise hide), else its class's value."""
    if _GA_FLAG in trainer.__dict__:
        return trainer.__dict__[_GA_FLAG]
    if "loss_is_scaled_for_ga" in trainer.__dict__:
        return trainer.__dict__["loss_is_scaled_for_ga"]
    return below_top(trainer, "loss_is_scaled_for_ga", None)


def _keep_instance_ga_flag(trainer: Trainer) -> None:
    """Before the class swap: a ``loss_is_scaled_for_ga`` the instance already holds moves where our property reads it."""
    if "loss_is_scaled_for_ga" in trainer.__dict__:
        trainer.__dict__[_GA_FLAG] = trainer.__dict__.pop("loss_is_scaled_for_ga")
