"""The loss concern of the top layer: ``compute_loss`` turns whatever the effective ``compute_loss`` below it returns
into ``S_mb * W / N`` (``N``: the window's targets over every data rank), opens the window on its first call (the
probe, then the count), hands TRL's policy-gradient losses to their objectives, and leaves a window whose
micro-batches were rewritten exactly as stock.

The eval branch (no count: a micro-batch mean, summed into the exact eval totals) is in :mod:`.evaluation`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch

from ...loss.counting import count_targets
from ..state import _dp_world, state_of
from .evaluation import eval_loss
from .ga_flag import _we_divide_by_ga
from .probe import _prepare
from .reading import _has_labels, _split, _zero_connected
from .window_steps import count_tensor, open_window
from .windows import _begin_stock_window, _record_returned, _same_targets, _sequence_sharded

logger = logging.getLogger("hf_gradfix")


def compute_loss(trainer, parent, /, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
    """The micro-batch's loss normalized by the window's count (``parent``: the next class's compute_loss)."""
    state = state_of(trainer)
    chain = parent
    if state is None or not state.enabled:
        return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
    step, window = state.step, state.window
    window_step = step is not None and not step.explicit and window is not None
    if window_step and window.pending and model.training:
        open_window(trainer, state, inputs)
        window = state.window
    else:
        _prepare(trainer, state, [inputs], prepared=inputs if isinstance(inputs, Mapping) else None)
    if not state.enabled:  # a layout or loss the plugin cannot read, or a window run as stock: exactly stock
        return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
    if state.rl is not None:  # TRL's policy-gradient losses: each term by its objective over the window
        if not (window_step and model.training and state.rl.counted):
            return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        from ..rl.policy_gradient import window_loss

        loss = window_loss(trainer, state.rl, inputs, lambda: chain(
            model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch, **kwargs))
        _record_returned(step, loss)
        return (loss, None) if return_outputs else loss
    if window_step and model.training and batch_rewritten(trainer, state, step, inputs):
        _begin_stock_window(trainer, state)  # the rest of this window as stock; every rank leaves at the next window
        return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
    # The count this loss is normalized by: the window's (all micro-batches, all ranks), an explicit step's
    # caller's, or a direct call's own argument; None: the micro-batch mean (eval, or no count anywhere).
    count = None
    if model.training:
        if window_step:
            count = window.global_count
        elif step is not None:
            count = step.count
        else:
            count = num_items_in_batch
    if not state.probed or (window_step and count is None):  # no labels to count: as stock
        result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        if model.training and window_step and _we_divide_by_ga(trainer, num_items_in_batch):
            loss, outputs = _split(result)
            loss = loss / window.micro_batches
            return (loss, outputs) if return_outputs else loss
        return result
    if count is not None:
        loss, outputs = train_loss(trainer, chain, state, model, inputs, count, return_outputs, kwargs)
        if step is not None and torch.is_tensor(loss):
            _record_returned(step, loss)
    else:
        loss, outputs = eval_loss(trainer, chain, state, model, inputs, return_outputs, kwargs)
    return (loss, outputs) if return_outputs else loss


def batch_rewritten(trainer, state, step, inputs) -> bool:
    """Whether compute_loss was given other targets than the micro-batch the loop drew (TRL's GKD / GOLD train on
    on-policy generations in its place, a training_step may relabel): the window's count is then not the count
    of what it trains on. Measured per step by the loss's own count rule."""
    if not state.probed or state.chain is None or _sequence_sharded(trainer):
        return False
    if not isinstance(step.drawn, Mapping) or not isinstance(inputs, Mapping):
        return False
    if _same_targets(step, inputs):  # the drawn targets themselves, unedited: no count (no host sync) needed
        return False
    rule = state.chain.count_rule
    drawn = step.drawn_targets
    counted = int(count_targets(drawn, rule)) if _has_labels(drawn) else 0
    seen = int(count_targets(inputs, rule)) if _has_labels(inputs) else 0
    if counted == seen:
        return False
    if state.rewritten is None:
        state.rewritten = (
            f"hf_gradfix: {type(trainer).__name__} trains on other targets than the micro-batches the data loader "
            f"drew (measured: {counted} counted in the drawn micro-batch, {seen} in what compute_loss was given; "
            "e.g. on-policy generation), so a count of the drawn window does not normalize its loss: it trains "
            "exactly as stock computes it."
        )
        logger.warning("%s", state.rewritten)
    return True


def train_loss(trainer, chain, state, model, inputs, count, return_outputs, kwargs):
    """``S_mb * W / N`` for the target count ``count`` (N: the window's targets over every data rank;
    ``chain``: the compute_loss below the top layer)."""
    global_count = float(count.sum()) if torch.is_tensor(count) else float(count)
    n = count if torch.is_tensor(count) else count_tensor(trainer, global_count)
    state.last_aux = 0.0
    # before: user code may pop "labels"; read back only where the loss does not honour the count
    local_count = count_targets(inputs, state.chain.count_rule)
    own_aux = bool(state.aux_coef) and not state.chain_is_default and model.training
    if own_aux:  # the trainer's compute_loss adds the router loss itself (TRL): the convention is corrected after
        from ..moe import before_chain

        before_chain(trainer, state)
    counting = contextlib.nullcontext()
    if state.config.loss.aux_loss == "bias" and model.training:  # aux-free balancing: count this forward's routing
        from ..moe import bias_counting

        window = state.window
        in_window = window.micro_batches if window is not None and window.micro_batches else None
        counting = bias_counting(trainer, state, in_window or max(1, getattr(trainer, "current_gradient_accumulation_steps", 1)))
    # outputs only when the caller asked: TRL deprecates return_outputs=True (an extra forward there)
    with counting:
        result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=n, **kwargs)
    loss, outputs = _split(result)
    if own_aux and loss is not None and global_count != 0:
        from ..moe import chain_correction

        correction = chain_correction(trainer, state, max(1, getattr(trainer, "current_gradient_accumulation_steps", 1)))
        if correction is not None:
            loss = loss + correction.to(loss.device)
    if global_count == 0:
        return _zero_connected(loss, outputs, model), outputs
    if state.chain.honors_num_items:
        return loss, outputs  # contract: S_mb * W / N (+ the aux share)
    local = int(local_count)
    if local == 0:
        return _zero_connected(loss, outputs, model), outputs
    return loss * (local * _dp_world(trainer) / global_count), outputs
