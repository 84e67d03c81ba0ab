"""``GradFixCallback``: the same fixes for one trainer, without a global patch."""

from __future__ import annotations

import sys

from transformers import Trainer, TrainerCallback

from ..config import GradFixConfig, config_to_dict
from ..config.sources import combine, label_for, source_of
from ..errors import HfGradfixError
from .calling_trainer import _find_trainer
from .patching import fix_trainer, patch_sources, swap_to_fixed_class
from .state import state_of
from .versions import check_supported, warn_if_untested


class GradFixCallbackError(HfGradfixError, RuntimeError):
    """The callback cannot fix the trainer it was added to."""


def _check_resumed_checkpoint(trainer: Trainer) -> None:
    """Added with ``add_callback`` after construction, the callback fixes the trainer at ``on_train_begin``, after
    ``train()`` chose its checkpoint as stock does (``resume_from_checkpoint=True``: the highest N, torn or not). A
    folder hf_gradfix wrote that is incomplete (a file of its save missing, a torn save with a ``trainer_state.json``
    of an earlier one) is refused here, before the first step, instead of training on from partial state. The value
    is read from the frame of the training loop that called us (bounded walk, reads locals only)."""
    from .checkpoints.complete import resolve

    frame, depth = sys._getframe(1), 0
    while frame is not None and depth < 50:
        if frame.f_locals.get("self") is trainer and "resume_from_checkpoint" in frame.f_locals:
            chosen = frame.f_locals["resume_from_checkpoint"]
            break
        frame, depth = frame.f_back, depth + 1
    else:
        return
    if not isinstance(chosen, str):
        return
    try:
        resolve(trainer, chosen)
    except HfGradfixError as err:
        raise GradFixCallbackError(
            f"{err} (GradFixCallback was added with add_callback after the Trainer was built, so train() chose this "
            "checkpoint before hf_gradfix could: pass it at construction, Trainer(..., callbacks=[GradFixCallback()]), "
            "or use hf_gradfix.patch(), and resume_from_checkpoint=True takes the newest complete one)") from None


class GradFixCallback(TrainerCallback):
    """Make one ``Trainer``'s loss exact: ``Trainer(..., callbacks=[GradFixCallback()])`` or ``trainer.add_callback(...)``.

    Applies the fixes of :func:`hf_gradfix.patch` to that trainer only, before its first optimizer step.
    Added after training has started, it raises :class:`GradFixCallbackError` (the steps already taken
    used the wrong normalization). Its settings combine with ``$HF_GRADFIX_CONFIG``'s (the launch file's) and, under
    ``hf_gradfix.patch()``, with ``patch()``'s by one rule (:mod:`hf_gradfix.config.sources`): each sets the keys it
    names, the others keep theirs; a key set to two different values is refused naming both. Added with
    ``add_callback`` after construction, it can still add loss settings; packing, optimizer or parallel settings are
    then an error, since those are built with the trainer.

    >>> from hf_gradfix import GradFixCallback
    >>> cb = GradFixCallback({"loss": {"count_rule": "auto"}})
    >>> cb.config.loss.count_rule
    'auto'
    """

    def __init__(self, config: GradFixConfig | dict | str | None = None) -> None:
        check_supported()
        warn_if_untested()  # once per process: the versions CI did not test, and how to install those it did
        self.source = source_of(config, label_for(config, "GradFixCallback"))
        self.config, self.settings_from = combine(patch_sources() + [self.source])  # a conflict is refused here
        self._trainer = None
        self._saw_init = False  # on_init_end seen: the callback was given to the Trainer's constructor

    def _attach(self, state_obj) -> bool:
        """Fix the trainer calling us (idempotent); True when it was fixed by this call."""
        fixed_now = False
        trainer = _find_trainer(self)
        if trainer is None:
            raise GradFixCallbackError(
                "GradFixCallback could not find the Trainer calling it. Add it with `Trainer(callbacks=[...])` or "
                "`trainer.add_callback(GradFixCallback())`, or use `hf_gradfix.patch()`."
            )
        if state_of(trainer) is None:
            if self.config.packing.enabled and not self._saw_init:
                raise GradFixCallbackError(
                    "hf_gradfix.packing.enabled: GradFixCallback was added with add_callback after the Trainer was "
                    "built, and the Trainer builds its data loader (with its own collator) before any callback runs. "
                    "Pass it at construction, Trainer(..., callbacks=[GradFixCallback(...)]), or use hf_gradfix.patch()."
                )
            if self.config.optimizer.name != "none" and getattr(trainer, "optimizer", None) is not None:
                raise GradFixCallbackError(
                    f"hf_gradfix.optimizer.name={self.config.optimizer.name!r}: the Trainer already built its "
                    f"optimizer ({type(trainer.optimizer).__name__}) before GradFixCallback saw it (it was added with "
                    "add_callback after construction). Pass it at construction, Trainer(..., callbacks=[GradFixCallback(...)]), "
                    "or use hf_gradfix.patch()."
                )
            # under patch(): patch()'s settings too (the Trainer's __init__ calls us before patch()'s wrapper installs)
            config, settings_from = combine(patch_sources() + [self.source])
            fix_trainer(trainer, config, source="GradFixCallback", settings_from=settings_from)
            fixed_now = True
        else:
            self._combine_with_patch(trainer)
        from .diagnostics.nonfinite import attach

        attach(trainer, state_of(trainer).config)
        from .parallel.deepspeed import attach as attach_deepspeed

        attach_deepspeed(trainer, state_of(trainer).config)
        from .rl.packing import attach as attach_rl_packing

        attach_rl_packing(trainer, state_of(trainer).config)
        self._trainer = trainer
        return fixed_now

    def _combine_with_patch(self, trainer: Trainer) -> None:
        """Added with add_callback to a trainer patch() fixed: its settings combine with patch()'s (the rule of
        :mod:`hf_gradfix.config.sources`), if nothing they change is built already."""
        from .patching import _differences

        state = state_of(trainer)
        if state.source == "GradFixCallback":
            return
        config, settings_from = combine(patch_sources() + [self.source])
        if config == state.config:
            return
        ours, theirs = config_to_dict(config), config_to_dict(state.config)
        built = [d for section in ("packing", "optimizer", "parallel")
                 for d in _differences({section: theirs[section]}, {section: ours[section]})]
        if built or state.probed:
            what = "; ".join(f"hf_gradfix.{d}" for d in built) or "loss settings after the first batch"
            raise GradFixCallbackError(
                "GradFixCallback(config) was added to a trainer that hf_gradfix.patch() already fixed, too late to "
                f"change its settings ({what}: the data loader, optimizer and mesh are already built). "
                "Pass it at construction, Trainer(..., callbacks=[GradFixCallback(...)]), or put the settings in "
                "patch()'s configuration."
            )
        state.config = config
        state.source = "GradFixCallback"
        state.settings_from = settings_from
        if config.loss.enabled:
            swap_to_fixed_class(trainer)

    def on_init_end(self, args, state, control, **kwargs):
        self._saw_init = True
        self._attach(state)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if self._attach(state):
            _check_resumed_checkpoint(self._trainer)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # added with add_callback after construction, the trainer got its fixed class inside this train() call, so
        # the class's train() cannot take a lowrank_grads optimizer's hooks off: done here (idempotent)
        if self._trainer is not None:
            from .optim_trainer import end_lowrank_training

            end_lowrank_training(self._trainer)
        return control

    def _check_attached(self, args, state, event: str) -> None:
        if self._trainer is None:
            raise GradFixCallbackError(
                f"GradFixCallback was added after training started (first event seen: {event} at global step "
                f"{state.global_step}); the steps already taken used transformers' normalization. Fix: add it "
                "before `trainer.train()`, with `Trainer(callbacks=[GradFixCallback()])` or `trainer.add_callback(...)`."
            )

    def on_step_begin(self, args, state, control, **kwargs):
        self._check_attached(args, state, "on_step_begin")
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        self._check_attached(args, state, "on_substep_end")
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._check_attached(args, state, "on_pre_optimizer_step")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._check_attached(args, state, "on_step_end")
        return control
