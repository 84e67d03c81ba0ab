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
) -> torch.Tensor:
    """``sum_t CE(hidden_t @ weight.T + bias, target_t)`` over the targets that are not ``ignore_index``.

    ``hidden``: (N, H); ``weight``: (V, H); ``targets``: (N,). On torch's ``linear_cross_entropy`` (chunked, accurate
    accumulation) where it exists, else chunks of :data:`FALLBACK_CHUNK_TOKENS` tokens whose logits are recomputed in
    the backward (activation checkpointing), so one chunk's logits are alive at a time on either path.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if has_torch_linear_cross_entropy():
        # "accurate": fp32 accumulation of the logsumexp and the gradients (the chunked path's own choice of
        # accumulation for low-precision inputs may differ from the stock head's fp32 upcast)
        options = torch.nn.LinearCrossEntropyOptions(acc_policy="accurate")
        return F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="sum",
                                      ignore_index=ignore_index, label_smoothing=label_smoothing, options=options)
    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], FALLBACK_CHUNK_TOKENS):
        end = start + FALLBACK_CHUNK_TOKENS
        total = total + checkpoint(_chunk_sum, hidden[start:end], weight, bias, targets[start:end], ignore_index,
                                   label_smoothing, use_reentrant=False)
    return total


def _chunk_sum(hidden, weight, bias, targets, ignore_index, label_smoothing):
    logits = F.linear(hidden, weight, bias).float()  # the stock head's upcast, one chunk at a time
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)


def next_token_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """transformers' causal-LM shift: position t is scored against ``labels[t + 1]``; the last position against
    ``ignore_index`` (what ``ForCausalLMLoss`` does when no ``shift_labels`` are given).

    >>> next_token_targets(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
