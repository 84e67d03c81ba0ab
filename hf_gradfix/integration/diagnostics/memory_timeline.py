"""``MemoryTimelineCallback``: the memory timeline of a few steps of a live ``transformers.Trainer`` run.

Each recorded optimizer step (all its micro-batches, the clipping, ``optimizer.step()`` and ``zero_grad``) is a
:class:`~hf_gradfix.diagnostics.memory_timeline.MemoryTimeline`: the bytes of every live storage after every op,
by category (parameters, gradients, optimizer state, activations, temporaries), counted by torch's
``MemTracker`` on the real tensors (CPU or CUDA; on CUDA ``torch.cuda.memory_allocated()`` rides along).  The
peak of each recorded step, split by category, is added to the Trainer's next training log
(``memory/peak_MiB``, ``memory/peak_<category>_MiB``, ``memory/step``), so ``state.log_history`` and every
reporter (TensorBoard, W&B, trackio) see it.  ``plot_path`` writes the picture of the last recorded step at the
end of training; ``predict=True`` also traces the planner's fake-tensor step for the same model, batch shape and
optimizer (:func:`hf_gradfix.plan.simulate.simulate`), with the run's ``gradient_accumulation_steps`` (every
micro-batch after the first runs with the accumulated gradients alive), and draws it beside the measurement.

Other steps run untouched: the tracker is a ``TorchDispatchMode`` entered only for the recorded steps.  For a
hand-written or ``TokenWindow`` loop use :class:`hf_gradfix.diagnostics.MemoryTimelineRecorder` directly.

>>> from hf_gradfix import MemoryTimelineCallback
>>> cb = MemoryTimelineCallback(steps=(2,))
>>> cb.timelines
[]
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

from transformers import Trainer, TrainerCallback

from ...diagnostics.memory_timeline import MemoryTimeline, MemoryTimelineRecorder, peak_log_values
from ...errors import HfGradfixError
from ..calling_trainer import _find_trainer

logger = logging.getLogger("hf_gradfix")
_MISSING = object()


class MemoryTimelineError(HfGradfixError, RuntimeError):
    """The memory timeline cannot be recorded on this trainer; the message says why."""


class MemoryTimelineCallback(TrainerCallback):
    """Record the memory timeline of the optimizer steps ``steps`` (1-based, as the Trainer counts them).

    Args:
        steps: which optimizer steps to record (default: the first, which creates the optimizer state, and the
            second, the steady state).
        plot_path: write the last recorded step's picture there at the end of training (matplotlib).
        predict: also trace the planner's prediction (fake tensors, one process) for the same configuration
            (the largest micro-batch shape seen in the recorded steps, the run's gradient accumulation) and put it
            beside the measurement: in the picture and as ``predicted`` (the planner's timeline).
        log_prefix: prefix of the logged keys.

    ``timelines`` holds the recorded steps (of every ``train()`` this callback took part in, in order);
    ``predicted`` the planner's timeline when ``predict``."""

    def __init__(self, steps: Iterable[int] = (1, 2), plot_path: str | os.PathLike | None = None, *,
                 predict: bool = False, log_prefix: str = "memory/") -> None:
        self.steps = sorted({int(s) for s in steps})
        if not self.steps or self.steps[0] < 1:
            raise ValueError(f"MemoryTimelineCallback(steps={list(steps)!r}): steps are optimizer steps counted from 1")
        self.plot_path = plot_path
        self.predict = predict
        self.log_prefix = log_prefix
        self.predicted: MemoryTimeline | None = None
        self.prediction: dict[str, Any] | None = None
        self.recorder: MemoryTimelineRecorder | None = None
        self._trainer: Trainer | None = None
        self._pending: dict[str, float] = {}
        self._saved_log: Any = _MISSING
        self._log_wrapper: Any = None
        self._shape: tuple[int, int] | None = None
        self._hook: Any = None
        self._step_wrapper: Any = None

    @property
    def timelines(self) -> list[MemoryTimeline]:
        return self.recorder.timelines if self.recorder is not None else []

    # -- attaching ------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = _find_trainer(self)
        if trainer is None:
            raise MemoryTimelineError(
                "MemoryTimelineCallback could not find the Trainer calling it. Add it with "
                "`Trainer(callbacks=[MemoryTimelineCallback()])` or `trainer.add_callback(...)`; in a hand-written or "
                "TokenWindow loop use hf_gradfix.diagnostics.MemoryTimelineRecorder.")
        backend = str(getattr(trainer.accelerator, "distributed_type", ""))
        if any(b in backend for b in ("DEEPSPEED", "XLA", "MEGATRON")):
            raise MemoryTimelineError(f"MemoryTimelineCallback: distributed_type {backend} allocates outside "
                                      "PyTorch's dispatcher; the timeline cannot see it (use DDP, FSDP2 or one "
                                      "process)")
        self._trainer = trainer
        earlier = self.timelines  # a second train() (or Trainer) adds its steps to the ones recorded before
        if self.recorder is not None:
            self.recorder.abort()  # a run that raised inside a recorded step: its tracker is left behind
        self.recorder = MemoryTimelineRecorder(trainer.model, trainer.optimizer,
                                               title=f"{type(trainer.model).__name__}: optimizer step")
        self.recorder.timelines = earlier
        self._install(trainer)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None and self.recorder.recording:
            self.recorder.abort()  # training stopped inside a recorded step
        self._uninstall()
        if self.predict and self.timelines and self.predicted is None:
            self._predict()
        if self.plot_path is not None and state.is_world_process_zero and self.timelines:
            try:
                self.plot(self.plot_path)
            except ImportError as err:
                logger.warning("hf_gradfix: no memory timeline plot written: %s", err)
        return control

    def _install(self, trainer: Trainer) -> None:
        if self._log_wrapper is not None and trainer.__dict__.get("log") is self._log_wrapper:
            return
        self._saved_log = trainer.__dict__.get("log", _MISSING)
        original = trainer.log

        def log(logs, *a, **kw):
            if log is self._log_wrapper and isinstance(logs, dict) and "loss" in logs and self._pending:
                logs.update(self._pending)
                self._pending = {}
            return original(logs, *a, **kw)

        self._log_wrapper = log
        trainer.log = log

        if "training_step" not in trainer.__dict__:
            step = trainer.training_step

            def training_step(*a, **kw):
                # an exception inside a recorded step (the Trainer has no event for it): stop the tracker, which
                # is a dispatch mode every later op would otherwise go through
                try:
                    return step(*a, **kw)
                except BaseException:
                    if self.recorder is not None and self.recorder.recording:
                        self.recorder.abort()
                    self._remove_shape_hook()
                    raise

            self._step_wrapper = training_step
            trainer.training_step = training_step

    def _remove_shape_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _uninstall(self) -> None:
        trainer = self._trainer
        if trainer is not None and self._step_wrapper is not None and \
                trainer.__dict__.get("training_step") is self._step_wrapper:
            del trainer.training_step
        self._step_wrapper = None
        wrapper = self._log_wrapper
        self._log_wrapper = None  # a wrapper left in someone else's chain passes calls through
        if trainer is None or wrapper is None or trainer.__dict__.get("log") is not wrapper:
            return
        if self._saved_log is _MISSING:
            del trainer.log
        else:
            trainer.log = self._saved_log

    # -- recording ------------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if self.recorder is None or self.recorder.recording or state.global_step + 1 not in self.steps:
            return control
        self.recorder.optimizer = self._trainer.optimizer  # created after on_train_begin on some versions
        if self.predict and self._hook is None:
            self._hook = self._trainer.model.register_forward_pre_hook(self._note_shape, with_kwargs=True)
        self.recorder.begin()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is None or not self.recorder.recording:
            return control
        tl = self.recorder.end(step=state.global_step)
        self._remove_shape_hook()
        self._pending = peak_log_values(tl, self.log_prefix)
        self._pending[f"{self.log_prefix}step"] = state.global_step
        return control

    def _note_shape(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and getattr(ids, "dim", lambda: 0)() == 2:
            # the largest micro-batch of the recorded steps (padded shapes vary): the peak is where it runs
            micro, seq = self._shape or (0, 0)
            self._shape = (max(micro, int(ids.shape[0])), max(seq, int(ids.shape[1])))

    # -- the planner's prediction ----------------------------------------------------------------------------------
    def _predict(self) -> None:
        """The planner's fake-tensor step for this model, batch shape, precision and optimizer (one process)."""
        from ...parallel import ParallelDims
        from ...plan.estimate import PlanError, Settings, estimate
        from ...plan.simulate import simulate

        trainer = self._trainer
        config = getattr(getattr(trainer, "model", None), "config", None)
        if config is None or self._shape is None:
            logger.warning("hf_gradfix: no memory prediction: the model has no config or no input_ids were seen")
            return
        optim = getattr(trainer.args, "optim", "adamw_torch")
        optim = str(getattr(optim, "value", optim))
        name = "sgd" if "sgd" in optim else "adamw" if optim.startswith("adamw_torch") else None
        if name is None:
            logger.warning("hf_gradfix: no memory prediction for optim=%s (the planner traces adamw and sgd here)",
                           optim)
            return
        dtype = "amp-bf16" if trainer.args.bf16 else "fp32"
        micro, seq = self._shape
        settings = Settings(seq_len=seq, micro_batch=micro, grad_accum=trainer.args.gradient_accumulation_steps,
                            dtype=dtype, optimizer=name, recompute="full" if trainer.args.gradient_checkpointing
                            else "none")
        try:
            sim = simulate(config, ParallelDims(1), settings)
            plan = estimate(config, ParallelDims(1), settings)
        except PlanError as err:
            logger.warning("hf_gradfix: no memory prediction: %s", err)
            return
        self.predicted = sim["timeline"]
        self.prediction = {"settings": settings, "components": dict(plan.components), "peak": sim["peak"]}

    def plot(self, path: str | os.PathLike, step: int = -1) -> str:
        """The picture of a recorded step (default the last), with the prediction beside it when there is one."""
        tl = self.timelines[step]
        kw: dict[str, Any] = {}
        if self.predicted is not None:
            kw = dict(compare=self.predicted, estimate=self.prediction["components"])
        return tl.plot(str(path), title=f"{tl.title} {tl.step}, {tl.source}"
                       + (", the planner's prediction beside it" if kw else ""), **kw)
