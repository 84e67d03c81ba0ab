"""Workload dispatch of the top layer: where a trainer's workload needs its own glue, the top layer's overrides hand
it on here: pipeline parallelism (the window as one schedule step, token counting, no world-wide weight sync),
packing (the packed dataloader) and TRL's policy-gradient trainers (recognized on the first ``compute_loss``).

Apart so that a new workload adds a branch here (and its glue module), not in the class.
"""

from __future__ import annotations

import logging

import torch

from ..state import _dp_world, _Window, state_of
from ..versions import transformers_major
from .ga_flag import _own_loss_is_scaled_for_ga
from .reading import _model_name
from .windows import _disable, _draw_window

logger = logging.getLogger("hf_gradfix")


def get_train_dataloader(trainer, parent, /):
    """Packing: the packed dataloader in place of the next class's (``parent``)."""
    state = state_of(trainer)
    if state is None or not state.config.packing.enabled:
        return parent()
    from ..packing.trainer import packed_train_dataloader, prepare_model_for_packing

    state.packing_line = prepare_model_for_packing(trainer, state.config.packing)
    return packed_train_dataloader(trainer, state.config.packing)


def pipeline_window(trainer, state, epoch_iterator, num_batches, device):
    """Pipeline parallelism: the window's micro-batches and their target count over the data-parallel ranks."""
    from ..parallel.nd import check_window
    from ..parallel.pipeline import count_window

    batches = _draw_window(epoch_iterator, num_batches)
    check_window(trainer, state.nd, batches)
    plan = state.pp
    plan.pending = []
    plan.window_size = len(batches)
    plan.tokens_counted = trainer.state.num_input_tokens_seen  # 4.57 adds each micro-batch's tokens inline
    plan.window_count = count_window(trainer, plan, batches) if batches else 0.0
    state.window = _Window(plan.window_count, len(batches)) if batches else None
    count = plan.window_count
    return batches, torch.tensor(int(count) if float(count).is_integer() else count, device=device)


def pipeline_step(trainer, state, inputs):
    """Pipeline parallelism: one micro-batch of the window; the schedule runs on its last one."""
    # the whole window runs as one schedule step, on its last micro-batch
    from ..parallel.pipeline import run_window

    plan = state.pp
    if transformers_major() < 5:  # 4.57 added this micro-batch's tokens inline, just before this call
        from ..parallel.pipeline import count_each_batch_once

        count_each_batch_once(trainer, plan, plan.tokens_counted)
    plan.pending.append(trainer._prepare_inputs(inputs))
    if len(plan.pending) < plan.window_size:
        return torch.zeros((), device=trainer.args.device)
    batches, plan.pending = plan.pending, []
    return run_window(trainer, plan, batches)


def track_num_input_tokens(trainer, parent, /, inputs):
    """Pipeline parallelism: each micro-batch's tokens counted once (``parent``: the next class's)."""
    before = trainer.state.num_input_tokens_seen
    parent(inputs)
    state = state_of(trainer)
    if state is not None and state.pp is not None:
        from ..parallel.pipeline import count_each_batch_once

        count_each_batch_once(trainer, state.pp, before)


def sync_replicated_trainable_parameters(trainer, parent, /, model):
    # a pipelined model holds different weights on each stage: transformers' world-wide broadcast does not apply
    state = state_of(trainer)
    if state is not None and state.pp is not None:
        return None
    return parent(model)


def detect_rl(trainer, state, inputs) -> bool:
    """Whether this is a TRL policy-gradient trainer (GRPO, RLOO and their subclasses, decided by what compute_loss
    is given): then it is made exact by :mod:`hf_gradfix.integration.rl`, or left to TRL with one warning."""
    from ..rl.policy_gradient import check_aux_convention, detect

    found = detect(trainer, inputs, _own_loss_is_scaled_for_ga(trainer))
    if found is None:
        return False
    if isinstance(found, str):
        _disable(trainer, state, found)
        return True
    check_aux_convention(trainer, state.config.loss.aux_loss)
    found.data_ranks = _dp_world(trainer)
    state.rl = found
    state.fixes.append(found.line)
    if state.config.log_fixes:
        logger.info("hf_gradfix (%s; settings from: %s) on %s with %s: %s.", state.source, state.settings_from,
                    type(trainer).__name__, _model_name(trainer.model), found.line)
    return True
