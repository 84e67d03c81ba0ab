"""Detect, on a real batch, how a loss is normalized: does it honour ``num_items_in_batch``, and
which label positions does it count?

transformers cannot tell us this reliably: ``accepts_loss_kwargs`` is wrong for several VLMs, many
heads accept ``**kwargs`` but drop the count, and the Trainer's shift rule is keyed on ``loss_type``.
So we ask the loss itself, with a few forwards under ``torch.no_grad`` on the first batch. The probes depend on the model and loss code only, not on the data's masking, so every
data-parallel rank reaches the same verdict.

Pure torch: the loss is a callable ``loss_fn(batch, num_items) -> Tensor`` supplied by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .counting import IGNORE_INDEX, CountRule, is_token_level
from ..errors import HfGradfixError

LossFn = Callable[[Mapping[str, Any], "torch.Tensor | None"], torch.Tensor]

# Two num_items values whose losses must differ by exactly 2x (minus an additive term) if honoured.
_N1, _N2 = 7.0, 14.0
_REL_TOL = 1e-5


class ProbeError(HfGradfixError, RuntimeError):
    """Raised when a probe cannot decide how a loss is normalized."""


class NonFiniteProbeError(ProbeError):
    """The loss was NaN or infinite on the probe batch: nothing can be read from it (the data or the weights, not the
    loss code, decide that), so the caller should probe again on a later batch rather than give up."""


@dataclass(frozen=True)
class LossBehaviour:
    """What the probes found about one loss producer."""

    honors_num_items: bool
    count_rule: CountRule
    additive_term: float  # part of the loss that does not scale with num_items (e.g. coef * MoE aux loss)
    reason: str


def _a_valid_label(labels: torch.Tensor) -> int | float:
    valid = labels[labels.ne(IGNORE_INDEX)]
    if valid.numel():
        return valid.flatten()[0].item()
    return 0


# The probes run on the whole first micro-batch, not on one row: a VLM batch holds tensors that are not
# per-row (e.g. the pixel values of all images), so slicing rows would break the model's own checks.


def with_all_targets(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with every label position made a target (so the loss cannot be empty)."""
    row = dict(batch)
    labels = row.get("labels")
    if torch.is_tensor(labels):
        row["labels"] = torch.where(labels.eq(IGNORE_INDEX), torch.full_like(labels, _a_valid_label(labels)), labels)
    return row


def with_only_first_position(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with ``labels[..., 0]`` as the only labelled position of every row."""
    row = dict(batch)
    labels = row["labels"]
    only = torch.full_like(labels, IGNORE_INDEX)
    only[..., 0] = _a_valid_label(labels)
    row["labels"] = only
    return row


def _as_num_items(value: float | None, like: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    device = like.device if like is not None else None
    return torch.tensor(value, device=device)


def _scalar(loss: torch.Tensor) -> float:
    return float(loss.detach().double().mean().item())


@torch.no_grad()
def probe_honors_num_items(loss_fn: LossFn, batch: Mapping[str, Any]) -> tuple[bool, float]:
    """Does ``loss_fn`` scale as ``S / num_items``? Returns ``(honors, additive_term)``.

    ``loss(n) = S / n + A`` when honoured (``A``: an aux term that does not scale), constant otherwise.

    >>> def summed(b, n): return b["labels"].float().sum() / (1.0 if n is None else n) + 0.5
    >>> probe_honors_num_items(summed, {"labels": torch.tensor([[1, 2, 3]])})
    (True, 0.5)
    >>> probe_honors_num_items(lambda b, n: -summed(b, n), {"labels": torch.tensor([[1, 2, 3]])})   # a negative sum
    (True, -0.5)
    """
    full = with_all_targets(batch)
    like = full.get("labels")
    loss1 = _scalar(loss_fn(full, _as_num_items(_N1, like)))
    loss2 = _scalar(loss_fn(full, _as_num_items(_N2, like)))
    if not (math.isfinite(loss1) and math.isfinite(loss2)):
        raise NonFiniteProbeError(f"the loss is not finite on the probe batch (loss({_N1})={loss1}, loss({_N2})={loss2})")
    if abs(loss1 - loss2) <= _REL_TOL * max(abs(loss1), abs(loss2), 1e-12):
        return False, 0.0
    # loss(n) = S/n + A: loss(7) - loss(14) = S/14 must be exactly twice loss(14) - loss(28) = S/28.
    loss4 = _scalar(loss_fn(full, _as_num_items(2 * _N2, like)))
    if not math.isfinite(loss4):
        raise NonFiniteProbeError(f"the loss is not finite on the probe batch (loss({2 * _N2:g})={loss4})")
    first, second = loss1 - loss2, loss2 - loss4
    additive = 2.0 * loss2 - loss1
    # S may be negative (a policy-gradient or distillation objective): only the 1/n shape is checked
    if first == 0 or abs(first - 2.0 * second) > 1e-4 * abs(first):
        raise ProbeError(
            f"the loss changes with num_items_in_batch but not as sum/num_items (+ a constant): "
            f"loss({_N1:g})={loss1:.6g}, loss({_N2:g})={loss2:.6g}, loss({2 * _N2:g})={loss4:.6g}"
        )
    return True, round(additive, 12)


@torch.no_grad()
def probe_counts_first_position(loss_fn: LossFn, batch: Mapping[str, Any], honors: bool) -> bool:
    """Is ``labels[..., 0]`` a loss target? False for causal-LM shifting, True otherwise.

    With only position 0 labelled, a shifting loss has no target: its sum is 0 and its mean NaN.

    >>> def unshifted_mean(b, n): l = b["labels"]; return (l != -100).float().sum() / (l != -100).sum()
    >>> probe_counts_first_position(unshifted_mean, {"labels": torch.tensor([[4, 5, 6]])}, honors=False)
    True
    """
    row = with_only_first_position(batch)
    like = row["labels"]
    if honors:
        # loss(n) = S0/n + A: recover S0 from two counts, independent of any additive term.
        s0 = 2.0 * (_scalar(loss_fn(row, _as_num_items(1.0, like))) - _scalar(loss_fn(row, _as_num_items(2.0, like))))
        return math.isfinite(s0) and abs(s0) > 1e-9
    value = _scalar(loss_fn(row, None))
    return math.isfinite(value) and abs(value) > 1e-12


def detect_count_rule(loss_fn: LossFn, batch: Mapping[str, Any], honors: bool) -> tuple[CountRule, str]:
    """The rule that counts the targets of ``loss_fn``, with a reason for the log."""
    if "shift_labels" in batch:
        return CountRule.UNSHIFTED, "the collator provides shift_labels, counted as they are"
    labels = batch.get("labels")
    if not torch.is_tensor(labels):
        raise ProbeError("the batch has no 'labels' tensor to count targets in")
    if not is_token_level(labels):
        return CountRule.ELEMENTS, "sequence-level labels: one target per label"
    if labels.shape[-1] < 2:
        raise ProbeError("labels of length 1 cannot tell a shifted from an unshifted loss")
    if probe_counts_first_position(loss_fn, batch, honors):
        return CountRule.UNSHIFTED, "labels[..., 0] is a target"
    return CountRule.SHIFTED, "causal shift: labels[..., 0] is never a target"


def probe_loss(loss_fn: LossFn, batch: Mapping[str, Any], rule: CountRule | None = None) -> LossBehaviour:
    """Run both probes. ``rule`` forces the count rule (configuration ``loss.count_rule``)."""
    honors, additive = probe_honors_num_items(loss_fn, batch)
    if rule is None:
        rule, why = detect_count_rule(loss_fn, batch, honors)
    else:
        why = "set in the configuration"
    reason = ("honours num_items_in_batch" if honors else "ignores num_items_in_batch") + f"; count rule {rule.value}: {why}"
    return LossBehaviour(honors_num_items=honors, count_rule=rule, additive_term=additive, reason=reason)
