"""``GradientNoiseScaleCallback``: the gradient noise scale B_simple of a ``transformers.Trainer`` run, logged.

Per measured optimizer step (see :mod:`hf_gradfix.diagnostics.noise_scale` for the estimator and its units):

- small batches: each micro-batch's gradient, seen by a tensor hook on every parameter as it is produced (its norm
  only; under DDP the local, un-reduced gradient); its size is the micro-batch's loss-target count on this rank;
- big batch: the accumulated, all-reduced gradient before clipping; its norm is the one the Trainer computes anyway
  (``Trainer._get_grad_norm`` is wrapped on the instance to read it; nothing is recomputed);
- one all-reduce of 5 numbers per flushed step (flushes happen on logging steps, every ``flush_every`` steps and at
  the end of training: the hooks never synchronize with the device).

``gns/b_simple``, ``gns/grad_sq``, ``gns/trace_sigma`` and ``gns/batch_size`` (the big batch, same unit as B_simple)
are added to the Trainer's training logs before they are dispatched, so ``state.log_history`` and every reporter
(TensorBoard, W&B, trackio, ...) receive them. ``plot(path)`` writes a PNG of B_simple over training (matplotlib).

Scaling of the micro-batch gradients: with hf_gradfix in force (``hf_gradfix.patch()`` or ``GradFixCallback``) every
micro-batch back-propagates ``S_mb * W / N`` (its share of the global window mean), so the unit is the loss's own
target (tokens for LMs, examples for sequence classification) and the big batch is ``N``. On a stock Trainer the
callback mirrors transformers: a window mean over ``num_items_in_batch`` when the count is passed (right for models
that honour it, e.g. causal LMs), else a mean of micro-batch means. Use the plugin for exact scaling with every head.

Supported: one process and DDP. Refused: FSDP, DeepSpeed, tensor/context parallel meshes, ``nn.DataParallel`` (their
hooks see gradient shards or replicas, not micro-batch gradients).

>>> from hf_gradfix import GradientNoiseScaleCallback
>>> cb = GradientNoiseScaleCallback(beta=0.99, every=1)
>>> cb.b_simple != cb.b_simple     # NaN before training
True
"""

from __future__ import annotations

import collections
import logging
import math
import os
import weakref
from collections.abc import Mapping

import torch
from transformers import Trainer, TrainerCallback

from ...diagnostics.noise_scale import NoiseScaleEstimate, NoiseScaleMonitor, plot_noise_scale
from ...loss.counting import CountRule, count_targets, is_token_level
from ..calling_trainer import _find_trainer
from ..instance_methods import InstanceMethods
from ..state import _dp_world, state_of
from ...errors import HfGradfixError, InvalidArgumentError

logger = logging.getLogger("hf_gradfix")

_REFUSED_BACKENDS = ("DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")


class GradientNoiseScaleError(HfGradfixError, RuntimeError):
    """The gradient noise scale cannot be measured on this trainer's setup; the message says why."""


class GradientNoiseScaleCallback(TrainerCallback):
    """Log the gradient noise scale B_simple (McCandlish et al. 2018) of a Trainer run.

    ``Trainer(..., callbacks=[GradientNoiseScaleCallback()])`` or ``trainer.add_callback(...)``, before ``train()``.

    Args:
        beta: EMA decay per measured step of the two smoothed estimates (|G|^2 and tr(Sigma)).
        plot_path: if set, a PNG of B_simple over training is written there at the end of training (main process).
        every: measure one optimizer step in ``every`` (the others cost one Python call per parameter and
            micro-batch); the EMA then spans about ``every / (1 - beta)`` steps.
        flush_every: at most this many measured steps are queued before the statistics are reduced and read.
        record: keep every step's per-micro-batch norms in ``self.monitor.records`` (tests, debugging).

    Read back: ``b_simple``, ``history`` (a list of :class:`NoiseScaleEstimate`), ``plot(path)``.
    """

    def __init__(self, beta: float = 0.99, plot_path: str | os.PathLike | None = None, every: int = 1,
                 flush_every: int = 32, record: bool = False) -> None:  # fmt: skip
        if not 0.0 <= beta < 1.0:
            raise InvalidArgumentError(f"beta must be in [0, 1), got {beta}")
        if int(every) < 1 or int(flush_every) < 1:
            raise InvalidArgumentError("every and flush_every must be >= 1")
        if plot_path is not None:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:  # fail now, not after training
                raise ImportError(
                    "GradientNoiseScaleCallback(plot_path=...) needs matplotlib: `pip install matplotlib` "
                    "(or `pip install 'hf-gradfix[demo]'`), or leave plot_path unset"
                )
        self.beta = float(beta)
        self.plot_path = plot_path
        self.every = int(every)
        self.flush_every = int(flush_every)
        self.record = record
        self.monitor: NoiseScaleMonitor | None = None
        self.unit = "targets"
        self._trainer: Trainer | None = None
        self._active = False
        self._methods = InstanceMethods()
        self._sizes: collections.deque[float] = collections.deque()
        self._window_size: float | None = None
        self._weighting = "tokens"
        self._grad_norm = None
        self._warned: set[str] = set()

    # -- results --------------------------------------------------------------------------------------------------
    @property
    def history(self) -> list[NoiseScaleEstimate]:
        return self.monitor.history if self.monitor is not None else []

    @property
    def b_simple(self) -> float:
        return self.monitor.b_simple if self.monitor is not None else float("nan")

    def plot(self, path: str | os.PathLike) -> str:
        """Write a PNG of B_simple over the measured steps; returns the path (needs matplotlib).

        Reads what has been flushed (at every logging step and at the end of training); no collective."""
        return plot_noise_scale(self.history, path, unit=self.unit)

    def log_values(self) -> dict[str, float]:
        """The ``gns/*`` values added to the next training log (empty before the first estimate)."""
        last = self.monitor.estimator.last if self.monitor is not None else None
        if last is None:
            return {}
        out = {"gns/grad_sq": last.grad_sq, "gns/trace_sigma": last.trace_sigma, "gns/batch_size": last.b_big}
        if math.isfinite(last.b_simple):
            out["gns/b_simple"] = last.b_simple
        return out

    # -- attaching ------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = _find_trainer(self)
        if trainer is None:
            raise GradientNoiseScaleError(
                "GradientNoiseScaleCallback could not find the Trainer calling it. Add it with "
                "`Trainer(callbacks=[GradientNoiseScaleCallback()])` or `trainer.add_callback(...)`; in a hand-written "
                "loop use hf_gradfix.diagnostics.NoiseScaleMonitor."
            )
        _check_setup(trainer)
        # A run that ended without on_train_end (an exception none of our wrappers saw), of this callback or of
        # another one on the same model: its hooks come off now, before this run's hooks go on.
        stale = _MEASURING.get(_unwrapped(trainer.model))
        if stale is not None and stale is not self:
            stale._abort()
        if self._active:
            self._abort()
        if self.monitor is None or self._trainer is not trainer:
            accelerator = trainer.accelerator
            if accelerator.num_processes > 1:
                reduce = lambda t: accelerator.reduce(t, reduction="sum")  # noqa: E731
            else:
                reduce = lambda t: t  # noqa: E731  (one process: nothing to reduce, whatever torch.distributed says)
            self.monitor = NoiseScaleMonitor(
                trainer.model, beta=self.beta, world_size=_world(trainer), reduce=reduce, every=self.every,
                record=self.record,
            )  # fmt: skip
            self._trainer = trainer
        else:
            self.monitor.attach()
        self._install(trainer)
        self._active = True
        _MEASURING[_unwrapped(trainer.model)] = self
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not self._active:
            return control
        self.monitor.discard_window()
        self.monitor.flush()  # every rank: the same steps are queued everywhere
        self._detach()
        if self.plot_path is not None and state.is_world_process_zero and self.history:
            try:
                self.plot(self.plot_path)
            except ValueError as err:  # nothing plottable (e.g. |G|^2 never positive): say so, keep the run
                logger.warning("hf_gradfix: no gradient-noise-scale plot written: %s", err)
        return control

    def _detach(self) -> None:
        """Hooks off the model, wrappers off the trainer: the end of this callback's run."""
        self.monitor.remove()
        self._active = False
        self._uninstall()
        model = _unwrapped(self._trainer.model)
        if _MEASURING.get(model) is self:
            del _MEASURING[model]

    def _abort(self) -> None:
        """The run ended by an exception (the Trainer has no event for it): drop the broken window and detach, so the
        model keeps no hooks. Completed steps still queued are reduced in one process; under DDP they are dropped (a
        collective after one rank's exception could hang)."""
        if not self._active:
            return
        try:
            self.monitor.discard_window()
            if self._trainer.accelerator.num_processes == 1:
                self.monitor.flush()
        except Exception:  # noqa: BLE001  (e.g. a failed device): the run's own exception is the one to see
            logger.warning("hf_gradfix: the gradient noise scale of the steps before the exception is lost")
        finally:
            self._detach()

    def _install(self, trainer: Trainer) -> None:
        """Wrap methods on the trainer instance and its callback handler (their classes are untouched)."""
        self._methods.wrap(trainer, "get_batch_samples", self._wrap_get_batch_samples)
        self._methods.wrap(trainer, "log", self._wrap_log)
        self._methods.wrap(trainer, "training_step", self._wrap_raising)
        self._methods.wrap(trainer.callback_handler, "call_event", self._wrap_raising)
        if hasattr(trainer, "_get_grad_norm"):  # transformers 5.x: the pre-clip norm, whatever computes it
            self._methods.wrap(trainer, "_get_grad_norm", self._wrap_get_grad_norm)
        else:  # transformers 4.57: read what clip_grad_norm_ returns
            self._methods.wrap(trainer.accelerator, "clip_grad_norm_", self._wrap_get_grad_norm)

    def _uninstall(self) -> None:
        self._methods.remove_all()  # from now on our wrappers left in a chain only pass calls through

    # -- wrappers -------------------------------------------------------------------------------------------------
    # Each wrapper acts only while it is installed (``InstanceMethods.live``): a wrapper left in a chain by someone
    # who wrapped the same method after us passes calls through, so nothing is counted twice.
    def _live(self, wrapper) -> bool:
        return self._active and self._methods.live(wrapper)

    def _wrap_get_batch_samples(self, original):
        def get_batch_samples(epoch_iterator, num_batches, device):
            batches, num_items = original(epoch_iterator, num_batches, device)
            if self._live(get_batch_samples):
                st = state_of(self._trainer)
                window = st.window if st is not None else None
                if window is not None and window.pending:  # hf_gradfix counts this window at its first forward
                    window.on_counted.append(lambda: self._live(get_batch_samples) and self._start_window(batches, num_items))
                else:
                    self._start_window(batches, num_items)
            return batches, num_items

        return get_batch_samples

    def _wrap_raising(self, original):
        """``training_step`` (forward and backward) and the callback handler's ``call_event`` (every other
        callback): an exception there ends the run, so the hooks come off before it propagates."""

        def wrapper(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException:
                if self._live(wrapper):
                    self._abort()
                raise

        return wrapper

    def _wrap_get_grad_norm(self, original):
        def get_grad_norm(*args, **kwargs):
            norm = original(*args, **kwargs)
            if self._live(get_grad_norm):
                self._grad_norm = norm
            return norm

        return get_grad_norm

    def _wrap_log(self, original):
        def log(logs, *args, **kwargs):
            if self._live(log) and isinstance(logs, dict) and ("loss" in logs or "grad_norm" in logs):
                logs.update(self.log_values())
            return original(logs, *args, **kwargs)

        return log

    # -- per window -----------------------------------------------------------------------------------------------
    def _start_window(self, batches: list, num_items) -> None:
        monitor = self.monitor
        monitor.discard_window()  # leftovers of a window the loop broke off
        self._sizes.clear()
        self._grad_norm = None
        if not monitor.measuring:
            return
        trainer = self._trainer
        weighting, rule, window_size = _plan(trainer, num_items, self._warn_once)
        self._weighting, self._window_size = weighting, window_size
        for batch in batches:
            size = 0.0
            if rule is not None and isinstance(batch, Mapping):
                size = float(count_targets(batch, rule))
                labels = batch.get("labels")
                if self.unit == "targets" and torch.is_tensor(labels) and size > 0:
                    self.unit = "tokens" if is_token_level(labels) else "examples"
            self._sizes.append(size)

    def _close_micro_batch(self) -> None:
        if self.monitor.measuring:
            self.monitor.micro_batch_done(self._sizes.popleft() if self._sizes else 0.0)

    def on_substep_end(self, args, state, control, **kwargs):
        if self._active:
            self._close_micro_batch()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self._active:
            return control
        self._close_micro_batch()
        grad_norm, self._grad_norm = self._grad_norm, None
        if grad_norm is None and args.max_grad_norm and args.max_grad_norm > 0 and self.monitor.measuring:
            self._warn_once("clipped", "hf_gradfix: the pre-clip gradient norm was not visible; measuring the clipped "
                            "gradient (B_simple is biased on clipped steps)")  # fmt: skip
        self.monitor.step_done(self._window_size, grad_norm=grad_norm, weighting=self._weighting, sync=False,
                               step=state.global_step + 1)  # the step number the Trainer logs for this step
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # Collective when distributed: every rank takes the same decision here (the flags are the same everywhere).
        if self._active and self.monitor.pending and (
            control.should_log or control.should_training_stop or self.monitor.pending >= self.flush_every
        ):
            self.monitor.flush()
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        # logging_strategy="epoch" decides to log here, after on_step_end: flush so the epoch's log is fresh
        if self._active and self.monitor.pending and control.should_log:
            self.monitor.flush()
        return control

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


# model -> the callback whose hooks are on it (at most one run trains a model at a time)
_MEASURING: "weakref.WeakKeyDictionary[torch.nn.Module, GradientNoiseScaleCallback]" = weakref.WeakKeyDictionary()


def _unwrapped(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _world(trainer: Trainer) -> int:
    """Replicas whose gradients DDP averages."""
    if state_of(trainer) is not None:
        return _dp_world(trainer)
    return max(1, trainer.accelerator.num_processes)


def _check_setup(trainer: Trainer) -> None:
    backend = str(getattr(trainer.accelerator.distributed_type, "value", trainer.accelerator.distributed_type))
    why = None
    if backend in _REFUSED_BACKENDS:
        why = f"the {backend} backend shards or manages the gradients itself"
    elif getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_distributed_loading_by_transformers", False):
        why = "the model is sharded (FSDP / loaded sharded)"
    elif getattr(trainer.args, "n_gpu", 1) > 1:
        why = f"nn.DataParallel over {trainer.args.n_gpu} GPUs runs replicas in one process"
    else:
        st = state_of(trainer)
        nd = st.nd if st is not None else None
        if nd is not None and getattr(nd, "route", "ddp") != "ddp":
            why = f"an ND-parallel mesh ({nd.route}) shards the gradients"
        else:
            get_tp = getattr(trainer, "get_tp_size", None)
            if callable(get_tp) and int(get_tp()) > 1:
                why = "tensor parallelism shards the gradients"
    if why is not None:
        raise GradientNoiseScaleError(
            f"GradientNoiseScaleCallback supports one process and DDP only: {why}, so the parameter hooks do not see "
            "whole micro-batch gradients. Remove the callback for this run, or measure on a DDP run."
        )
    optimizer = getattr(trainer, "optimizer", None)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps ours
    if getattr(optimizer, "lowrank_grads", False):
        # the micro-batch hooks would see full gradients while the window's gradient of every projected weight only
        # exists projected (rank r): |G|^2 and tr(Sigma) would measure different things, so B_simple would be wrong
        raise GradientNoiseScaleError(
            "GradientNoiseScaleCallback cannot measure with optimizer.lowrank_grads: true: the accumulated gradient of "
            "the projected weights is kept only in rank-r form, so the big-batch gradient norm is not the full one. "
            "Measure the noise scale on a run with optimizer.lowrank_grads: false (same model and data), or remove "
            "the callback."
        )


def _plan(trainer: Trainer, num_items, warn) -> tuple[str, CountRule | None, float | None]:
    """(weighting, count rule or None: unmeasurable window, N of the loss) for the window just fetched."""
    st = state_of(trainer)
    if st is not None and st.enabled:  # hf_gradfix: S_mb * W / N with the loss's own count rule
        window = st.window
        if not st.probed or st.chain is None or window is None or window.global_count is None:
            return "tokens", None, None  # a window without labels: nothing to measure
        return "tokens", CountRule(st.chain.count_rule), float(window.global_count)
    rule = _stock_rule(trainer)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items is not None) or (
            trainer.compute_loss_func is not None
        )
    if num_items is not None and scaled:
        if trainer.accelerator.num_processes > 1 and not trainer.args.average_tokens_across_devices:
            warn("local-count", "hf_gradfix: average_tokens_across_devices=False normalizes each rank by its own count; "
                 "the gradient noise scale is not measured (use hf_gradfix.patch() or turn the averaging on)")  # fmt: skip
            return "tokens", None, None
        n = float(num_items.sum()) if torch.is_tensor(num_items) else float(num_items)
        return "tokens", rule, n
    return "mean", rule, None


def _stock_rule(trainer: Trainer) -> CountRule:
    """The targets a stock model's loss averages over: transformers 5.x's own ``_loss_shifts_labels`` test.

    (transformers 4.x *counts* every label that is not -100, also the first of each row, but a causal LM's loss
    still averages over the shifted ones: the sizes here are the loss's true targets, and :func:`resolve_window`
    rescales the big gradient by ``N / sum n``.)"""
    shifts = getattr(trainer, "_loss_shifts_labels", None)
    if shifts is None:
        try:
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
        except ImportError:
            return CountRule.UNSHIFTED
        model = trainer.accelerator.unwrap_model(trainer.model)
        shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not getattr(
            getattr(model, "config", None), "is_encoder_decoder", False
        )
    return CountRule.SHIFTED if shifts else CountRule.UNSHIFTED
