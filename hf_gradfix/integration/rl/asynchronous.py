"""TRL's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``), exact over the optimizer window.

AsyncGRPO trains on rollouts a vLLM server streams; its collator packs each micro-batch padding-free into one row per
data rank (a prefix trie: samples of a group share their prompt) and lists the row's loss terms in ``token_index``
(the packed position that predicts each trained token), ``old_log_probs``, ``advantages`` and ``segment_id``, with
``global_n_tokens``: the micro-batch's trained tokens summed over every rank. TRL 1.16's ``compute_loss``
(``async_grpo_trainer.py`` L1532-1544) takes the clipped surrogate per token and divides its local sum by
``global_n_tokens / world_size`` then by the accumulation steps: each micro-batch is a token mean over *its own*
tokens, and the window's loss is the **mean of its micro-batch means** (trl#7206), not the token mean over the
window. With completions of very different lengths the gradient is off by tens of percent.

hf_gradfix keeps TRL's loss as TRL computes it and changes only the division (:data:`ASYNC_GRPO`, the token mean of
the objective contract in :mod:`hf_gradfix.loss.objective`): at the window's first ``compute_loss`` every rank counts
the loss terms of each micro-batch of its window (``token_index >= 0``, what TRL trains on) and the counts are summed
over the ranks; each micro-batch's loss is then TRL's times ``(global_n_tokens / world_size) x GA`` (undoing TRL's
divisor: the local token sum) times ``data_ranks / window_tokens``. The per-micro-batch sums are checked against
TRL's own ``global_n_tokens`` (the normalizer is read from the very field it divides by): a window where they
disagree trains exactly as TRL computes it, with one warning.

Left to TRL, with one warning: a subclass whose ``compute_loss`` is its own, a TRL release other than 1.16 (the divisor
was read from 1.16's code), and a MoE policy with the router aux loss (``router_aux_loss_coef`` != 0; TRL adds it to
the same scalar, per micro-batch over GA).

>>> from hf_gradfix.integration.rl.asynchronous import ASYNC_GRPO
>>> ASYNC_GRPO.objective.name
'token_mean'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...loss.objective import TOKEN_MEAN, PolicyLoss
from .plan import RLPlan

logger = logging.getLogger("hf_gradfix")

#: AsyncGRPO's declared objective: the clipped surrogate's token mean over every trained token of the window (TRL's own
#: comment: "To get correct per-token normalization"; what verl and OpenRLHF compute over data ranks x GA).
ASYNC_GRPO = PolicyLoss(TOKEN_MEAN, None, "AsyncGRPO: clipped surrogate, token mean over the window")

#: The module whose ``compute_loss`` normalizer this module undoes (TRL 1.16).
_ASYNC_LOSS_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"

#: What AsyncGRPO's collator gives ``compute_loss``: a packed row per rank and its list of loss terms.
_ASYNC_KEYS = ("token_index", "old_log_probs", "advantages", "global_n_tokens")


def is_async_layout(inputs: Any) -> bool:
    """Whether ``inputs`` is a packed AsyncGRPO micro-batch (a row of the collator, its loss terms listed)."""
    return isinstance(inputs, Mapping) and all(torch.is_tensor(inputs.get(k)) for k in _ASYNC_KEYS)


def detect(trainer: Any, inputs: Mapping, scaled_for_ga: Any, supported, version: str | None):
    """An :class:`~hf_gradfix.integration.rl.plan.RLPlan` for an AsyncGRPO trainer whose normalizer hf_gradfix knows, else a
    reason (str) it trains as TRL computes it."""
    name = type(trainer).__name__
    owner = next((k for k in type(trainer).__mro__ if "compute_loss" in k.__dict__
                  and not k.__module__.startswith("hf_gradfix.")), None)
    if owner is None or owner.__module__ != _ASYNC_LOSS_MODULE:
        where = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else "nowhere"
        return (f"hf_gradfix: {name} trains on AsyncGRPO's packed rollouts but its compute_loss is its own ({where}); "
                "hf_gradfix knows the normalizer of TRL's AsyncGRPOTrainer code only, so it trains exactly as it "
                "computes its loss.")
    if version is None or version not in supported:
        return (f"hf_gradfix: {name} is TRL's AsyncGRPO, but hf_gradfix knows its loss normalizer for TRL {supported} "
                f"only (installed: {version}); it trains exactly as TRL computes it.")
    if scaled_for_ga is not True:
        return (f"hf_gradfix: {name} (AsyncGRPO) with loss_is_scaled_for_ga={scaled_for_ga!r}: not the accumulation "
                "scaling hf_gradfix read from TRL's code; it trains exactly as TRL computes it.")
    if getattr(trainer, "aux_loss_enabled", False):
        coef = getattr(trainer, "router_aux_loss_coef", None)
        return (f"hf_gradfix: {name} (AsyncGRPO) trains a MoE policy with the router aux loss "
                f"(router_aux_loss_coef={coef}), which TRL adds into the same scalar; hf_gradfix does not separate "
                "it there, so it trains exactly as TRL computes it. "
                "Set router_aux_loss_coef=0.0 for an exact token mean of the policy loss.")
    line = (f"{name}: the token mean over the optimizer window's trained tokens on every rank (TRL divides each "
            "micro-batch by its own tokens over the ranks x GA: a mean of micro-batch means)")
    return RLPlan(trainer_kind="async_grpo", loss_type="async_grpo", policy=ASYNC_GRPO, line=line)


def _trained_terms(batch: Any) -> float:
    """The loss terms this rank's row of a micro-batch trains on (TRL pads ``token_index`` with -1 between ranks)."""
    if not is_async_layout(batch):  # an idle filler (the data ended inside the window): nothing trained
        return 0.0
    return float((batch["token_index"] >= 0).sum())


def open_window(trainer: Any, plan: Any, all_reduce) -> None:
    """Count the window's trained tokens per micro-batch over every rank (every rank joins, once per window, at the
    window's first compute_loss) and check each against TRL's ``global_n_tokens``."""
    from ..state import state_of

    window = state_of(trainer).window
    batches = list(window.batches) if window is not None else []
    per_micro_batch = all_reduce([_trained_terms(b) for b in batches]) if batches else []
    trl_counts = [float(b["global_n_tokens"].reshape(-1)[0]) for b in batches if is_async_layout(b)]
    ours = [n for b, n in zip(batches, per_micro_batch) if is_async_layout(b)]
    plan.window_tokens = float(sum(per_micro_batch))
    plan.window_sequences = 0.0
    plan.counted = bool(batches) and trl_counts == ours
    if batches and not plan.counted and not plan.warned:
        plan.warned = True
        logger.warning(
            "hf_gradfix: %s (AsyncGRPO): the loss terms counted per micro-batch over the ranks (%s) are not TRL's "
            "global_n_tokens (%s), the divisor hf_gradfix undoes; this window trains exactly as TRL computes it.",
            type(trainer).__name__, ours, trl_counts)


def window_loss(trainer: Any, plan: Any, inputs: Mapping, compute) -> torch.Tensor:
    """This micro-batch's loss as the window's token mean (``compute``: TRL's own compute_loss for these inputs)."""
    loss = compute()
    # TRL 1.16: loss = local_sum / clamp(global_n_tokens / world_size, min=1) / GA  ->  local_sum
    world = float(trainer.accelerator.num_processes)
    tokens_per_rank = max(float(inputs["global_n_tokens"].reshape(-1)[0]) / world, 1.0)
    local_sum = loss * (tokens_per_rank * float(trainer.current_gradient_accumulation_steps))
    return TOKEN_MEAN.loss(local_sum, plan.window_tokens, plan.data_ranks)
