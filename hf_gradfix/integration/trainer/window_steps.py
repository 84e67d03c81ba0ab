"""The window concern of the top layer: ``get_batch_samples`` draws each optimizer window and counts its targets
once over every rank (or leaves that to the window's first ``compute_loss``, where the probe runs), and
``training_step`` runs each micro-batch of it, telling a step of the drawn window from a call of the caller's own.

The window's parts and the stock fallbacks are in :mod:`.windows`; this module is what the Trainer's loop reaches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from ...loss.counting import count_targets
from ..state import _replicated_divisor, _Step, _Window, state_of
from .default_loss import _GradFixDefaultLoss
from .layers import first_class_defining
from .probe import _prepare
from .reading import _has_labels
from .windows import (
    _NOT_COUNTED,
    _all_reduce_sum,
    _as_stock,
    _begin_stock_window,
    _close_short_window,
    _disable,
    _draw_window,
    _end_stock_window,
    _IdleMicroBatch,
    _never_opened,
    _sequence_sharded,
    _version,
    _watch_backward,
)
from .workloads import detect_rl, pipeline_step, pipeline_window

logger = logging.getLogger("hf_gradfix")


def get_batch_samples(trainer, parent, /, epoch_iterator, num_batches, device):
    """The window's micro-batches and the count its loss is normalized by (``parent``: the next class's)."""
    state = state_of(trainer)
    if state is not None and state.pp is not None:
        return pipeline_window(trainer, state, epoch_iterator, num_batches, device)
    if state is not None:
        _end_stock_window(trainer, state)  # a deferred probe is tried again on every window
        _never_opened(trainer, state)
    if state is not None and state.config.packing.enabled and not state.config.loss.enabled:
        batches, count = parent(epoch_iterator, num_batches, device)
        _check_packed(batches)
        return _close_short_window(trainer, batches, num_batches, device), count
    if state is None or not state.enabled:
        return parent(epoch_iterator, num_batches, device)
    batches, count = draw_window(trainer, parent, epoch_iterator, num_batches, device)
    if state.nd is not None:  # first window: every tp rank got the same batches (a collective on all ranks)
        from ..parallel.nd import check_window

        check_window(trainer, state.nd, batches)
    host = _check_packed(batches) if state.config.packing.enabled else {}
    sharded = _sequence_sharded(trainer)
    if not state.probed and not sharded:
        # The loss is probed inside the window's first step (the window's first compute_loss), where the training
        # loop and the trainer have set everything a compute_loss reads; the window is counted there. Until then
        # the Trainer holds stock's own count: what this window trains with if it ends up stock.
        if not batches:
            state.window = None
            return batches, None
        if count is _NOT_COUNTED:
            count = trainer._get_num_items_in_batch(batches, device)
        batches = _close_short_window(trainer, batches, num_batches, device)
        state.window = _Window(None, len(batches), batches, pending=True, host=host)
        return batches, count
    # Context / sequence parallelism: probed here, on the whole drawn sequences, before the step splits them (inside
    # the step, compute_loss sees a shard, and the probe's forwards would run in the step's context-parallel
    # region); the probe then gives the loop's per-window attributes their coming values (see _probe)
    decided = True if state.probed else _prepare(trainer, state, batches)
    window = _Window(None, len(batches), batches, host=host)
    counted = count_window(trainer, state, window, decided=decided)
    if counted == "empty":
        return batches, None
    if counted in ("stock", "disabled"):
        return batches, trainer._get_num_items_in_batch(batches, device)
    batches = _close_short_window(trainer, batches, num_batches, device)
    window.batches = batches
    if counted == "no_labels":
        return batches, trainer._get_num_items_in_batch(batches, device)
    return batches, count_tensor(trainer, window.global_count)


def draw_window(trainer, parent, epoch_iterator, num_batches, device) -> tuple[list, Any]:
    """(the window's micro-batches, the count stock passes or ``_NOT_COUNTED``): through a trainer subclass's own
    ``get_batch_samples`` when it has one, else drawn the way transformers draws them (without stock's count,
    which costs a collective and is used only if the window runs as stock)."""
    owner = first_class_defining(trainer, "get_batch_samples")
    if owner is not None and owner not in (_GradFixDefaultLoss, Trainer):
        batches, count = parent(epoch_iterator, num_batches, device)
        return list(batches), count
    return _draw_window(epoch_iterator, num_batches), _NOT_COUNTED


def count_tensor(trainer, count: float) -> torch.Tensor:
    # int64 like transformers' own count (a float64 count would turn the loss into float64)
    value = int(count) if float(count).is_integer() else float(count)
    return torch.tensor(value, device=trainer.args.device)


def count_window(trainer, state, window: _Window, decided: bool) -> str:
    """Count the window's targets once over every rank (every rank joins, also with an empty window or a probe that
    failed, so nobody hangs) and set ``window.global_count``; becomes ``state.window``. Returns what the window
    is: "counted", "no_labels" (trains as stock), "stock" (a probe undecided on some rank: this window as stock),
    "disabled" (some rank cannot read its batches: the trainer trains as stock), "empty" (past the end of the
    data)."""
    batches = [b for b in window.batches if not isinstance(b, _IdleMicroBatch)]
    has_labels = any(_has_labels(b) for b in batches)
    local = 0.0
    if state.probed and has_labels and state.disabled_reason is None:
        if window.host and all(id(b) in window.host for b in batches):  # host copies (packing): no read back
            local = float(sum(int(count_targets(window.host[id(b)], state.chain.count_rule)) for b in batches))
        else:  # summed on the device, read back with the flags below: one host sync per window, none per micro-batch
            counts = [count_targets(b, state.chain.count_rule) for b in batches]
            local = torch.stack([c.to(device=trainer.args.device, dtype=torch.float64) for c in counts]).sum()
    disabled = state.disabled_reason is not None or state.rewritten is not None
    total, ranks_with_labels, ranks_undecided, micro_batches, ranks_disabled = _all_reduce_sum(
        trainer,
        [local, 1.0 if has_labels else 0.0, 0.0 if decided else 1.0, float(len(batches)), 1.0 if disabled else 0.0],
    )
    window.pending = False
    window.micro_batches = len(batches)  # the real ones: what stock divides by where it divides
    state.window = None
    if ranks_disabled:
        if state.rewritten is not None:
            _disable(trainer, state, state.rewritten, log=False)  # logged when it was seen
        _disable(trainer, state, "hf_gradfix: another rank cannot read its training batches (its warning names them); "
                 f"{type(trainer).__name__} trains exactly as stock computes it on every rank.")
        return "disabled"
    if micro_batches == 0:  # past the end of the data (a stream's epoch ran out): nothing to count or train
        return "empty"
    if ranks_undecided:  # a NaN / inf probe on some rank: every rank runs this window as stock
        _begin_stock_window(trainer, state)
        return "stock"
    state.window = window
    if ranks_with_labels == 0:
        if not state.no_labels_logged:
            logger.warning(
                "hf_gradfix: %s's batches carry no 'labels'; targets cannot be counted, so the loss is left "
                "exactly as stock computes it. Put the targets under 'labels' for an exact token mean.",
                type(trainer).__name__,
            )
            state.no_labels_logged = True
        return "no_labels"
    window.global_count = total / _replicated_divisor(trainer)
    return "counted"


def open_window(trainer, state, inputs) -> None:
    """The window's first forward: probe the loss (once per trainer) on the batch compute_loss was given, then
    count the window."""
    window = state.window
    if state.rl is None and not state.probed and detect_rl(trainer, state, inputs):
        if state.rl is None:  # recognized, but left to TRL (one warning said why)
            return
    if state.rl is not None:  # a TRL policy-gradient trainer: its window counted from the generation batch
        from ..rl.policy_gradient import open_window as open_rl_window

        open_rl_window(trainer, state.rl, window.micro_batches, lambda values: _all_reduce_sum(trainer, values))
        window.pending = False
        return
    prepared = inputs if isinstance(inputs, Mapping) else None
    drawn = state.step.drawn if state.step is not None and prepared is not None else None
    decided = _prepare(trainer, state, window.batches, prepared=prepared, drawn=drawn)
    count_window(trainer, state, window, decided)
    callbacks, window.on_counted = window.on_counted, []
    for callback in callbacks:
        callback()


def training_step(trainer, parent, /, model, inputs, *args, **kwargs):
    """One micro-batch: of the drawn window, or a call of the caller's own (``parent``: the next class's)."""
    state = state_of(trainer)
    if state is not None and state.pp is not None:  # the whole window as one schedule step, on its last micro-batch
        return pipeline_step(trainer, state, inputs)
    if isinstance(inputs, _IdleMicroBatch):  # the front of a window the data ended inside: nothing to train
        return torch.zeros((), device=trainer.args.device)
    if state is None or not state.enabled:
        return parent(model, inputs, *args, **kwargs)
    num_items = kwargs.get("num_items_in_batch", args[0] if args else None)
    window = state.window
    # A micro-batch of the window the loop drew, or a call of the caller's own (a hand-written loop, a fresh
    # trainer, after train()): then the caller's count is the window's, as in stock transformers.
    explicit = window is None or not window.holds(inputs)
    targets = {k: v.clone() for k, v in inputs.items() if k in ("labels", "shift_labels") and torch.is_tensor(v)} \
        if isinstance(inputs, Mapping) else {}
    refs = {k: (v, _version(v)) for k, v in inputs.items() if k in ("labels", "shift_labels") and torch.is_tensor(v)} \
        if isinstance(inputs, Mapping) else {}
    step = _Step(explicit=explicit, count=num_items if explicit else None, drawn=inputs, drawn_targets=targets,
                 drawn_refs=refs)
    stock_step = explicit and (num_items is None or not _has_labels(inputs))
    if stock_step and num_items is None and not state.explicit_logged:
        logger.info(
            "hf_gradfix: %s.training_step was called outside train() without num_items_in_batch: the loss is the "
            "micro-batch's own, exactly as stock computes it. Pass num_items_in_batch (the window's target count "
            "over all ranks) for an exact step.", type(trainer).__name__,
        )
        state.explicit_logged = True
    state.step = step
    try:
        with _as_stock(trainer, state) if stock_step else contextlib.nullcontext(), _watch_backward(trainer, state, step):
            result = parent(model, inputs, *args, **kwargs)
    finally:
        state.step = None
    if step.rescaled_by is not None and torch.is_tensor(result):
        result = result * step.rescaled_by  # the logged loss: the division undone there too
    return result


def _check_packed(batches: list) -> dict:
    """Check the window's packed micro-batches on host copies brought over in one transfer; returns them
    (``id(micro-batch) -> copy``) for the window's count."""
    from ...packing.collator import check_packed_batch, host_copies

    copies = host_copies(batches)
    for batch in copies:
        check_packed_batch(batch)
    return {id(b): c for b, c in zip(batches, copies)}
