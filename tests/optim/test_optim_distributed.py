"""GaLoreAdamW / ApolloAdamW under DDP + gradient accumulation and under FSDP2 (2 processes, gloo, CPU).

One launch of ``tests/support/optim_dist_worker.py`` (2 processes, ~15 s) runs every case; each test compares one case with a
single-process reference run in this (pytest) process: the same initial weights, the same optimizer settings, the
whole global batch per step (``optim_dist_worker.train_reference``).  The reference cannot run inside the workers:
its refreshes would not join the other rank's basis broadcast.

Data: every rank's micro-batches hold the same number of tokens (no padding), the loss of a micro-batch is its token
mean divided by GA, and DDP / FSDP2 average over the 2 ranks, so the accumulated gradient is the global token mean,
the reference's gradient up to float rounding (~1e-7 relative: different summation order).

Tolerance: final parameters, max over parameters of ||p - p_ref|| / ||p_ref|| <= 1e-5 (the issue's bound).

Why the exactness cases use ``proj_method="svd"``: the gradients of this random-init model on random tokens have a
flat spectrum, consecutive singular values of every projected matrix 0.4-2% of each other at both refreshes, for every
rank 1-16 (so no rank with a clear gap exists to pick).  A basis is then sensitive to the 1e-7 rounding difference, but
the exact SVD keeps it small (bases 7e-6 apart after the second refresh, parameters 3e-7).  The randomized range finder
is ~10x more sensitive there: the same 1e-7 relative noise added to the gradients of one process moved its second
basis by 5e-5 and the final parameters by 6e-6 to 1.2e-5 (vs 5e-7 with the exact SVD), i.e. at the bound for a reason
that has nothing to do with distribution.  The randomized case therefore checks what distribution must give exactly
(every rank holds the bit-identical basis and parameters) and stays near the reference only loosely (1e-4).

Measured on torch 2.13 CPU (parameters' max relative error vs the single process): DDP+GA GaLore svd 2.8e-7,
GaLore randomized 5.8e-6, APOLLO 2.7e-7; FSDP2 GaLore svd + reproject 2.7e-7, APOLLO tensor-wise 1.2e-7 (4.9e-3
before APOLLO's norms were made global over the shards).
"""

from __future__ import annotations

import pytest
import torch

import optim_dist_worker as W

pytestmark = pytest.mark.distributed

TOL = 1e-5  # final parameters vs the single-process run (the bound)
LOSS_TOL = 1e-6  # per-step loss: mean over ranks vs the single-process global-batch loss
BASIS_TOL = 1e-4  # max |P - P_ref| of the final bases (measured 7e-6 with the exact SVD)
RANDOMIZED_TOL = 1e-4  # parameters with the randomized range finder (measured 5.8e-6; see the module docstring)
MOMENT_TOL = 1e-4  # gathered FSDP2 moments vs the reference's (relative Frobenius; measured in the report)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return W.launch(tmp_path_factory.mktemp("optim_dist"))


@pytest.fixture(scope="module")
def reference(runs):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            cache[case] = W.train_reference(case, runs[case][0]["initial_state"])
        return cache[case]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_against_reference(case: str, runs, reference, tol: float = TOL):
    """Common checks of one case; returns ``(records, ref_model, ref_optimizer, worst parameter error)``."""
    recs = runs[case]
    model, opt, ref_losses = reference(case)
    # the data split is right: the ranks' (GA-summed) losses average to the global-batch loss, every step
    for step, ref_loss in enumerate(ref_losses):
        dist_loss = sum(r["losses"][step] for r in recs) / len(recs)
        assert abs(dist_loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (case, step, dist_loss, ref_loss)
    # the optimizer projects the same matrices in both runs
    assert recs[0]["projected_names"] == list(W.projected(opt)), case
    assert len(recs[0]["projected_names"]) == 7 * W.MODEL_CONFIG["num_hidden_layers"]  # q k v o gate up down
    # every rank ends with bit-identical parameters
    for r in recs[1:]:
        for name, value in recs[0]["final"].items():
            assert torch.equal(r["final"][name], value), f"{case}: rank {r['rank']} differs from rank 0 in {name}"
    ref = {n: p.detach() for n, p in model.named_parameters()}
    assert recs[0]["final"].keys() == ref.keys()
    errs = {n: _rel(recs[0]["final"][n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    init = recs[0]["initial_state"]
    moved = min(_rel(ref[n], init[n]) for n in recs[0]["projected_names"])
    print(f"\n{case}: max param rel err {errs[worst]:.2e} ({worst}); smallest relative change of a projected matrix {moved:.2e}")
    assert moved > 100 * tol, f"{case}: the weights barely moved ({moved:.2e}); the comparison would be vacuous"
    assert errs[worst] <= tol, f"{case}: {worst} rel err {errs[worst]:.3e} > {tol:g}"
    return recs, model, opt, errs[worst]


def assert_one_basis(case: str, recs, opt=None) -> None:
    """Every rank holds the bit-identical basis after the first and after the last refresh, the last refresh really
    replaced the first basis, and (``opt``: the reference optimizer) the basis is the single process's up to rounding."""
    names = recs[0]["projected_names"]
    assert set(recs[0]["proj"]) == set(names) == set(recs[0]["proj_first"])
    for r in recs[1:]:
        for n in names:
            assert torch.equal(r["proj_first"][n], recs[0]["proj_first"][n]), f"{case}: first basis of {n} differs on rank {r['rank']}"
            assert torch.equal(r["proj"][n], recs[0]["proj"][n]), f"{case}: basis of {n} differs on rank {r['rank']}"
    for n in names:
        assert not torch.equal(recs[0]["proj"][n], recs[0]["proj_first"][n]), f"{case}: no refresh of {n} within the run"
        assert not hasattr(recs[0]["proj"][n], "placements"), "the basis is a plain (replicated) tensor"
    if opt is not None:
        mats = W.projected(opt)
        diff = max(float((recs[0]["proj"][n] - opt.state[mats[n]]["proj"]).abs().max()) for n in names)
        print(f"{case}: max |P - P_ref| of the final bases {diff:.2e}")
        assert diff <= BASIS_TOL, f"{case}: bases {diff:.2e} from the single process's"


def assert_one_seed(case: str, recs, opt) -> None:
    """APOLLO: every rank regenerates its projection from the same seed, the single process's, and the refresh inside
    the run moved every seed on."""
    mats = W.projected(opt)
    names = recs[0]["projected_names"]
    assert set(recs[0]["proj_seed"]) == set(names)
    for r in recs[1:]:
        assert r["proj_seed"] == recs[0]["proj_seed"] and r["proj_seed_first"] == recs[0]["proj_seed_first"], case
    for n in names:
        assert recs[0]["proj_seed"][n] == int(opt.state[mats[n]]["proj_seed"]), f"{case}: seed of {n}"
        assert recs[0]["proj_seed"][n] != recs[0]["proj_seed_first"][n], f"{case}: no refresh of {n} within the run"
    assert len(set(recs[0]["proj_seed"].values())) == len(names), "each matrix has its own projection"


# ----------------------------------------------------------------------------------------------------------------------
# DDP + gradient accumulation 2


def test_ddp_ga_galore_equals_single_process(runs, reference):
    recs, _, opt, _ = check_against_reference("ddp_galore", runs, reference)
    assert_one_basis("ddp_galore", recs, opt)


def test_ddp_ga_galore_lowrank_grads_equals_single_process(runs, reference):
    """Low-rank gradient accumulation under DDP + GA 2: DDP all-reduces only the unprojected parameters, the optimizer
    the rank-8 accumulators (and the few refreshing matrices' full gradients); equal to single-process full-gradient
    GaLore with the same refresh schedule; fewer bytes all-reduced than plain DDP of the same run."""
    recs, _, opt, _ = check_against_reference("ddp_galore_lowrank", runs, reference)
    n = len(recs[0]["projected_names"])
    assert recs[0]["full_grads_at_step"][0] == n  # first step: every matrix needs its first basis
    assert all(0 < k < n for k in recs[0]["full_grads_at_step"][1:]), recs[0]["full_grads_at_step"]
    plain = runs["ddp_galore_stagger"][0]
    ours_total = recs[0]["ddp_bytes"] + recs[0]["optimizer_bytes"]
    print(f"ddp_galore_lowrank: bytes all-reduced over {W.STEPS} steps: plain DDP {plain['ddp_bytes']}, "
          f"ours {ours_total} (DDP {recs[0]['ddp_bytes']} + accumulators {recs[0]['optimizer_bytes']}): "
          f"{ours_total / plain['ddp_bytes']:.3f}x")
    assert plain["optimizer_bytes"] == 0 and recs[0]["optimizer_bytes"] > 0
    assert ours_total < plain["ddp_bytes"]
    for r in recs:  # rank 1 with the same bases and parameters (checked above) and the same traffic
        assert r["optimizer_bytes"] == recs[0]["optimizer_bytes"]


def test_ddp_ga_galore_randomized_every_rank_same_basis(runs, reference):
    # exact agreement between the ranks; only loose agreement with the single process (module docstring)
    recs, _, _, _ = check_against_reference("ddp_galore_randomized", runs, reference, tol=RANDOMIZED_TOL)
    assert_one_basis("ddp_galore_randomized", recs)


def test_ddp_ga_apollo_equals_single_process(runs, reference):
    recs, _, opt, _ = check_against_reference("ddp_apollo", runs, reference)
    assert_one_seed("ddp_apollo", recs, opt)


# ----------------------------------------------------------------------------------------------------------------------
# FSDP2 (fully_shard per decoder layer and on the root), gradient accumulation 2


def _moment_bytes(opt) -> int:
    return sum(
        opt.state[p][k].numel() * opt.state[p][k].element_size() for p in W.projected(opt).values() for k in ("exp_avg", "exp_avg_sq")
    )


def assert_sharded_moments(case: str, recs, opt) -> None:
    """The low-rank moments are DTensors placed like their parameter (Shard(0)), shard-local, half the single
    process's per rank; the stored state is exactly what the math needs for the local shard."""
    rank_ = W.CASES[case][2]["rank"]
    mats = W.projected(opt)
    worst = 0.0
    for r in recs:
        for n in r["projected_names"]:
            m_rows, _ = mats[n].shape
            for key, info in r["moments"][n].items():
                assert info["is_dtensor"], f"{case}: {n} {key} is not a DTensor"
                assert info["placements"] == ["Shard(dim=0)"], (n, key, info["placements"])
                assert info["side"] == 1, "auto reduces the in-features of a Shard(0) weight"
                assert info["param_local_shape"][0] == m_rows // W.WORLD
                assert info["local_shape"] == (m_rows // W.WORLD, rank_), (n, key, info["local_shape"])
                assert info["global_shape"] == (m_rows, rank_)
                worst = max(worst, _rel(info["full"], opt.state[mats[n]][key]))
        assert r["state_bytes"] == r["expected_state_bytes"], (case, r["rank"], r["state_bytes"], r["expected_state_bytes"])
        assert 2 * r["projected_moment_bytes"] == _moment_bytes(opt), (r["projected_moment_bytes"], _moment_bytes(opt))
    print(f"{case}: gathered moments vs the single process's, max rel err {worst:.2e}; projected moments per rank "
          f"{recs[0]['projected_moment_bytes']} B vs {_moment_bytes(opt)} B in one process")
    assert worst <= MOMENT_TOL, f"{case}: moments {worst:.2e} from the single process's"


def test_fsdp2_galore_equals_single_process(runs, reference):
    recs, _, opt, _ = check_against_reference("fsdp_galore", runs, reference)
    assert_one_basis("fsdp_galore", recs, opt)
    assert_sharded_moments("fsdp_galore", recs, opt)


def test_fsdp2_apollo_tensor_scale_equals_single_process(runs, reference):
    # tensor-wise scale and the norm-growth limiter need the norm of the whole update, not of the local shard
    recs, _, opt, _ = check_against_reference("fsdp_apollo", runs, reference)
    assert_one_seed("fsdp_apollo", recs, opt)
    assert_sharded_moments("fsdp_apollo", recs, opt)
