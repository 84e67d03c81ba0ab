"""TRL 1.16's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``), exact over the optimizer window
(issue 35).

Driven offline on CPU through its own seams (``tests/support/rl_async_runs.py``: a fixed rollout worker, a no-op weight
transfer, a tiny random-init Qwen2, the offline tokenizer, a CPU stand-in for the tree-attention kernel). Every
optimizer step's accumulated gradient and logged loss are compared with a float64, one-process reference recomputed
here from the samples the collator packed into each micro-batch (each sample alone through the model's ordinary
forward, no packing, no trie): the clipped surrogate's token mean over every trained token of the window, all ranks.
Control that must fail: stock TRL's mean of micro-batch token means, on the same run.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("trl.experimental.async_grpo")

import harness as H  # noqa: E402
import rl_async_runs as A  # noqa: E402

GRAD_TOL = 1e-5
LOSS_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# The reference, from the definitions (not from hf_gradfix's code)
# ----------------------------------------------------------------------------------------------------------------------


def sample_terms(model, sample, temperature, eps_low, eps_high):
    """(sum of the clipped-surrogate loss over the sample's trained tokens, their count), float64. A trained token at
    position p (completion_mask[p] = 1, p >= 1) is scored by the model's prediction at p - 1 given tokens [0, p)."""
    ids = torch.as_tensor(sample["input_ids"]).long()
    mask = torch.as_tensor(sample["completion_mask"]).bool()
    old = torch.as_tensor(sample["old_log_probs"]).double()
    logits = model(input_ids=ids.unsqueeze(0)).logits[0].double() / temperature
    logp_all = torch.log_softmax(logits[:-1], dim=-1)
    positions = torch.nonzero(mask[1:]).flatten() + 1
    logp = logp_all[positions - 1].gather(-1, ids[positions].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old[positions])
    adv = float(sample["advantage"])
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return per_token.sum(), float(positions.numel())


def window_reference(initial, micro_batches, temperature, epsilons, aggregation="window"):
    """(loss, gradient) of one window: ``micro_batches`` is a list of micro-batches, each a list of rank rows, each a
    list of samples. "window": every term over every token of the window; "mean_of_micro_means": each micro-batch's
    token mean (over its ranks), averaged over the micro-batches (stock TRL)."""
    model = copy.deepcopy(initial).double()
    model.train()
    model.zero_grad(set_to_none=True)
    sums, counts = [], []
    for rows in micro_batches:
        terms = [sample_terms(model, s, temperature, *epsilons) for row in rows for s in row]
        sums.append(torch.stack([t for t, _ in terms]).sum())
        counts.append(sum(n for _, n in terms))
    if aggregation == "window":
        loss = torch.stack(sums).sum() / sum(counts)
    else:
        loss = torch.stack([s / n for s, n in zip(sums, counts)]).mean()
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def windows(run):
    return [run.rows[k * run.ga : (k + 1) * run.ga] for k in range(len(run.grads))]


def check_inputs_are_the_rows(run, rank=0):
    """The recorded samples are what compute_loss trained on: per micro-batch, this rank's loss terms (count, old
    log-probabilities, advantages, in order) equal its row's samples'."""
    for k, inputs in enumerate(run.inputs):
        row = run.rows[k][rank]
        selected = inputs["token_index"] >= 0
        old = torch.cat([torch.as_tensor(s["old_log_probs"])[1:][torch.as_tensor(s["completion_mask"])[1:].bool()]
                         for s in row]).float()
        adv = torch.cat([torch.full((int(torch.as_tensor(s["completion_mask"])[1:].sum()),), float(s["advantage"]))
                         for s in row]).float()
        assert torch.equal(inputs["old_log_probs"][selected], old), k
        assert torch.equal(inputs["advantages"][selected], adv), k


def errors(run, aggregation="window"):
    """Per step: (gradient error vs the window reference, logged-loss error, gradient error of ``aggregation``)."""
    rows = []
    for k, window in enumerate(windows(run)):
        value, truth = window_reference(run.initial, window, run.temperature, run.epsilon)
        err = H.rel_err(run.grads[k], truth)
        loss_err = abs(run.logged[k] - value) / max(abs(value), 1.0) if k < len(run.logged) else float("inf")
        rows.append((err, loss_err))
    return rows


def stock_control(run):
    """The gradient of stock's aggregation (mean of micro-batch means) vs the window's token mean, per step."""
    out = []
    for window in windows(run):
        _, truth = window_reference(run.initial, window, run.temperature, run.epsilon)
        _, control = window_reference(run.initial, window, run.temperature, run.epsilon, "mean_of_micro_means")
        out.append(H.rel_err(control, truth))
    return out


def assert_exact(run, what):
    assert len(run.grads) == 2 and len(run.logged) == 2, (what, len(run.grads), run.logged)
    check_inputs_are_the_rows(run)
    rows = errors(run)
    for k, (err, loss_err) in enumerate(rows):
        assert err <= GRAD_TOL, f"{what} step {k}: gradient {err:.3e} from the window reference ({rows})"
        assert loss_err <= LOSS_TOL, f"{what} step {k}: logged loss {loss_err:.3e} ({rows})"
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ga,mode", [(1, "patch"), (2, "patch"), (4, "patch"), (2, "callback")])
def test_async_grpo_is_the_token_mean_over_the_window(ga, mode):
    run = A.run_async(mode=mode, ga=ga)
    tokens = [sum(int(torch.as_tensor(s["completion_mask"]).sum()) for row in mb for s in row) for mb in run.rows]
    if ga > 1:
        assert max(tokens) >= 3 * min(tokens), tokens  # micro-batches of very different token counts
    assert not run.warnings, run.warnings
    assert any("AsyncGRPOTrainer: the token mean over the optimizer window" in m for m in run.infos), run.infos
    assert_exact(run, f"GA {ga} {mode}")


def test_stock_is_a_mean_of_micro_batch_means_and_fails_the_bar():
    """The control: stock TRL on the same rollouts matches the mean of micro-batch means (its own definition, so the
    harness reads stock right) and misses the window's token mean by far more than the tolerance."""
    stock = A.run_async(mode="stock", ga=2)
    check_inputs_are_the_rows(stock)
    controls = stock_control(stock)
    for k, window in enumerate(windows(stock)):
        _, micro_means = window_reference(stock.initial, window, stock.temperature, stock.epsilon,
                                          "mean_of_micro_means")
        assert H.rel_err(stock.grads[k], micro_means) <= GRAD_TOL, k
    stock_errors = [err for err, _ in errors(stock)]
    assert min(stock_errors) > 100 * GRAD_TOL, stock_errors
    assert all(c > 100 * GRAD_TOL for c in controls), controls


def test_token_budget_batcher_is_exact():
    """TokenBudgetBatcher: micro-batches of a dynamic sample count, each row capped at 40 forwarded tokens."""
    run = A.run_async(ga=2, token_budget=40)
    assert len({sum(len(row) for row in mb) for mb in run.rows}) > 1, [[len(r) for r in mb] for mb in run.rows]
    assert not run.warnings, run.warnings
    assert_exact(run, "token budget 40")


def test_a_subclass_with_its_own_compute_loss_trains_as_stock_with_one_warning():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class OwnLoss(AsyncGRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    ours = A.run_async(ga=2, trainer_cls=OwnLoss)
    assert len(ours.warnings) == 1 and "compute_loss is its own" in ours.warnings[0], ours.warnings
    for k, window in enumerate(windows(ours)):  # stock's own aggregation
        _, micro_means = window_reference(ours.initial, window, ours.temperature, ours.epsilon, "mean_of_micro_means")
        assert H.rel_err(ours.grads[k], micro_means) <= GRAD_TOL, k


def test_a_moe_policy_with_the_router_aux_loss_trains_as_stock_with_one_warning():
    """TRL adds coef x aux / GA into the same scalar as the policy loss: not separated, so left to TRL, named once."""
    ours = A.run_async(ga=2, steps=1, moe=True)
    stock = A.run_async(ga=2, steps=1, moe=True, mode="stock")
    assert len(ours.warnings) == 1 and "router aux loss" in ours.warnings[0], ours.warnings
    assert ours.grads and H.rel_err(ours.grads[0], stock.grads[0]) <= 1e-6


@pytest.mark.distributed
def test_two_processes_every_rank_counted():
    """2 gloo processes: each micro-batch is one row per rank (rank 0 collates and scatters them); the window is every
    row of every micro-batch. Stock on the same launch as the control."""
    from multiproc import launch_cases

    runs, _ = launch_cases("rl_async_runs.py", ["ga2", "ga2_stock"], nproc=2)
    for name, ranks in runs.items():
        rank_runs = []
        for r in ranks:
            run = A.AsyncRun(**{k: r[k] for k in ("grads", "rows", "inputs", "logged", "warnings", "initial",
                                                    "epsilon", "temperature", "ga")})
            rank_runs.append(run)
        main = rank_runs[0]  # only rank 0 collates: its rows hold every rank's samples
        assert all(len(mb) == 2 for mb in main.rows)
        for rank, run in enumerate(rank_runs):
            run.rows = main.rows
            check_inputs_are_the_rows(run, rank)
        per_rank = [sum(float((i["token_index"] >= 0).sum()) for i in r.inputs) for r in rank_runs]
        assert per_rank[0] != per_rank[1], per_rank
        assert H.rel_err(rank_runs[1].grads[-1], main.grads[-1]) <= 1e-7  # DDP: one gradient
        if name == "ga2":
            assert not main.warnings, main.warnings
            assert_exact(main, "GA 2 on 2 ranks")
        else:
            assert min(err for err, _ in errors(main)) > 100 * GRAD_TOL
