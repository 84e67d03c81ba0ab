"""The eval and prediction concern of the top layer: ``eval_loss`` as the exact target mean over the eval set and
every rank (sums and counts all-reduced once, at the end of ``evaluation_loop``), accelerate's padded last batch
read as ``gather_for_metrics`` reads it, a loss computed outside ``compute_loss`` (``predict_with_generate``)
counted by the model's own rule, and pipeline-parallel prediction through the schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from transformers import Trainer

from ...loss.counting import CountRule, count_targets
from ..state import _EvalTotals, _nd_dims, state_of
from .layers import below_top
from .probe import _prepare
from .reading import _has_labels, _split
from .windows import _all_reduce_sum

logger = logging.getLogger("hf_gradfix")


def evaluation_loop(trainer, parent, /, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
    state = state_of(trainer)
    if state is None:
        return parent(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
    stock_window, state.stock_window = state.stock_window, False  # a stock training window does not make eval stock
    try:
        return token_mean_evaluation_loop(trainer, parent, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
    finally:
        state.stock_window = stock_window


def token_mean_evaluation_loop(trainer, parent, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
    state = state_of(trainer)
    if not state.enabled or not state.config.loss.eval_token_mean:
        return parent(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
    state.eval_totals = _EvalTotals()
    try:
        output = parent(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
    finally:
        totals, state.eval_totals = state.eval_totals, None
    loss_sum, targets, aux_sum, aux_batches, uncounted = _all_reduce_sum(
        trainer, [totals.loss_sum, totals.targets, totals.aux_sum, totals.aux_batches, totals.uncounted]
    )
    key = f"{metric_key_prefix}_loss"
    if targets > 0 and uncounted == 0 and output.metrics is not None and key in output.metrics:
        value = loss_sum / targets + (aux_sum / aux_batches if aux_batches else 0.0)
        output.metrics[key] = value
        dims = _nd_dims(trainer)  # tp and pp ranks evaluated the same rows: count them once (cp: different shards)
        once = targets / (dims.tp * dims.pp) if dims is not None else targets
        output.metrics[f"{metric_key_prefix}_loss_targets"] = once
    return output


def prediction_step(trainer, parent, /, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
    state = state_of(trainer)
    if state is not None and state.lean is not None:  # the lean head gives no logits: not where they are read
        state.lean.logits_needed = not prediction_loss_only
    if state is not None and state.pp is not None:
        return pipeline_prediction(trainer, state, inputs, prediction_loss_only)
    totals = state.eval_totals if state is not None else None
    if totals is None or not _has_labels(inputs):
        return parent(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
    counted_before = totals.batches
    untouched = dict(inputs)  # the step may edit the mapping (generation inputs)
    result = parent(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
    loss = result[0] if isinstance(result, tuple) and result else None
    if totals.batches == counted_before and torch.is_tensor(loss):
        # the loss was computed without compute_loss (Seq2SeqTrainer with predict_with_generate: a plain
        # `model(**inputs).loss`): count it here, with the model's own count rule (any other such loss stays
        # stock's, with a warning)
        count_eval_loss(trainer, state, model, untouched, loss, kwargs)
    return result


def pipeline_prediction(trainer, state, inputs, prediction_loss_only):
    """Pipeline parallelism: the eval batch forward-only through the schedule; the loss (a token mean) only."""
    from ..parallel.pipeline import PipelineError, eval_batch

    if not prediction_loss_only:
        raise PipelineError(
            f"hf_gradfix parallel.pp={state.pp.dims.pp}: logits exist on the last stage only, so compute_metrics "
            "and prediction outputs are not available through the pipeline; use prediction_loss_only=True (or no "
            "compute_metrics), or pp: 1"
        )
    inputs = trainer._prepare_inputs(inputs)
    loss_sum, targets = eval_batch(trainer, state.pp, inputs, real_eval_rows(trainer, inputs))
    totals = state.eval_totals
    if totals is not None:
        totals.batches += 1
        totals.loss_sum += loss_sum
        totals.targets += targets
    mean = loss_sum / targets if targets else 0.0
    return torch.tensor(mean, device=trainer.args.device), None, None


def eval_loss(trainer, chain, state, model, inputs, return_outputs, kwargs):
    """An eval micro-batch's mean loss, its sum and targets added to the exact eval totals (``chain``: the
    compute_loss below the top layer)."""
    state.last_aux = 0.0
    untouched = dict(inputs)  # user code may pop "labels" from the mapping it is given
    local = int(count_targets(untouched, state.chain.count_rule))
    result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=None, **kwargs)
    loss, outputs = _split(result)
    totals = state.eval_totals
    if totals is not None and loss is not None and not model.training:
        totals.batches += 1
        aux = float(state.last_aux) if torch.is_tensor(state.last_aux) else state.last_aux  # kept unread in training
        mean = float(loss.detach().double().mean())
        real_rows = real_eval_rows(trainer, untouched)
        if real_rows is not None:  # accelerate padded this last batch with repeated samples: drop them
            mean, local = eval_subset(trainer, state, model, untouched, real_rows, kwargs)
        elif eval_lockstep(trainer, untouched):
            # a sharded model's forward is a collective (FSDP all-gather, TP): run the extra forward that the
            # padded ranks run, and discard it, or they would wait for this rank forever
            eval_subset(trainer, state, model, untouched, int(untouched["labels"].shape[0]), kwargs)
            state.last_aux = aux
        if local > 0:
            totals.loss_sum += (mean - aux) * local
            totals.targets += local
        totals.aux_sum += aux
        totals.aux_batches += 1
    return loss, outputs


def count_eval_loss(trainer, state, model, inputs, loss, kwargs) -> None:
    """Add one eval batch's mean loss, computed outside compute_loss, to the exact eval totals."""
    totals = state.eval_totals
    why = None
    if not getattr(trainer.args, "predict_with_generate", False):
        # a prediction_step of the user's own: what its loss is (a mean by which count?) is unknown
        why = "a prediction_step that computes the loss itself"
    elif trainer.compute_loss_func is not None:
        why = "the trainer has a compute_loss_func, which this path bypasses"
    elif not state.probed and state.enabled:
        _prepare(trainer, state, [inputs])
    behaviour = state.model
    if why is not None:
        pass
    elif not state.enabled or not state.probed or behaviour is None:
        why = "the model's loss could not be probed" if state.enabled else "the loss fix is off for this trainer"
    elif state.aux_coef:
        why = "the model adds a MoE aux loss, which this path does not separate"
    if why is not None:
        if not state.eval_outside_logged:
            logger.warning(
                "hf_gradfix: %s computes its eval loss without compute_loss (%s: %s), so eval_loss stays "
                "transformers' mean of per-batch means, not the exact target mean. Set "
                "prediction_loss_only=True (or predict_with_generate=False) for an exact eval_loss.",
                type(trainer).__name__, _outside_path_name(trainer), why,
            )
            state.eval_outside_logged = True
        totals.batches += 1
        totals.uncounted += 1
        return
    # label smoothing there: transformers' LabelSmoother with shift_labels=False counts every label != -100
    rule = CountRule.UNSHIFTED if trainer.label_smoother is not None else behaviour.count_rule
    mean = float(loss.detach().double().mean())
    local = int(count_targets(inputs, rule))
    real_rows = real_eval_rows(trainer, inputs)
    if real_rows is not None:  # accelerate padded this last batch with repeated samples: drop them
        mean, local = eval_subset(trainer, state, model, inputs, real_rows, kwargs)
    elif eval_lockstep(trainer, inputs):
        eval_subset(trainer, state, model, inputs, int(inputs["labels"].shape[0]), kwargs)
    if local > 0:
        totals.loss_sum += mean * local
        totals.targets += local
    totals.batches += 1


def real_eval_rows(trainer, inputs) -> int | None:
    """Rows of this rank's last eval batch that are real samples, or None when all are.

    With ``even_batches`` accelerate completes the last global batch with samples from the start of
    the dataset; ``gather_for_metrics`` keeps the first ``remainder`` rows in rank order. We apply the
    same rule to this rank's rows (the sums and counts are all-reduced, not gathered).
    """
    gradient_state = trainer.accelerator.gradient_state
    if trainer.accelerator.num_processes <= 1 or not gradient_state.end_of_dataloader:
        return None
    remainder = gradient_state.remainder
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if remainder is None or remainder <= 0 or not torch.is_tensor(labels):
        return None
    rows = int(labels.shape[0])
    real = real_rows_by_data_rank(trainer, remainder, rows)[data_index(trainer)]
    return None if real == rows else real


def data_index(trainer) -> int:
    """This rank's index among the ranks accelerate shards data over (with a mesh: its data-parallel rank)."""
    dims = _nd_dims(trainer)
    return dims.data_rank(trainer.accelerator.process_index) if dims is not None else trainer.accelerator.process_index


def real_rows_by_data_rank(trainer, remainder: int, rows: int) -> list[int]:
    dims = _nd_dims(trainer)
    ranks = dims.dp if dims is not None else trainer.accelerator.num_processes
    return [min(max(remainder - d * rows, 0), rows) for d in range(ranks)]


def sharded_model(trainer) -> bool:
    """Whether the model's forward is a collective (FSDP / TP), so every rank must run the same forwards."""
    state = state_of(trainer)
    if state is not None and state.nd is not None and state.nd.route != "ddp":
        return True
    sharded = getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_distributed_loading_by_transformers", False)
    return bool(sharded)


def eval_lockstep(trainer, inputs) -> bool:
    """A sharded model, in accelerate's padded last eval batch, on a rank that needs no subset forward while
    another rank does."""
    gradient_state = trainer.accelerator.gradient_state
    if trainer.accelerator.num_processes <= 1 or not gradient_state.end_of_dataloader or not sharded_model(trainer):
        return False
    remainder = gradient_state.remainder
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if remainder is None or remainder <= 0 or not torch.is_tensor(labels):
        return False
    rows = int(labels.shape[0])
    return any(real != rows for real in real_rows_by_data_rank(trainer, remainder, rows))


def eval_subset(trainer, state, model, inputs, real_rows, kwargs):
    """(mean loss, target count) over the first ``real_rows`` rows of an eval batch."""
    if real_rows == 0:
        if sharded_model(trainer):  # the other ranks run a forward: join it on one row, discard it
            eval_subset(trainer, state, model, inputs, 1, kwargs)
        return 0.0, 0
    rows = int(inputs["labels"].shape[0])
    subset = {k: (v[:real_rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == rows else v) for k, v in inputs.items()}
    local = int(count_targets(subset, state.chain.count_rule))
    state.last_aux = 0.0
    loss = below_top(trainer, "compute_loss")(model, subset, return_outputs=False, num_items_in_batch=None, **kwargs)
    loss, _ = _split(loss)
    return float(loss.detach().double().mean()), local


def _outside_path_name(trainer: Trainer) -> str:
    if getattr(trainer.args, "predict_with_generate", False):
        return "predict_with_generate=True"
    return f"{type(trainer).__name__}.prediction_step"
