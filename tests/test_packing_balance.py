"""Compute-balanced partition (issue 40 item 2, first piece): ground truth is a direct sum of L*(c+L) per bin."""

import numpy as np

from hf_gradfix.packing.balance import document_cost, imbalance, lpt_partition


def _long_tailed(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 400), 16, 4096).astype(int).tolist()
    return lengths + [16384] * 3


def _cost_loads(bins, lengths, c):
    # independent ground truth: plain Python sum of L*(c+L) per bin
    return [sum(lengths[i] * (c + lengths[i]) for i in b) for b in bins]


def test_every_document_once_and_compute_balance_beats_token_balance():
    lengths, c, n = _long_tailed(), 512.0, 4
    by_cost = lpt_partition(lengths, n, document_cost(lengths, c))
    by_tokens = lpt_partition(lengths, n, np.asarray(lengths, dtype=float))
    for bins in (by_cost, by_tokens):
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    cost_imb = imbalance(_cost_loads(by_cost, lengths, c))
    token_imb = imbalance(_cost_loads(by_tokens, lengths, c))
    assert cost_imb < token_imb  # control: the token-balanced partition is worse on cost
    assert cost_imb < 1.05 < token_imb


def test_deterministic():
    lengths = _long_tailed(1)
    costs = document_cost(lengths, 256.0)
    assert lpt_partition(lengths, 2, costs) == lpt_partition(lengths, 2, costs)
