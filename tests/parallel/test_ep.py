"""Expert parallelism (transformers 5.24's ``DistributedConfig(ep_size=2, ep_implementation="all_to_all")``) through the
``Trainer`` on 2 gloo processes, against a one-process float64 reference of the whole window.

The model is loaded as a user loads it, ``from_pretrained(path, distributed_config=...)`` (``tests/support/ep_worker.py``): each
rank holds 3 of the 6 experts whole, tokens reach them by all-to-all, dense modules are FSDP2-sharded over the 2 ranks.
The reference is tests/moe/test_moe.py's (token-mean cross-entropy over the window + ``coef *`` the ``micro`` router loss,
written from the definitions, float64, experts as plain per-expert matmuls), on the micro-batches both ranks trained.
Gradients are compared per group: dense, router (``mlp.gate``), experts (``mlp.experts``, shards gathered).
"""

from __future__ import annotations

import pytest
import torch

import harness as H
from multiproc import launch_cases
from test_moe import reference

def _all_to_all_expert_parallelism() -> bool:
    """transformers' DistributedConfig with expert-sharded FSDP (fsdp_size, ep_size, ep_implementation): 5.x."""
    import inspect

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    names = inspect.signature(DistributedConfig.__init__).parameters
    return {"fsdp_size", "ep_size", "ep_implementation"} <= set(names)


pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not _all_to_all_expert_parallelism(),
                                 reason="this transformers has no DistributedConfig(fsdp_size, ep_size, "
                                        "ep_implementation) expert parallelism (transformers 5.x)")]
TOL = 1e-5
FAMILIES = ["family_mixtral_micro", "family_mixtral_global", "family_olmoe_micro"]  # global: Qwen3-MoE, Mixtral
CASES = ["patched", "config_ep", "patched_global", "stock", "unscaled", "unscaled_refused",
         "ep_resume", "config_ep_resume", "ep_resume_refused", *FAMILIES]  # ep_resume_refused reads ep_resume's checkpoint


@pytest.fixture(scope="module")
def ep_runs():
    runs, _ = launch_cases("ep_worker.py", CASES, nproc=2, keep_env="HGF_KEEP_EP_RUNS")
    return runs


def _group(name: str) -> str:
    return "experts" if ".mlp.experts." in name else ("router" if ".mlp.gate." in name else "dense")


def _errors(ranks: list[dict], reference_from: dict, convention: str = "micro", family: str = "qwen3_moe") -> list[dict]:
    """Per window: the relative gradient error of each group and of the logged loss, vs the float64 reference."""
    model = H.build_moe(family)
    collator = H.RecordingCollator("causal", H.pad_id_of(model))
    by_idx = {s["idx"]: s for s in reference_from["samples"]}
    rows = []
    for k, step in enumerate(ranks[0]["steps"]):
        mbs = [collator.collate([by_idx[i] for i in b]) for r in ranks for b in r["steps"][k]["idx_batches"]]
        loss, ref = reference(model, reference_from["initial_state"], mbs, convention)
        got = step["grads"]
        row = {"window": k, "loss": abs(ranks[0]["logged_losses"][k] - loss) / abs(loss),
               "ranks_differ": max(float((got[n] - r["steps"][k]["grads"][n]).abs().max()) for r in ranks[1:] for n in got)}
        for group in ("dense", "router", "experts"):
            names = [n for n in ref if _group(n) == group]
            a = torch.cat([got[n].double().flatten() for n in names])
            b = torch.cat([ref[n].flatten() for n in names])
            row[group] = float((a - b).norm() / b.norm())
        qk = [n for n in ref if n.endswith(("q_norm.weight", "k_norm.weight"))]  # tp 'replicated_with_grad_allreduce'
        if qk:
            a = torch.cat([got[n].double().flatten() for n in qk])
            b = torch.cat([ref[n].flatten() for n in qk])
            row["qk_norm"] = float((a - b).norm() / b.norm())
        rows.append(row)
    return rows


def test_expert_parallel_gradients_are_the_window_objective(ep_runs):
    ranks = ep_runs["patched"]
    assert ranks[0]["hf_gradfix_file"].startswith(str(H.REPO_ROOT))  # the workers ran this checkout's hf_gradfix
    assert "expert parallel ep=2 (efsdp=1, all_to_all)" in ranks[0]["line"]
    assert ranks[0]["wrapped"].startswith("FSDP")  # transformers' FSDP2, not accelerate's DDP
    rows = _errors(ranks, ranks[0])
    assert len(rows) == 2
    for row in rows:
        assert max(row["dense"], row["router"], row["experts"], row["loss"]) <= TOL, rows
        assert row["ranks_differ"] == 0.0


def test_parallel_ep_from_the_config_section(ep_runs):
    """``parallel: {dp_shard: 2, ep: 2}`` with the plain model given to the Trainer: hf_gradfix has transformers shard it
    by expert (the same DistributedConfig a user passes to from_pretrained) and the window's gradient is exact."""
    ranks = ep_runs["config_ep"]
    assert "expert parallel ep=2 (efsdp=1, all_to_all)" in ranks[0]["line"]
    assert "from the config" in ranks[0]["line"] and ranks[0]["wrapped"].startswith("FSDP")
    for row in _errors(ranks, ranks[0]):
        assert max(row["dense"], row["router"], row["experts"], row["loss"]) <= TOL, row
        assert row["ranks_differ"] == 0.0


@pytest.mark.parametrize("case", FAMILIES)
def test_other_moe_families_under_expert_parallelism(ep_runs, case):
    """Mixtral (4 experts) and OLMoE (6) with their own ep plans, ``parallel: {dp_shard: 2, ep: 2}``, each convention:
    every group equals the float64 reference of that convention; ``global`` is far from the ``micro`` reference."""
    family, convention = case[len("family_"):].rsplit("_", 1)
    ranks = ep_runs[case]
    assert "expert parallel ep=2 (efsdp=1, all_to_all)" in ranks[0]["line"]
    for row in _errors(ranks, ranks[0], convention, family):
        assert max(row["dense"], row["router"], row["experts"], row["loss"]) <= TOL, (case, row)
        assert row["ranks_differ"] == 0.0
    if convention == "global":
        assert all(row["router"] > 1e-2 for row in _errors(ranks, ranks[0], "micro", family)), case


def test_global_router_loss_under_expert_parallelism(ep_runs):
    """``aux_loss: global`` under ep x fsdp: the routing pre-pass runs in lockstep on both ranks; every group equals the
    window-loss reference, and the ``micro`` reference (the control) is far."""
    ranks = ep_runs["patched_global"]
    for row in _errors(ranks, ranks[0], "global"):
        assert max(row["dense"], row["router"], row["experts"], row["loss"]) <= TOL, row
    assert all(row["router"] > 1e-2 for row in _errors(ranks, ranks[0], "micro"))


def test_stock_router_loss_is_off_under_expert_parallelism(ep_runs):
    """The control: stock transformers under ep is exact for the token loss but multiplies the router term by
    GA x dp (transformers#48690): the router gradient fails the reference."""
    rows = _errors(ep_runs["stock"], ep_runs["stock"][0])
    assert all(row["router"] > 1.0 for row in rows), rows


def test_expert_gradients_not_averaged_over_data_ranks_are_refused(ep_runs):
    """The control for the experts: with the experts' FSDP2 divide factor 1 (the gradient summed over the data ranks,
    not averaged as the dense ones are), stock's expert gradient is dp = 2 times too large; hf_gradfix refuses it."""
    rows = _errors(ep_runs["unscaled"], ep_runs["stock"][0])
    for row in rows:
        assert row["experts"] > 0.5, rows  # 2x: relative error ~1
    refused = ep_runs["unscaled_refused"]
    for r in refused:
        assert "divides its gradient by [1.0]" in r["error"] and "2 data-parallel ranks" in r["error"], r["error"]


@pytest.mark.parametrize("case", ["ep_resume", "config_ep_resume"])
def test_checkpoint_resume_under_expert_parallelism_is_bit_identical(ep_runs, case):
    """4 AdamW windows (linear schedule, 2 epochs of the 16 samples) straight vs 2 + torch distributed checkpoint +
    a fresh model and trainer resumed + 2: the whole weights (shards gathered), the whole optimizer state and the
    logged losses after the resume are identical, on both routes (model loaded with distributed_config, and
    parallel.ep from the section)."""
    r = ep_runs[case][0]
    assert {"expert_parallel", "expert_parallel_mesh.json", "scheduler.pt", "model.safetensors"} <= set(r["files"])
    assert "optimizer.pt" not in r["files"]  # no one rank's shards under positional keys
    assert r["straight"].keys() == r["resumed"].keys() and len(r["straight"]) > 0
    assert all(torch.equal(r["straight"][n], r["resumed"][n]) for n in r["straight"])
    experts = [n for n in r["straight_optimizer"] if ".mlp.experts." in n and n.endswith("exp_avg")]
    assert experts and r["straight_optimizer"].keys() == r["resumed_optimizer"].keys()
    for key, value in r["straight_optimizer"].items():
        other = r["resumed_optimizer"][key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
    assert len(r["straight_log"]) == 2 and r["straight_log"] == r["resumed_log"]
    initial = H.build_moe("qwen3_moe").state_dict()
    assert all(not torch.equal(r["straight"][n], initial[n]) for n in r["straight"] if ".mlp.experts." in n)  # trained


def test_resume_without_the_optimizer_state_differs(ep_runs):
    """The control: the same resume with the AdamW moments left unloaded (the scheduler loaded) ends elsewhere, so the
    equality above is the optimizer state's doing."""
    r = ep_runs["ep_resume"][0]
    assert any(not torch.equal(r["straight"][n], r["control"][n]) for n in r["straight"])
    assert r["control_log"] != r["straight_log"]


def test_ep_checkpoint_on_another_mesh_is_one_line(ep_runs, tmp_path):
    """A run without ep (parallel: {dp_shard: 2}) given the ep run's checkpoint refuses it on every rank, naming both
    meshes and the fix; so does an ep run given a checkpoint whose mesh file names other degrees, or none."""
    for r in ep_runs["ep_resume_refused"]:
        line = r["error"]
        assert "\n" not in line and "CheckpointError" in line, line
        assert "expert-parallel run (world 2, dp_replicate 1, dp_shard 2, tp 1, ep 2, efsdp 1)" in line, line
        assert "no expert parallelism" in line and "resume with the same world size" in line, line
    from hf_gradfix.integration.checkpoints import sharded as ckpt
    from hf_gradfix.integration.parallel.nd import NDParallelError

    ours = dict(world=2, dp_replicate=1, dp_shard=2, tp=1, ep=2, efsdp=1)
    with pytest.raises(NDParallelError, match="has no expert_parallel_mesh.json and expert_parallel/ .*not written by an "
                                              "expert-parallel run"):
        ckpt.load(None, str(tmp_path), ckpt.EXPERT_PARALLEL, ours, optimizer=False, error=NDParallelError)
    (tmp_path / ckpt.EXPERT_PARALLEL.directory).mkdir()
    (tmp_path / ckpt.EXPERT_PARALLEL.mesh_file).write_text(__import__("json").dumps({**ours, "ep": 1, "efsdp": 2}))
    with pytest.raises(NDParallelError) as err:
        ckpt.load(None, str(tmp_path), ckpt.EXPERT_PARALLEL, ours, optimizer=False, error=NDParallelError)
    line = str(err.value)
    assert "\n" not in line and "ep 1, efsdp 2), this run is expert-parallel (world 2" in line and "ep 2, efsdp 1)" in line


def test_check_model_refuses_what_is_not_measured():
    """Without a process group: a model with no expert parallelism, and the layouts hf_gradfix does not train yet."""
    from types import SimpleNamespace

    from hf_gradfix.parallel.ep import EPError, check_model, layout_of

    model = torch.nn.Linear(2, 2)
    assert layout_of(model) is None
    with pytest.raises(EPError, match="no expert parallelism"):
        check_model(model)
    dc = dict(ep_size=2, efsdp_size=1, fsdp_size=2, dp_replicate_size=1, tp_size=1, pp_size=1, ep_implementation="all_to_all")
    for change, needle in ((dict(pp_size=2), "pp_size=2"), (dict(ep_implementation="all_reduce"), "all_reduce"),
                           ({}, "no module")):
        model.config = SimpleNamespace(distributed_config=SimpleNamespace(**{**dc, **change}))
        with pytest.raises(EPError, match=needle):
            check_model(model)


def test_planner_per_rank_shards_equal_the_expert_parallel_split(ep_runs):
    """``hf-gradfix plan`` under ep=2 (dp_shard 2, efsdp 1) against the shards transformers made on the 2 gloo processes
    (``patched`` case, recorded at the first optimizer step): per rank, the elements of ``p.to_local()`` and of its
    gradient, routed experts and the rest apart, equal the planner's; FSDP2's padded shard sizes (the 97-row embedding
    and head are 49 + 48 rows, both stored as 49) equal its ``parameters``, and the gradients' storages (FSDP2's
    reduce-scatter outputs) its ``gradients``, to the byte. (Not compared: the parameters' storages. On CPU, loading an
    fp32 checkpoint into fp32 leaves each dense shard a view of the whole loaded tensor, which FSDP2 keeps where the
    shard is already its padded size: a loading artefact of same-device, same-dtype reads, not FSDP2's footprint.)
    The control: the dense-only estimate (the planner before ep: every parameter / dp_shard, unpadded) is not the
    measurement. (With tp = 1 an expert tensor has num_experts / dp_shard experts per rank either way; what the dense
    estimate misses here is the padding, and in the comm buffers the layer units, which gather only this rank's experts.)"""
    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, param_table

    config = H.build_moe("qwen3_moe").config
    params = param_table(config)
    assert [p.name for p in params if p.expert] == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                                      for w in ("gate_up_proj", "down_proj")]
    plan = estimate(config, ParallelDims(2, dp_shard=2, ep=2), Settings(dtype="fp32", seq_len=16), params=params)
    info, buffers = plan.extra["ep"], params.buffer_bytes
    measured = []
    for r in ep_runs["patched"]:
        got, mine = r["local_sizes"], info["per_rank"][r["rank"]]
        local = {"experts": mine["expert_local"], "dense": mine["dense_local"]}
        padded = {"experts": mine["expert_padded"], "dense": mine["dense_padded"]}
        assert got["param_numel"] == local and got["grad_numel"] == local, (r["rank"], got, mine)
        assert got["fsdp_padded_numel"] == padded, (r["rank"], got, mine)
        assert got["grad_storage_bytes"] == {k: 4 * v for k, v in padded.items()}, (r["rank"], got, mine)
        assert 4 * sum(got["fsdp_padded_numel"].values()) == plan.components["parameters"] - buffers
        assert sum(got["grad_storage_bytes"].values()) == plan.components["gradients"]
        measured.append((4 * sum(got["param_numel"].values()), sum(got["grad_storage_bytes"].values())))
    assert measured[0][0] != measured[1][0]  # rank 1 holds 48 rows of the embedding and of the head, rank 0 49
    dense_only = estimate(config, ParallelDims(2, dp_shard=2), Settings(dtype="fp32", seq_len=16), params=params)
    old_p, old_g = dense_only.components["parameters"] - buffers, dense_only.components["gradients"]
    assert all(old_p not in (local_b, grads_b) and old_g != grads_b for local_b, grads_b in measured), (old_p, measured)
