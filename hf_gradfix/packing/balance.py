"""Compute cost of packed documents, and partitions that balance it (issue 40, item 2; first piece).

Attention work grows with the sum of squared document lengths, so rows with equal tokens can cost very different
time. The cost proxy per document is verl's ``L * (c + L)``: ``c * L`` for the token-linear work (MLP,
projections) and ``L**2`` for attention; ``c`` is the ratio of linear to attention work per token (the
integration layer will derive it from the model config; ``c = inf`` means tokens only). Pure numpy.

>>> document_cost([4, 2], linear_coeff=2.0).tolist()
[24.0, 8.0]
>>> bins = lpt_partition([8, 1, 1, 1, 1, 1, 1, 1, 1], n_bins=2, costs=document_cost([8] + [1] * 8, 0.0))
>>> sorted(len(b) for b in bins)
[1, 8]
>>> round(imbalance([3.0, 1.0]), 3)
1.5
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def document_cost(lengths: Sequence[int] | np.ndarray, linear_coeff: float) -> np.ndarray:
    """Cost proxy ``L * (linear_coeff + L)`` per document (float64)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * (float(linear_coeff) + lengths)


def imbalance(loads: Sequence[float] | np.ndarray) -> float:
    """max / mean over ranks (1.0 is perfect balance; the slowest rank sets the step)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def lpt_partition(lengths: Sequence[int], n_bins: int, costs: Sequence[float] | np.ndarray) -> list[list[int]]:
    """Longest-processing-time partition of documents into ``n_bins`` by ``costs``: each document, largest cost
    first, goes to the currently cheapest bin (a 4/3 approximation of the minimal slowest bin). Deterministic: ties
    break by document index, then bin index. Every document lands in exactly one bin."""
    costs = np.asarray(costs, dtype=np.float64)
    if len(costs) != len(lengths):
        raise ValueError(f"costs has {len(costs)} entries for {len(lengths)} lengths; pass one cost per document")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return bins


def attention_cost_coeff(config) -> tuple[float | None, str]:
    """The ``c`` of :func:`document_cost` for a decoder from its config (any object or mapping with the usual
    names): ``(c, how)``, or ``(None, what is missing)``.

    One layer's forward on a document of ``L`` tokens costs about ``2 * P * L`` FLOPs in its linear layers
    (``P``: their weights: q, k, v, o and a gated MLP; for MoE the active experts' MLPs) plus ``2 * q * L**2`` in
    causal attention (``L**2 / 2`` query-key pairs, two matrix products of width ``q = heads * head_dim``), i.e.
    ``2 * q * L * (P / q + L)``: ``c = P / q``. Llama 3.1 8B: c = 53,248 (attention is half the cost from 53k tokens).

    >>> c, how = attention_cost_coeff({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    ...                                "intermediate_size": 14336})
    >>> int(c)
    53248
    """
    get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    text = get("text_config")
    if text is not None and get("hidden_size") is None:
        return attention_cost_coeff(text)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if not hidden or not heads:
        return None, "the model config has no hidden_size / num_attention_heads"
    head_dim = get("head_dim") or hidden // heads
    kv = get("num_key_value_heads") or heads
    inter = get("intermediate_size")
    experts = get("num_experts_per_tok")
    if experts and get("moe_intermediate_size"):
        inter = get("moe_intermediate_size") * experts + (get("shared_expert_intermediate_size") or 0)
    if not inter:
        return None, "the model config has no intermediate_size"
    q = heads * head_dim
    linear = hidden * (q + 2 * kv * head_dim) + q * hidden + 3 * hidden * inter
    return linear / q, f"c = {linear / q:,.0f} (linear weights per layer / attention width, from the model config)"
