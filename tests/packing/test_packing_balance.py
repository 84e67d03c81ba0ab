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


# ---------------------------------------------------------------------- the sampler dealing bins by compute


def _mix(seed=0, n=3000):
    """Long-tailed lengths: lognormal plus a few documents near the budget (the long-context tail)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 1.0, n).astype(int), 8, 16000)
    lengths[:10] = 15000
    return lengths


def _step_max_sum(plan, lengths, c):
    # independent: each bin's cost from the lengths of the samples it yields, the slowest rank per step summed
    costs = [sum(int(lengths[i]) * (c + int(lengths[i])) for i in plan.bin(b)) for b in range(plan.n_bins)]
    return sum(max(costs[b] for b in step) for step in plan.schedule.tolist())


def test_sampler_deals_by_compute_same_bins_no_sample_lost_slowest_rank_cheaper():
    """cost_coeff: the same bins (the packing is by tokens), every sample once, and the sum over steps of the
    slowest rank's compute is never above the token deal's (sorting by cost and cutting into steps of W minimizes
    it for a fixed set of bins); measured on a long-tailed mix, with a shuffled deal as the control."""
    from hf_gradfix.packing.sampler import PackedBatchSampler

    lengths, c = _mix(), 2048.0
    for world in (2, 4, 8):
        by_tokens = PackedBatchSampler(lengths, 16384, num_replicas=world, rank="all", seed=3).plan()
        by_cost = PackedBatchSampler(lengths, 16384, num_replicas=world, rank="all", seed=3, cost_coeff=c).plan()
        assert sorted(map(tuple, by_cost.bins)) == sorted(map(tuple, by_tokens.bins))
        assert sorted(by_cost.items.tolist()) == list(range(len(lengths)))
        cost_sum, token_sum = _step_max_sum(by_cost, lengths, c), _step_max_sum(by_tokens, lengths, c)
        assert cost_sum <= token_sum, (world, cost_sum, token_sum)
        if world >= 4:
            assert cost_sum < token_sum, (world, cost_sum / token_sum)
        shuffled = by_cost.schedule.flatten()[np.random.default_rng(0).permutation(by_cost.schedule.size)]
        control = type(by_cost)(**{**by_cost.__dict__, "schedule": shuffled.reshape(by_cost.schedule.shape)})
        assert _step_max_sum(control, lengths, c) > cost_sum  # control: a deal that ignores cost is slower
        assert by_cost.step_imbalance(by_cost.bin_costs) < by_tokens.step_imbalance(by_cost.bin_costs)


def test_sampler_by_compute_resumes_exactly_and_refuses_the_other_deal():
    from hf_gradfix.errors import HfGradfixError
    from hf_gradfix.packing.sampler import PackedBatchSampler

    lengths = _mix(1, 800)
    full = list(PackedBatchSampler(lengths, 16384, num_replicas=2, rank=0, cost_coeff=512.0))
    first = PackedBatchSampler(lengths, 16384, num_replicas=2, rank=0, cost_coeff=512.0)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    resumed = PackedBatchSampler(lengths, 16384, num_replicas=2, rank=0, cost_coeff=512.0)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    other = PackedBatchSampler(lengths, 16384, num_replicas=2, rank=0)
    try:
        other.load_state_dict(state)
    except (HfGradfixError, ValueError) as err:
        assert "fingerprint" in str(err) or "differ" in str(err), err
    else:
        raise AssertionError("a token-balanced sampler took a compute-balanced sampler's state")
