"""Exactness under DDP: 2 processes (gloo, CPU, 127.0.0.1), unequal token counts per rank.

Window k of the ground truth is the union of every rank's k-th window (``harness.run_ddp``), run in
one process on the whole window at once. Every case below trains in ONE launch of 2 processes
(``harness.run_ddp_many``, the worker's ``--jobs``): a launch costs ~10-20 s of imports and rendezvous on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import torch

import harness as H
from test_exactness import GRAD_TOL, LOSS_TOL

pytestmark = pytest.mark.distributed


#: every case of this file: (scenario, worker flags); trained together, once, by the ``ddp`` fixture
JOBS = {
    "llama": ("llama", []),
    "llama_seqcls": ("llama_seqcls", []),
    "llama_tutorial": ("llama_tutorial", []),
    "avg_false": ("llama", ["--avg-false"]),
    "empty_rank": ("llama_empty_rank", []),
    "eval_llama_bs3": ("llama", ["--eval-bs", "3"]),
    "eval_llama_11_bs2": ("llama_11", ["--eval-bs", "2"]),
    "moe_global": ("qwen3_moe", ["--patch-config", json.dumps({"loss": {"aux_loss": "global"}, "log_fixes": False})]),
}


@pytest.fixture(scope="module")
def ddp():
    results = H.run_ddp_many(list(JOBS.values()), patch=True)
    return dict(zip(JOBS, results))


def assert_ddp_exact(result, what, **kw):
    rows = H.check_ddp_against_gt(result, **kw)
    assert rows
    for row in rows:
        assert row["rel_err"] <= GRAD_TOL, f"{what} step {row['step']}: rel err {row['rel_err']:.3e}"
        assert row["loss_rel_err"] is not None and row["loss_rel_err"] <= LOSS_TOL, f"{what} step {row['step']}: {row}"
    for step in result["steps"]:
        assert step["rank_grad_max_diff"] == 0.0  # DDP: every rank holds the same gradient
    return rows


@pytest.mark.parametrize("scenario", ["llama", "llama_seqcls", "llama_tutorial"])
def test_ddp_is_exact_with_unequal_tokens_per_rank(scenario, ddp):
    result = ddp[scenario]
    rows = assert_ddp_exact(result, scenario)
    if scenario == "llama":
        # the ranks really are unequal: rank 1 holds the long samples
        by_idx = {s["idx"]: s for s in result["samples"]}
        counts = [[sum(H.sample_loss_count(by_idx[i], "causal") for b in pr for i in b) for pr in step["idx_batches_per_rank"]] for step in result["steps"]]
        assert all(c1 >= 2 * c0 for c0, c1 in counts), counts
    assert len(rows) >= 2


def test_ddp_average_tokens_across_devices_false_is_turned_on(ddp):
    result = ddp["avg_false"]
    assert_ddp_exact(result, "avg=False")
    assert "turning it on" in result["stderr"]


def test_ddp_rank_without_targets_no_nan_no_hang(ddp):
    result = ddp["empty_rank"]
    first = result["steps"][0]["idx_batches_per_rank"][0]
    assert sorted(i for b in first for i in b) == [0, 2], "rank 0's first window should be the two empty samples"
    for step in result["steps"]:
        assert all(torch.isfinite(g).all() for g in step["grads"].values())
    assert_ddp_exact(result, "empty rank window")


@pytest.mark.parametrize(
    "job",
    ["eval_llama_bs3", "eval_llama_11_bs2"],
    ids=["12-samples-bs3", "11-samples-bs2-last-batch-padded-by-accelerate"],
)
def test_ddp_eval_loss_equals_single_process_token_mean(job, ddp):
    result = ddp[job]
    model = H.build_model("llama")
    model.load_state_dict(result["initial_state"])
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in result["samples"]:
            loss_sum, n = H.sample_loss_sum(model, s, "causal")
            total, count = total + float(loss_sum), count + n
    for rank in result["ranks"]:
        assert abs(rank["eval_loss"] - total / count) / (total / count) <= 1e-6, (rank["eval_loss"], total / count)


def test_moe_global_router_loss_on_two_processes(ddp):
    """MoE ``loss.aux_loss: global`` (tests/moe/test_moe.py's reference), 2 processes, the long samples on rank 1: the
    window's expert frequencies count both ranks' tokens."""
    from test_moe import TOL, reference

    result = ddp["moe_global"]
    model = H.build_moe("qwen3_moe")
    collator = H.RecordingCollator("causal", H.pad_id_of(model))
    by_idx = {s["idx"]: s for s in result["samples"]}
    assert len(result["steps"]) == 2
    for k, step in enumerate(result["steps"]):
        mbs = [collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
        assert len(mbs) == 4  # 2 micro-batches on each rank
        loss, grads = reference(model, result["initial_state"], mbs, "global")
        assert H.rel_err(step["grads"], grads) <= TOL
        assert abs(result["logged_losses"][k] - loss) / abs(loss) <= TOL
        assert step["rank_grad_max_diff"] == 0.0
        # the control: each rank's own window (its counts alone) is not the objective
        per_rank = [reference(model, result["initial_state"],
                              [collator.collate([by_idx[i] for i in b]) for b in rank_batches], "global")[1]
                    for rank_batches in step["idx_batches_per_rank"]]
        mean_of_ranks = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in grads}
        assert H.rel_err(mean_of_ranks, grads) > 100 * TOL
