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
