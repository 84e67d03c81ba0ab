"""The causal-LM loss head without the logits: the final projection and the cross-entropy computed together, a chunk
of tokens at a time, so the ``(tokens, vocab)`` logits of a micro-batch (and their fp32 upcast) never exist at once.

Pure math (torch only). The integration (``hf_gradfix.integration.lean_head``) decides when a model's head may take
this path and normalizes the sum by the window's global target count like every other path.

>>> import torch
>>> hidden, weight = torch.randn(6, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
>>> targets = torch.tensor([1, 2, -100, 3, 4, 5])
>>> lean = head_cross_entropy_sum(hidden, weight, None, targets)
>>> stock = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
>>> bool(torch.allclose(lean, stock))
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
#: tokens per chunk of the fallback path (torch < 2.13 has no linear_cross_entropy): with a 151k vocabulary in
#: fp32, 1024 tokens' logits are 0.6 GB, against 19 GB for a 32k-token micro-batch
FALLBACK_CHUNK_TOKENS = 1024


def has_torch_linear_cross_entropy() -> bool:
    """torch >= 2.13 ships ``F.linear_cross_entropy`` with a chunked path (``LinearCrossEntropyOptions``)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def head_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum_t CE(hidden_t @ weight.T + bias, target_t)`` over the targets that are not ``ignore_index``.

    ``hidden``: (N, H); ``weight``: (V, H); ``targets``: (N,). ``compute_dtype``: the dtype the stock head's matmul
    runs in (default: autocast's where it is on, else the inputs' own), cast chunk by chunk so that an fp32 weight's gradient
    accumulates in fp32. In fp32 / fp64 on torch's ``linear_cross_entropy`` (chunked) where it exists. In fp16 / bf16,
    and on torch < 2.13, chunks of :data:`FALLBACK_CHUNK_TOKENS` tokens computed as the stock head computes them
    (the matmul in the compute dtype, the logits upcast to fp32, fp32 cross-entropy and sum), recomputed in the
    backward (activation checkpointing). Why not torch's op in half precision: its loss accumulates in the input
    dtype (torch 2.13: ``output_dtype`` is bf16 for bf16 inputs, whatever ``acc_dtype``), measured 1.1e-1 relative
    error of a 2,048-token sum against float64, where the stock head's fp32 upcast gives 4.9e-7. Either way one
    chunk's logits are alive at a time.
    """
    device_type = hidden.device.type
    if compute_dtype is None and torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)  # the stock head's matmul dtype under autocast
    with torch.autocast(device_type, enabled=False):  # the casts below are this function's own
        return _sum(hidden, weight, bias, targets, ignore_index, label_smoothing, compute_dtype)


def _sum(hidden, weight, bias, targets, ignore_index, label_smoothing, compute_dtype):
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    dtype = compute_dtype or hidden.dtype
    # torch 2.13's chunked op refuses label smoothing (it falls back to its reference path: the whole logits)
    full_precision = dtype in (torch.float32, torch.float64) and hidden.dtype == weight.dtype == dtype and (
        bias is None or bias.dtype == dtype) and label_smoothing == 0.0
    if full_precision and has_torch_linear_cross_entropy():
        # "accurate": the chunked path's widest use of its accumulation dtype (here the inputs' own, fp32 / fp64)
        options = torch.nn.LinearCrossEntropyOptions(acc_policy="accurate")
        return F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="sum",
                                      ignore_index=ignore_index, label_smoothing=label_smoothing, options=options)
    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], FALLBACK_CHUNK_TOKENS):
        end = start + FALLBACK_CHUNK_TOKENS
        total = total + checkpoint(_chunk_sum, hidden[start:end], weight, bias, targets[start:end], ignore_index,
                                   label_smoothing, dtype, use_reentrant=False)
    return total


def _chunk_sum(hidden, weight, bias, targets, ignore_index, label_smoothing, dtype):
    # the stock head, one chunk at a time: the matmul in the compute dtype, its logits upcast to fp32
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)


def next_token_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """transformers' causal-LM shift: position t is scored against ``labels[t + 1]``; the last position against
    ``ignore_index`` (what ``ForCausalLMLoss`` does when no ``shift_labels`` are given).

    >>> next_token_targets(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


#: the loss's targets: "next" (position t scored against ``labels[t + 1]``, the causal shift), "same" (against
#: ``labels[t]``: a masked LM, a seq2seq decoder fed shifted inputs), "shift_labels" (the call's own ``shift_labels``)
TARGETS = {"next": "next-token targets (the causal shift)", "same": "same-position targets (no shift)",
           "shift_labels": "the call's shift_labels"}
#: how the sum over the targets is divided: by ``num_items_in_batch``, by the number of targets (a mean), not at all
REDUCTIONS = {"num_items": "sum / num_items_in_batch", "mean": "mean over its targets", "sum": "sum"}
#: relative agreement that decides a candidate: the loss may upcast the float64 test logits to fp32 (transformers'
#: losses call ``logits.float()``: 1e-7), while two different candidates differ by far more on random logits
_MATCH_TOL = 1e-4
_SEPARATION = 1e-2


@dataclass(frozen=True)
class Objective:
    """What a loss function computes from ``(logits, labels)``: the cross-entropy of the logits against
    ``targets`` (a key of :data:`TARGETS`), summed and reduced by ``reduction`` (a key of :data:`REDUCTIONS`)."""

    targets: str
    reduction: str

    def describe(self) -> str:
        return f"cross-entropy against {TARGETS[self.targets]}, {REDUCTIONS[self.reduction]}"


def measure_objective(loss_fn: Callable[..., Any], args: tuple, kwargs: dict, labels: torch.Tensor, *,
                      ignore_index: int = IGNORE_INDEX, vocab: int = 13, seed: int = 0) -> Objective | str:
    """Which objective ``loss_fn`` computes when called as ``loss_fn(*args, **kwargs)`` (the call a model made:
    ``(logits, labels, vocab_size)`` positional or by keyword, then its keyword arguments), measured on random
    float64 logits of a small vocabulary: the :class:`Objective` it equals, or why none (a one-line reason naming
    what it returned). The call's own tensors are replaced by test ones of the shape of ``labels`` (the logits,
    the labels with ignored positions, ``shift_labels`` if it passed any, a ``num_items_in_batch`` unlike any count);
    its other arguments are passed as they are. The test logits favour each candidate's targets by a different
    margin, so the candidates' values lie far apart (a freshly initialized model's near-uniform logits, or random
    ones that favour nothing, give every choice of targets about the same mean: no way to decide by those).

    >>> def causal(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kw):
    ...     targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    ...     s = F.cross_entropy(logits.float().view(-1, vocab_size), targets.reshape(-1), reduction="sum")
    ...     return s / num_items_in_batch
    >>> labels = torch.zeros(2, 6, dtype=torch.long)
    >>> measure_objective(causal, (), {"logits": None, "labels": labels, "vocab_size": 50, "num_items_in_batch": 9},
    ...                   labels).describe()
    'cross-entropy against next-token targets (the causal shift), sum / num_items_in_batch'
    >>> def smoothed(logits, labels, vocab_size, **kw):
    ...     return F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1), label_smoothing=0.1)
    >>> measure_objective(smoothed, (None, labels), {"vocab_size": 50}, labels).split(":")[0]
    'it computes none of the cross-entropies of the head with next-token or same-position targets'
    """
    shape = tuple(labels.shape)
    if len(shape) == 0 or shape[-1] < 2 or math.prod(shape) < 8:
        shape = (2, 8)
    device = labels.device
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)

    def random_labels():
        values = torch.randint(0, vocab, shape, generator=g)
        values[torch.rand(shape, generator=g) < 0.3] = ignore_index
        return values

    test_labels = random_labels()
    candidates = {"next": next_token_targets(test_labels, ignore_index), "same": test_labels}
    if torch.is_tensor(kwargs.get("shift_labels")):
        candidates["shift_labels"] = random_labels()
    # random logits that lean towards each candidate's targets by a different margin, so that the candidates'
    # cross-entropies are far apart (on logits that favour none, every choice of targets has about the same mean)
    logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
    for boost, targets in zip((6.0, 3.0, 1.5), candidates.values()):
        logits += boost * F.one_hot(targets.clamp(min=0), vocab).to(logits.dtype) * (targets != ignore_index)[..., None]
    logits, test_labels = logits.to(device), test_labels.to(device)
    candidates = {kind: targets.to(device) for kind, targets in candidates.items()}
    args, kwargs = list(args), dict(kwargs)
    slots = ("logits", "labels", "vocab_size")
    values = {"logits": logits, "labels": test_labels, "vocab_size": vocab}
    for i, name in enumerate(slots[: len(args)]):
        args[i] = values[name]
    for name in slots[len(args):]:
        if name in kwargs:
            kwargs[name] = values[name]
    if "shift_labels" in candidates:
        kwargs["shift_labels"] = candidates["shift_labels"]
    n = kwargs.get("num_items_in_batch")
    if n is not None:  # larger than any count of the test labels: sum / n is no mean
        value = 2 * numel + 3
        kwargs["num_items_in_batch"] = torch.tensor(value, dtype=n.dtype, device=n.device) if torch.is_tensor(n) \
            else type(n)(value)
    expected = {}
    for kind, targets in candidates.items():
        total = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index,
                                reduction="sum")
        count = int((targets != ignore_index).sum())
        if n is not None:
            expected[Objective(kind, "num_items")] = float(total) / (2 * numel + 3)
        expected[Objective(kind, "mean")] = float(total) / count if count else math.nan
        expected[Objective(kind, "sum")] = float(total)
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            out = loss_fn(*args, **kwargs)
        got = float(out) if torch.is_tensor(out) and out.numel() == 1 else None
    except Exception as err:  # noqa: BLE001 (whatever a model's loss raises on the test input: not ours to judge)
        return f"calling its loss_function ({name}) on a test input raised {type(err).__name__}: {err}"
    if got is None:
        return f"its loss_function ({name}) returned {type(out).__name__}, not a one-element tensor"

    def rel(a, b):
        return abs(a - b) / max(abs(b), 1e-12)

    matches = [obj for obj, v in expected.items() if math.isfinite(v) and rel(got, v) <= _MATCH_TOL]
    if len(matches) == 1 and all(rel(got, v) > _SEPARATION for obj, v in expected.items()
                                 if obj != matches[0] and math.isfinite(v)):
        return matches[0]
    closest = sorted(((rel(got, v), obj) for obj, v in expected.items() if math.isfinite(v)),
                     key=lambda item: item[0])[:2]
    if len(matches) > 1:
        return (f"its loss_function ({name}) matched several objectives on the test input "
                f"({', '.join(m.describe() for m in matches)})")
    return ("it computes none of the cross-entropies of the head with next-token or same-position targets: its "
            f"loss_function ({name}) returned {got:.6g} on random float64 logits, where the closest, "
            + "; ".join(f"{obj.describe()}, gives {expected[obj]:.6g}" for _, obj in closest)
            + " (label smoothing, class weights, an extra term or another reduction)")
