"""The router load-balancing loss of a whole optimizer window, split exactly over its micro-batches and ranks.

The Switch-Transformer load-balancing loss that transformers' MoE families add (``load_balancing_loss_func`` of
Mixtral, Qwen2/3-MoE, OLMoE, ...) is, over a set of routed rows (one row = one real token at one MoE layer; every
layer's rows together, as transformers concatenates them)::

    LB = E * sum_e f_e * P_e,      f_e = C_e / N   (C_e: top-k selections of expert e),   P_e = Q_e / N
                                    (Q_e: summed router probability of expert e),          N: rows

Stock evaluates it per micro-batch (``f`` and ``P`` of a handful of sequences) and averages: the ``micro``
convention. The ``global`` convention counts ``f`` over the whole optimizer window on every rank (Qiu et al. 2025,
"Demons in the Detail", arXiv 2501.11873). Its gradient flows through ``P`` only (``f`` comes from a top-k), and
``Q`` is a sum over rows, so the window's loss splits exactly into per-micro-batch terms once the window's counts
``C`` and rows ``N`` are known::

    LB_window = sum over micro-batches m (all ranks) of  E * sum_e C_e * Q_e(m) / N**2

which is :func:`window_share`; :func:`routing_stats` reads ``C``, ``Q`` and ``N`` of one forward's router logits.

>>> import torch
>>> logits = (torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]),)   # one layer, two rows, three experts, top-1
>>> s = routing_stats(logits, top_k=1)
>>> s.counts.tolist(), s.rows
([[1.0, 1.0, 0.0]], 2.0)
>>> float(window_share(s.prob_sum, s.counts.sum(0), s.rows, 3))   # this micro-batch is the whole window
1.34...

This module is pure math: it imports neither transformers nor accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["RoutingStats", "load_balancing", "routing_stats", "window_share"]


@dataclass
class RoutingStats:
    """One forward's routing: ``counts`` (layers, experts) float64 top-k selections over counted rows (no graph),
    ``prob_sum`` (experts,) float32 summed router probabilities over every layer's counted rows (with its graph),
    ``rows`` counted rows summed over layers (transformers' ``total_rows``)."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    rows: float


def routing_stats(router_logits: Sequence[torch.Tensor], top_k: int, row_mask: torch.Tensor | None = None) -> RoutingStats:
    """Counts, probability sums and rows of one forward, as transformers' ``load_balancing_loss_func`` forms them:
    softmax over each layer's router logits (in their dtype), its top-k, rows weighted by ``row_mask`` (the flat
    attention mask: padding is never counted; ``None``: every row counts, e.g. packed rows)."""
    counts, prob_sum, rows = [], None, 0.0
    mask = None if row_mask is None else row_mask.reshape(-1).float()
    for layer in router_logits:
        probs = torch.softmax(layer, dim=-1)
        experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (rows, k)
        weight = torch.ones(chosen.shape[0], device=layer.device) if mask is None else mask.to(layer.device)
        c = torch.zeros(experts, dtype=torch.float64, device=layer.device)
        c.scatter_add_(0, chosen.reshape(-1), weight.double().repeat_interleave(top_k))
        counts.append(c)
        q = (probs.float() * weight.unsqueeze(-1)).sum(0)
        prob_sum = q if prob_sum is None else prob_sum + q.to(prob_sum.device)
        rows += float(weight.sum())
    return RoutingStats(torch.stack(counts).detach(), prob_sum, rows)


def window_share(prob_sum: torch.Tensor, window_counts: torch.Tensor, window_rows: float, num_experts: int) -> torch.Tensor:
    """One micro-batch's exact share of the window's load-balancing loss: ``E * sum_e C_e * Q_e(m) / N**2``
    (``window_counts``: ``C`` summed over layers, every micro-batch and rank of the window; ``window_rows``: ``N``).
    A window without rows contributes a connected zero."""
    if window_rows <= 0:
        return prob_sum.sum() * 0.0
    c = window_counts.to(device=prob_sum.device, dtype=prob_sum.dtype)
    return num_experts * (c * prob_sum).sum() / (float(window_rows) ** 2)


def load_balancing(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                   row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing loss of one forward on its own (what transformers returns as ``aux_loss``): the window
    share with the forward as the whole window. Used to check, by value, that a model's ``aux_loss`` is this loss."""
    s = routing_stats(router_logits, top_k, row_mask)
    return window_share(s.prob_sum, s.counts.sum(0), s.rows, num_experts)
