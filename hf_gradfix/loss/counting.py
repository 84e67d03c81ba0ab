"""Counting the targets a loss averages over, and turning micro-batch losses into window losses.

Pure math: imports torch only (no transformers, no accelerate), unit-tested on its own.

The invariant the plugin keeps (see ``shared/research/loss-normalization.md`` section 3):

    gradient = (sum of per-target losses over the whole optimizer window, all data ranks) / N_global

where ``N_global`` is counted with exactly the rule the loss itself uses. Data-parallel
backends (DDP, FSDP, DeepSpeed) *average* gradients over ``W`` replicas, so the loss each
replica back-propagates for one micro-batch is ``S_mb * W / N_global``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch

IGNORE_INDEX = -100


class CountRule(str, enum.Enum):
    """Which label positions a loss averages over.

    - ``shifted``: causal LMs; position ``t`` predicts ``labels[t+1]``, so ``labels[..., 0]``
      is never a target: count ``labels[..., 1:] != -100``.
    - ``unshifted``: token classification, masked LMs, encoder-decoders, PEFT prompt learning
      (virtual tokens make ``labels[..., 0]`` a target): count ``labels != -100``.
    - ``elements``: sequence-level labels (classification, regression, multi-label): every
      label element that is not ``-100``.
    """

    SHIFTED = "shifted"
    UNSHIFTED = "unshifted"
    ELEMENTS = "elements"


def is_token_level(labels: torch.Tensor) -> bool:
    """True for integer labels with a sequence dimension (``(batch, seq)`` or more).

    >>> is_token_level(torch.zeros(2, 5, dtype=torch.long)), is_token_level(torch.zeros(2, dtype=torch.long))
    (True, False)
    """
    return labels.dim() >= 2 and not torch.is_floating_point(labels)


def count_targets(batch: Mapping[str, Any], rule: CountRule | str, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of loss targets in one micro-batch, as an int64 tensor on the labels' device.

    A collator-provided ``shift_labels`` (padding-free collators) is counted as it is, whatever the rule.
    A batch without ``labels`` counts 0.

    >>> b = {"labels": torch.tensor([[-100, 5, 6, -100], [7, 8, -100, -100]])}
    >>> int(count_targets(b, "shifted")), int(count_targets(b, "unshifted"))
    (3, 4)
    """
    rule = CountRule(rule)
    if "shift_labels" in batch and torch.is_tensor(batch["shift_labels"]):
        return batch["shift_labels"].ne(ignore_index).sum()
    labels = batch.get("labels")
    if labels is None or not torch.is_tensor(labels):
        return torch.zeros((), dtype=torch.long)
    if rule is CountRule.SHIFTED and labels.dim() >= 1:
        labels = labels[..., 1:]
    return labels.ne(ignore_index).sum()


def window_loss_from_mean(mean_loss: torch.Tensor, local_count: int, global_count: float, dp_world: int) -> torch.Tensor:
    """Turn a micro-batch *mean* (over ``local_count`` targets) into the loss one replica back-propagates.

    ``mean * local_count`` recovers the micro-batch's sum; ``* dp_world / global_count`` makes the
    data-parallel gradient average equal the global token mean.

    >>> float(window_loss_from_mean(torch.tensor(2.0), local_count=3, global_count=12, dp_world=2))
    1.0
    """
    return mean_loss * (local_count * dp_world / global_count)


def window_loss_from_sum(sum_loss: torch.Tensor, global_count: float, dp_world: int) -> torch.Tensor:
    """The replica loss for a micro-batch whose summed loss is known.

    >>> float(window_loss_from_sum(torch.tensor(6.0), global_count=12, dp_world=2))
    1.0
    """
    return sum_loss * (dp_world / global_count)


def mean_term_share(term: torch.Tensor, micro_batches_in_window: int) -> torch.Tensor:
    """Share of a mean-type term (e.g. a MoE router aux loss) for one micro-batch.

    The convention: the window's aux term is the mean over micro-batches and ranks. The data-parallel
    average already divides by the ranks, so each micro-batch contributes ``term / micro_batches``.

    >>> float(mean_term_share(torch.tensor(1.0), 4))
    0.25
    """
    return term / micro_batches_in_window
