"""hf_gradfix's own per-trainer event handlers, kept out of the Trainer's callback list.

The non-finite guard (every patched Trainer), the DeepSpeed checks and the packing balance log react to the Trainer's
events like callbacks, but the callback list (``trainer.callback_handler.callbacks``, ``callback_list``) is the
user's: they read it, remove from it, and tests assert it exactly (transformers' own ``test_trainer_callback.py``
compares it with the default callbacks, and failed with the guard in it: measured by ``scripts/peer_suites.py``).
So these handlers are not added to it: the handler's ``call_event`` is wrapped on the instance
(:class:`~hf_gradfix.integration.instance_methods.InstanceMethods`, once per handler) to call them after every
callback of the list, for every event, with the same arguments, the last returned control winning as the list's do.

>>> from transformers import TrainerControl, TrainerState, TrainingArguments
>>> from transformers.trainer_callback import CallbackHandler, TrainerCallback
>>> class Seen(TrainerCallback):
...     def on_step_end(self, args, state, control, **kwargs):
...         control.should_log = True
>>> handler = CallbackHandler([], None, None, None, None)
>>> t = type("T", (), {})(); t.callback_handler = handler
>>> add_internal_callback(t, Seen())
>>> handler.callbacks, handler.call_event("on_step_end", None, TrainerState(), TrainerControl()).should_log
([], True)
"""

from __future__ import annotations

from typing import Any

from .instance_methods import InstanceMethods

__all__ = ["add_internal_callback", "internal_callbacks"]

_LIST = "_hf_gradfix_internal_callbacks"
_METHODS = "_hf_gradfix_internal_methods"
_BEGAN = "_hf_gradfix_internal_began"  # the TrainerState whose on_train_begin the handlers saw


def internal_callbacks(trainer: Any) -> list:
    """hf_gradfix's handlers on ``trainer`` (in the order they run, after the callback list)."""
    return list(trainer.__dict__.get(_LIST, ()))


def add_internal_callback(trainer: Any, callback: Any, *, in_training: bool = False) -> None:
    """Run ``callback``'s event methods on every event of ``trainer``, after the callback list (idempotent).

    The handlers are kept on the trainer and the trainer's *current* callback handler is wrapped: calling this again
    after a subclass replaced the handler (TRL's experimental BEMA DPOTrainer builds a new one from the old one's
    callback list after ``super().__init__``) wraps the new one. ``in_training``: the caller runs inside ``train()``
    (the guard's ``training_step``); if this run's ``on_train_begin`` went through an unwrapped handler, the
    handlers get it now, once, before the first optimizer step (the DeepSpeed checks link the engine there)."""
    callbacks = trainer.__dict__.setdefault(_LIST, [])
    if not any(c is callback for c in callbacks):
        callbacks.append(callback)
    handler = trainer.callback_handler
    methods = handler.__dict__.get(_METHODS)
    if methods is None:
        methods = handler.__dict__[_METHODS] = InstanceMethods()
    if not methods.all_installed():
        def wrap(original):
            def call_event(event, args, state, control, **kwargs):
                control = original(event, args, state, control, **kwargs)
                if not methods.live(call_event):  # unlinked by someone's later wrapper: pass through
                    return control
                return _dispatch(trainer, handler, event, args, state, control, **kwargs)
            return call_event

        methods.wrap(handler, "call_event", wrap)
    state = getattr(trainer, "state", None)
    if in_training and state is not None and trainer.__dict__.get(_BEGAN) is not state:
        _dispatch(trainer, handler, "on_train_begin", trainer.args, state, trainer.control)


def _dispatch(trainer: Any, handler: Any, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
    """Call ``event`` on every handler of ``trainer`` as the callback handler calls its list; the last returned
    control wins. Which run's ``on_train_begin`` was seen is kept by its state (``train()`` makes a new one)."""
    if event == "on_train_begin":
        trainer.__dict__[_BEGAN] = state
    extra = {name: getattr(handler, name, None) for name in (
        "model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader")}
    for callback in list(trainer.__dict__.get(_LIST, ())):
        method = getattr(callback, event, None)
        if method is None:
            continue
        result = method(args, state, control, **{**extra, **kwargs})
        if result is not None:
            control = result
    return control
