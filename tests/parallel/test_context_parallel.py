"""Context parallelism (cp) through the Trainer, exact against one process on the full sequences.

Two launches (gloo, CPU): 2 processes (``hf-gradfix launch --config_file configs/cpu_cp.yaml``) run the attention unit check (torch's own ``context_parallel`` with the CPU
SDPA kernel registered vs. one process on the full sequence, fp32 / fp64 / GQA, and the registration's absence
must raise torch's error) plus the cp 2 Trainer scenarios (exact, two negative controls, a refusal; a Qwen3-MoE
with the router loss ``micro`` against test_moe's float64 reference, and its per-shard-mean control); 4 processes
run dp_shard 2 x cp 2, cp 2 x tp 2 and dp_replicate 2 x cp 2. Ground truth: ``harness.ground_truth`` (plain
PyTorch, one process, each sample alone and unsplit, CE sum / total targets, one backward) over the union of the
data-parallel ranks' windows, as in ``test_nd_parallel.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

import cp_worker as CW
import harness as H
from multiproc import launch_cases
import nd_worker as W
import test_nd_parallel as ND

GRAD_TOL = 1e-5
LOSS_TOL = 1e-5
CPU_CP_CONFIG = H.REPO_ROOT / "configs" / "cpu_cp.yaml"
PACKED_TWO = ["packed_cp2", "packed_cp2_long_documents", "packed_cp2_control_mask_after_split",
              "packed_cp2_control_positions_local", "packed_cp2_control_positions_not_restarted"]
PACKED_FOUR = ["packed_shard2_cp2", "packed_cp2_tp2"]
MOE_TWO = ["moe_cp2", "moe_cp2_control_shard_mean"]
TWO = ["attention", "verify", "cp2", "cp2_control_shift_after_split", "cp2_control_no_position_ids", *PACKED_TWO,
       *MOE_TWO, "cp2_eager_refused", "cp2_data_differs_refused"]  # the guard last: it aborts a training run
RING_FOUR = ["shard2_cp2", "cp2_tp2", "rep2_cp2"]
FOUR = [*RING_FOUR, *PACKED_FOUR]


def _launch(n: int, scenarios: list[str]) -> dict:
    from hf_gradfix.integration.parallel import nd
    from hf_gradfix.parallel import ParallelDims

    try:
        nd.check_route(ParallelDims(2, dp_shard=1, cp=2))
    except nd.NDParallelError as err:
        pytest.skip(str(err))
    # n == 2: what users run, the shipped CPU CP file through the launcher (its section reaches every rank)
    runs, _ = launch_cases("cp_worker.py", scenarios, nproc=n, flag="--scenarios",
                           via_config=CPU_CP_CONFIG if n == 2 else None, keep_env="HGF_KEEP_ND_RUNS")
    return runs


@pytest.fixture(scope="module")
def two():
    return _launch(2, TWO)


@pytest.fixture(scope="module")
def four():
    return _launch(4, FOUR)


def _check_exact(ranks: list[dict], cp: int) -> list[dict]:
    r0 = ranks[0]
    assert r0["route"] == "transformers" and r0["dims"]["cp"] == cp
    assert r0["model_class"].startswith("FSDP") and r0["dtensor_params"] > 0  # FSDP2 over dp_shard x cp
    assert any("context parallel over" in f for f in r0["fixes"])
    rows = ND.compare(ranks)
    assert len(rows) >= 2
    for row in rows:
        assert row["rel_err"] <= GRAD_TOL, row
        assert row["loss_rel_err"] <= LOSS_TOL, row
        assert row["grad_norm_rel_err"] <= LOSS_TOL, row
    return rows


def _eval_truth(ranks: list[dict]) -> tuple[float, int]:
    model = W.build_model()
    model.load_state_dict(ranks[0]["initial_state"])
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in ranks[0]["samples"][: W.N_SAMPLES - 1]:
            loss_sum, n = H.sample_loss_sum(model, s, "causal")
            total, count = total + float(loss_sum), count + n
    return total / count, count


# ----------------------------------------------------------------------------------------------------------------
# The CPU ring-attention registration (unit, 2 processes)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_cpu_ring_attention_matches_full_sequence(two):
    for r in two["attention"]:
        assert max(r["fp32"]) <= 2e-6, r["fp32"]  # relative max error of out, dq, dk, dv
        assert max(r["fp32_gqa"]) <= 2e-6, r["fp32_gqa"]
        assert max(r["fp64"]) <= 1e-13, r["fp64"]
        # without the registration torch's own CP fails on CPU: the registration is what runs the ring
        assert "does not have a sharding strategy registered" in r["unregistered"], r["unregistered"]
        assert r["registered_after"] is False


def test_registration_is_idempotent_reversible_and_version_gated(monkeypatch):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from hf_gradfix.parallel import cpu_ring_attention as cra

    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    propagator = DTensor._op_dispatcher.sharding_propagator
    before = (propagator.op_strategy_funcs.get(forward), cp.custom_ops.get(forward))
    cra.register()
    cra.register()
    assert cra.registered() and forward in propagator.op_strategy_funcs and forward in cp.custom_ops
    cra.unregister()
    cra.unregister()
    assert (propagator.op_strategy_funcs.get(forward), cp.custom_ops.get(forward)) == before
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    monkeypatch.delenv("HF_GRADFIX_ALLOW_UNTESTED", raising=False)
    with pytest.raises(cra.UnsupportedTorchError, match="written for torch 2.13 / 2.14, not 2.99.0"):
        cra.register()
    assert not cra.registered()


# ----------------------------------------------------------------------------------------------------------------
# cp 2 through the Trainer (2 processes)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_cp2_matches_single_process_full_sequence(two):
    _check_exact(two["cp2"], cp=2)


@pytest.mark.distributed
def test_verify_under_cp(two):
    for r in two["verify"]:
        assert r["exact"] and len(r["errors"]) == 2 and max(r["errors"]) <= GRAD_TOL, r


@pytest.mark.distributed
def test_cp2_eval_loss_is_the_exact_token_mean(two):
    loss, count = _eval_truth(two["cp2"])
    for r in two["cp2"]:
        assert abs(r["eval_loss"] - loss) <= 1e-6 * loss, (r["eval_loss"], loss)
        assert r["eval_targets"] == count


@pytest.mark.distributed
@pytest.mark.parametrize("control", ["cp2_control_shift_after_split", "cp2_control_no_position_ids"])
def test_cp_controls_fail_the_check(two, control):
    """The same run with labels shifted after the split, or RoPE on local positions: far outside the tolerance."""
    rows = ND.compare(two[control])
    assert max(row["rel_err"] for row in rows) > 100 * GRAD_TOL, rows
    assert max(row["loss_rel_err"] for row in rows) > LOSS_TOL, rows


@pytest.mark.distributed
def test_cp_refuses_non_sdpa_attention_and_cp_ranks_with_different_batches(two):
    errors = {r["error"] for r in two["cp2_eager_refused"]}
    assert len(errors) == 1
    assert "attn_implementation='eager'" in errors.pop()
    guard = {r["error"] for r in two["cp2_data_differs_refused"]}
    assert len(guard) == 1 and "context-parallel ranks [0, 1] received different batches" in guard.pop()


# ----------------------------------------------------------------------------------------------------------------
# MoE router loss `micro` under cp 2 (issue 36): the micro-batch's load-balancing loss, counted over its shards
# ----------------------------------------------------------------------------------------------------------------


def _moe_compare(ranks: list[dict]) -> list[dict]:
    """Each optimizer step's full gradient on every cp rank and the logged loss vs test_moe's float64 reference on
    one process: the FULL (unsplit) padded micro-batches the step trained, CE token mean + coef * the mean over
    micro-batches of each micro-batch's Switch loss (padding rows dropped)."""
    import test_moe as TM

    r0 = ranks[0]
    model = H.build_moe("qwen3_moe")
    by_idx = {s["idx"]: s for s in r0["samples"]}
    collator = H.RecordingCollator("causal", H.pad_id_of(model))  # the worker's collator for a MoE model
    groups = {"router": lambda n: ".mlp.gate." in n, "experts": lambda n: ".mlp.experts." in n,
              "dense": lambda n: ".mlp.gate." not in n and ".mlp.experts." not in n}
    rows = []
    for k, step in enumerate(r0["steps"]):
        assert all(r["steps"][k]["idx_batches"] == step["idx_batches"] for r in ranks)  # cp ranks: the same batches
        mbs = [collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
        loss, grads = TM.reference(model, r0["initial_state"], mbs, "micro")
        row = dict(step=k, rel_err=max(H.rel_err(r["steps"][k]["grads"], grads) for r in ranks),
                   loss_rel_err=abs(r0["logged_losses"][k] - loss) / abs(loss),
                   lengths=[tuple(mb["attention_mask"].sum(1).tolist()) for mb in mbs])
        for g, keep in groups.items():
            ref = {n: v for n, v in grads.items() if keep(n)}
            row[g] = max(H.rel_err({n: r["steps"][k]["grads"][n] for n in ref}, ref) for r in ranks)
        rows.append(row)
    return rows


@pytest.mark.distributed
def test_moe_micro_under_cp_is_each_micro_batch_loss(two):
    """Qwen3-MoE (sdpa), cp 2, padded micro-batches of 2, GA 2: router, experts and dense gradients and the logged
    loss equal the reference on the full sequences; the padding (the batch's and the pad cp adds) is never counted."""
    ranks = two["moe_cp2"]
    assert ranks[0]["model_class"].startswith("FSDP") and ranks[0]["dims"]["cp"] == 2
    assert all(r["moe_cp"] == (True, False) for r in ranks), [r["moe_cp"] for r in ranks]  # checked, no fallback
    rows = _moe_compare(ranks)
    assert len(rows) >= 2
    lengths = [n for row in rows for mb in row["lengths"] for n in mb]
    assert any(n % 4 for n in lengths)  # cp pads the sequence (to a multiple of 2 x cp)
    assert any(len(set(mb)) > 1 for row in rows for mb in row["lengths"])  # padding inside micro-batches
    for row in rows:
        for key in ("rel_err", "router", "experts", "dense", "loss_rel_err"):
            assert row[key] <= GRAD_TOL, row


@pytest.mark.distributed
def test_moe_micro_under_cp_control_per_shard_mean_fails(two):
    """The router loss as before the fix (each cp rank's own aux_loss on its shard, pads counted, averaged): off."""
    rows = _moe_compare(two["moe_cp2_control_shard_mean"])
    assert max(row["router"] for row in rows) > 100 * GRAD_TOL, rows
    assert max(row["loss_rel_err"] for row in rows) > LOSS_TOL, rows


# ----------------------------------------------------------------------------------------------------------------
# cp with dp_shard, tp, dp_replicate (4 processes)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", RING_FOUR)
def test_cp_meshes_match_single_process_full_sequence(four, scenario):
    ranks = four[scenario]
    rows = _check_exact(ranks, cp=2)
    if ranks[0]["dims"]["dp_replicate"] * ranks[0]["dims"]["dp_shard"] > 1:
        for row in rows:
            counts = row["targets_per_data_rank"]
            assert len(counts) == 2 and counts[0] != counts[1], counts  # unequal targets per data rank


@pytest.mark.distributed
def test_cp_mesh_layout(four):
    shard_cp = four["shard2_cp2"]
    assert [r["coords"]["cp"] for r in shard_cp] == [0, 1, 0, 1]
    assert [r["data_rank"] for r in shard_cp] == [0, 0, 1, 1]  # cp ranks share batches
    cp_tp = four["cp2_tp2"]
    assert [(r["coords"]["cp"], r["coords"]["tp"]) for r in cp_tp] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["data_rank"] for r in cp_tp} == {0}


@pytest.mark.distributed
def test_cp_eval_with_data_parallel_ranks(four):
    loss, count = _eval_truth(four["shard2_cp2"])
    for r in four["shard2_cp2"]:
        assert abs(r["eval_loss"] - loss) <= 1e-6 * loss, (r["eval_loss"], loss)
        assert r["eval_targets"] == count


# ----------------------------------------------------------------------------------------------------------------
# Batch preparation and refusals without processes
# ----------------------------------------------------------------------------------------------------------------


def test_prepare_batch_shifts_before_the_split_and_pads():
    from hf_gradfix.parallel.context import prepare_batch

    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    labels = torch.tensor([[-100, 6, 7, 8, 9, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    out, buffers, dims = prepare_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, cp=2)
    assert "attention_mask" not in out and dims == [1, 1, 1, 1] and len(buffers) == 4
    assert out["input_ids"].shape == (1, 8)  # padded to a multiple of 2 x cp
    assert out["shift_labels"].tolist() == [[6, 7, 8, 9, -100, -100, -100, -100]]
    assert out["position_ids"].tolist() == [list(range(8))]
    assert ids.shape == (1, 6) and all(b is not ids and b is not labels for b in buffers)  # caller's tensors kept


@pytest.mark.parametrize(
    "batch,needle",
    [
        (dict(attention_mask=torch.tensor([[0, 1, 1, 1]])), "not right padding"),
        (dict(position_ids=torch.tensor([[0, 1, 0, 1]])), "packed rows"),
        (dict(token_type_ids=torch.zeros(1, 4, dtype=torch.long)), "'token_type_ids' has the sequence dim"),
        (dict(attention_mask=torch.ones(1, 1, 4, 4)), "4-D attention_mask"),
    ],
    ids=["left-padding", "packing", "unknown-seq-key", "4d-mask"],
)
def test_prepare_batch_refuses_what_cannot_be_exact(batch, needle):
    from hf_gradfix.parallel.context import ContextParallelError, prepare_batch

    base = {"input_ids": torch.arange(4)[None] + 4, "labels": torch.arange(4)[None] + 4}
    with pytest.raises(ContextParallelError, match=needle):
        prepare_batch({**base, **batch}, cp=2)


@pytest.mark.parametrize(
    "config_kw,needle",
    [
        (dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]), "sliding_attention"),
        (dict(), "attn_implementation='eager'"),
    ],
    ids=["sliding-window", "eager"],
)
def test_setup_refuses_cp_models_it_cannot_run_exactly(config_kw, needle):
    import transformers as tf

    from hf_gradfix.integration.parallel import nd

    attn = "eager" if not config_kw else "sdpa"
    torch.manual_seed(0)
    config = tf.LlamaConfig(**{**W.LLAMA, **config_kw})
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation=attn)
    with pytest.raises(nd.NDParallelError, match=needle):
        nd.setup(ND.fake_trainer(model, world=2), ND.section(dp_shard=1, cp=2))


def test_setup_refuses_cp_under_accelerate_fsdp_plugin():
    from hf_gradfix.integration.parallel import nd

    model = W.build_model(attn="sdpa")
    with pytest.raises(nd.NDParallelError, match="under accelerate's FSDP plugin"):
        nd.setup(ND.fake_trainer(model, world=2, fsdp_plugin=object()), ND.section(dp_shard=1, cp=2))


# ----------------------------------------------------------------------------------------------------------------
# Shipped configs, config check, launcher
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cpu_cp.yaml", "accelerate/fsdp2_tp_cp.yaml"])
def test_config_check_treats_cp_as_runnable(name, capsys):
    from hf_gradfix.cli import main

    assert main(["config", "check", str(H.REPO_ROOT / "configs" / name), "--micro-batch", "1", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "context parallel  cp=2: torch ring attention" in out and "multiple of 4" in out


def test_config_check_refuses_cp_under_accelerate_fsdp(tmp_path, capsys):
    import yaml

    from hf_gradfix.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2},
                                    "hf_gradfix": {"parallel": {"dp_shard": 1, "cp": 2}}}))
    assert main(["config", "check", str(path)]) == 2  # a diagnosed error: one line, exit code 2
    assert "cp=2 with accelerate's FSDP plugin" in capsys.readouterr().err


def test_launch_allows_accelerate_cp_without_its_fsdp_plugin(monkeypatch, tmp_path):
    """accelerate refuses parallelism_config cp > 1 without its FSDP plugin; the launcher lifts that (the plugin shards)."""
    import accelerate.commands.launch as accelerate_launch

    from hf_gradfix.cli import launch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")  # launch refuses a script that does not exist
    seen = {}
    monkeypatch.setenv("ACCELERATE_ALLOW_CP_STANDALONE", "false")  # restored (unset) after the test
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.update(
        allow=os.environ.get("ACCELERATE_ALLOW_CP_STANDALONE"), config=open(args.config_file).read()))
    assert launch(["--config_file", str(H.REPO_ROOT / "configs" / "accelerate" / "fsdp2_tp_cp.yaml"), "train.py"]) == 0
    assert seen["allow"] == "true" and "parallelism_config_cp_size: 2" in seen["config"]


def test_setup_refuses_cp_on_cpu_with_an_untested_torch(monkeypatch):
    from hf_gradfix.integration.parallel import nd

    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    monkeypatch.delenv("HF_GRADFIX_ALLOW_UNTESTED", raising=False)
    with pytest.raises(nd.NDParallelError, match="written for torch 2.13 / 2.14, not 2.99.0"):
        nd.setup(ND.fake_trainer(W.build_model(attn="sdpa"), world=2), ND.section(dp_shard=1, cp=2))


def test_cp_hook_refuses_compute_metrics_in_eval():
    from types import SimpleNamespace

    from hf_gradfix.integration.parallel import nd
    from hf_gradfix.parallel import ParallelDims

    model = W.build_model(attn="sdpa").eval()
    trainer = SimpleNamespace(model=model, compute_metrics=lambda p: {}, args=SimpleNamespace(prediction_loss_only=False),
                              _prepare_inputs=lambda x: x)
    plan = nd.NDPlan(dims=ParallelDims(2, dp_shard=1, cp=2), route="transformers", source="config")
    hook = nd._cp_inputs_hook(trainer, plan)
    with pytest.raises(nd.NDParallelError, match="compute_metrics under context parallelism"):
        hook(model, {"input_ids": torch.arange(4)[None] + 4, "labels": torch.arange(4)[None] + 4})


# ----------------------------------------------------------------------------------------------------------------
# CP x packing (issue 29): packed rows split over the cp ranks, document mask built on the full row
# ----------------------------------------------------------------------------------------------------------------


def _packed_compare(ranks: list[dict]) -> list[dict]:
    """Each optimizer step's full gradient on every rank vs. plain PyTorch on one process, every document of the
    step's packed rows alone and unsplit (the bins the plugin's own sampler drew, as the Trainer trained them)."""
    from hf_gradfix.packing.sampler import PackedBatchSampler

    dims = ranks[0]["dims"]
    samples = CW.packed_samples()
    sampler = PackedBatchSampler([len(s["input_ids"]) for s in samples], CW.PACKED_BUDGET, num_replicas=dims.dp,
                                 rank="all", seed=CW.PACKED_SEED)
    sampler.set_epoch(0)
    bins = list(sampler)
    model = W.build_model(attn="sdpa")
    model.load_state_dict(ranks[0]["init"])
    per_window = CW.PACKED_GA * dims.dp
    rows = []
    for k in range(len(ranks[0]["grads"])):
        window = [samples[i] for b in bins[k * per_window:(k + 1) * per_window] for i in b]
        gt_loss, gt = H.ground_truth(model, window, "causal")
        rows.append(dict(step=k, rel_err=max(H.rel_err(r["grads"][k], gt) for r in ranks),
                         loss_rel_err=abs(ranks[0]["logged"][k] - gt_loss) / gt_loss,
                         lengths=[len(s["input_ids"]) for s in window]))
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["packed_cp2", "packed_cp2_long_documents", *PACKED_FOUR])
def test_packed_cp_matches_each_document_alone(request, scenario):
    """Every document's gradient as if trained alone on one process: short documents (3-41 tokens, under a shard)
    and long ones (70-110 tokens, over a shard of a 128-token row), every one split head-tail over both cp ranks;
    under ``cp_balance: long_documents`` (threshold 32) only those over 32 tokens, the others dealt whole."""
    ranks = request.getfixturevalue("two" if scenario in PACKED_TWO else "four")[scenario]
    r0 = ranks[0]
    assert r0["model_class"].startswith("FSDP")
    assert "split over 2 context-parallel ranks" in r0["packing_line"] and "guard passed" in r0["packing_line"]
    assert ("dealt whole" in r0["packing_line"]) == scenario.endswith("long_documents"), r0["packing_line"]
    assert r0["packed_batches"] >= 3 and r0["attention_calls"] == 2 * r0["packed_batches"]  # 2 layers: the path ran
    rows = _packed_compare(ranks)
    assert len(rows) >= 2
    assert any(max(r["lengths"]) > CW.PACKED_BUDGET // 2 for r in rows)  # a document longer than a rank's shard
    for row in rows:
        assert row["rel_err"] <= GRAD_TOL, (scenario, row)
        assert row["loss_rel_err"] <= LOSS_TOL, (scenario, row)


@pytest.mark.distributed
def test_packed_cp_eval_loss_is_the_exact_token_mean(two):
    """Eval batches packed by transformers' DataCollatorWithFlattening go through the same packed CP path."""
    model = W.build_model(attn="sdpa")
    model.load_state_dict(two["packed_cp2"][0]["init"])
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in CW.packed_samples()[:11]:
            loss_sum, n = H.sample_loss_sum(model, s, "causal")
            total, count = total + float(loss_sum), count + n
    for r in two["packed_cp2"]:
        assert r["eval_packed_batches"] == 3
        assert abs(r["eval_loss"] - total / count) <= 1e-6 * (total / count), (r["eval_loss"], total / count)
        assert r["eval_targets"] == count


@pytest.mark.distributed
@pytest.mark.parametrize("control", ["packed_cp2_control_mask_after_split", "packed_cp2_control_positions_local"])
def test_packed_cp_controls_fail(two, control):
    """The mask built after the split (each rank's own attention over its shard, the model's mask from the local
    positions: measured 0.76-0.82 gradient error), or positions numbered per shard (9e-3): far outside."""
    rows = _packed_compare(two[control])
    assert min(row["rel_err"] for row in rows) > 100 * GRAD_TOL, rows


@pytest.mark.distributed
def test_packed_cp_positions_not_restarted_is_harmless_on_rope(two):
    """Positions 0..L-1 over the whole row instead of restarting per document: on a RoPE model attention sees only
    relative positions inside a document, so this is exact (measured 2e-7); absolute position tables would not be."""
    for row in _packed_compare(two["packed_cp2_control_positions_not_restarted"]):
        assert row["rel_err"] <= GRAD_TOL, row


def test_packed_layout_attention_equals_the_document_mask():
    """One process holding every rank's slice: the permuted row under the rewritten mask gives each token the same
    output as full-row attention under the document-causal mask (the decomposition the cp ranks run)."""
    import torch.nn.functional as F

    from hf_gradfix.parallel.context_packing import PackedLayout, packed_attention_block

    lengths = [5, 13, 2, 9]
    batch = {"input_ids": torch.arange(sum(lengths))[None] + 4,
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    layout = PackedLayout.build(batch, cp=2)
    assert all(n % 4 == 0 for n in layout.doc_lengths[0]) and layout.length % 4 == 0
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.length, 8, dtype=torch.float64) for _ in range(3))
    dense = (layout.doc[:, None, :, None] == layout.doc[:, None, None, :]) & torch.ones(
        layout.length, layout.length, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    perm = layout.indices[0]
    with packed_attention_block(layout.full_mask(), None) as _:
        got = F.scaled_dot_product_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], is_causal=True)
    assert torch.allclose(got, want[:, :, perm], atol=1e-12)
    # control: the mask built after the split, on the shards' own order (document-causal as if the permuted row were
    # the original): far off
    doc_perm = layout.doc[:, perm]
    after = (doc_perm[:, None, :, None] == doc_perm[:, None, None, :]) & torch.ones(
        layout.length, layout.length, dtype=torch.bool).tril()
    wrong = F.scaled_dot_product_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], attn_mask=after)
    assert (wrong - want[:, :, perm]).abs().max() > 0.1
    rank0 = set(layout.local_positions(0)[0].tolist())
    for start, n in zip([0, 8, 24, 28], layout.doc_lengths[0]):  # every document has tokens on both ranks
        assert 0 < len(rank0 & set(range(start, start + n))) < n


def test_packed_layout_rows_mode_batches():
    """The collator's ``rows`` mode (several rows, each tail its own segment): rows padded to one length, each row
    balanced by its own documents, the mask per row."""
    import torch.nn.functional as F

    from hf_gradfix.packing.collator import PackedCollator
    from hf_gradfix.parallel.context_packing import PackedLayout, packed_attention_block

    batch = PackedCollator("rows", max_tokens=24)([[{"input_ids": list(range(4, 11))}, {"input_ids": [5, 6, 7]}],
                                                   [{"input_ids": list(range(4, 21))}]])
    layout = PackedLayout.build(batch, cp=2)
    assert layout.indices.shape == (2, layout.length) and len(layout.doc_lengths) == 2
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, layout.length, 8, dtype=torch.float64) for _ in range(3))
    dense = (layout.doc[:, None, :, None] == layout.doc[:, None, None, :]) & torch.ones(
        layout.length, layout.length, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    idx = layout.indices[:, None, :, None].expand(-1, 2, -1, 8)
    with packed_attention_block(layout.full_mask(), None):
        got = F.scaled_dot_product_attention(*(torch.gather(t, 2, idx) for t in (q, k, v)), is_causal=True)
    assert torch.allclose(got, torch.gather(want, 2, idx), atol=1e-12)


def test_packed_layout_shifts_labels_on_the_full_row_and_never_across_documents():
    from hf_gradfix.parallel.context_packing import PackedLayout

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[5, 6, 7, 8, 9]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    layout = PackedLayout.build(batch, cp=2)
    # documents padded to 4: [5 6 7 pad | 8 9 pad pad]; the target 8 after 7 crosses a boundary: dropped
    assert layout.padded["shift_labels"].tolist() == [[6, 7, -100, -100, 9, -100, -100, -100]]
    assert layout.padded["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert layout.real.tolist() == [[1, 1, 1, 0, 1, 1, 0, 0]]  # what the MoE router loss counts (no pad)
    assert torch.equal(torch.cat([layout.shard_real(0), layout.shard_real(1)], 1),
                       torch.gather(layout.real, 1, layout.indices))
    assert torch.equal(torch.cat([layout.shard("input_ids", 0), layout.shard("input_ids", 1)], 1),
                       layout.permuted("input_ids"))


def test_torch_per_document_balancer_order_is_regrouped_by_rank():
    """torch 2.13's _PerDocumentHeadTailLoadBalancer lists chunks document by document, so a contiguous split hands
    whole documents to one rank; hf_gradfix regroups them so every rank gets a head and a tail of every document."""
    from hf_gradfix.parallel.context_packing import masked_pairs_per_rank

    lengths = [64, 8, 8, 8, 8, 8, 8, 16]
    torch_order = masked_pairs_per_rank(lengths, 2, "per_document_torch_order")
    regrouped = masked_pairs_per_rank(lengths, 2, "per_document")
    assert max(torch_order) / min(torch_order) > 3 and max(regrouped) == min(regrouped)


def test_cp_packing_guard_refuses_attention_that_cannot_take_the_mask():
    import transformers as tf

    from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_under_cp

    torch.manual_seed(0)
    eager = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**W.LLAMA), attn_implementation="eager")
    with pytest.raises(PackingCheckError, match="never calls torch.nn.functional.scaled_dot_product_attention"):
        check_model_packs_under_cp(eager, cp=2)
    sdpa = W.build_model(attn="sdpa")
    report = check_model_packs_under_cp(sdpa, cp=2)
    assert report.passed and report.details["attention_calls"] == 2 and report.max_diff < 1e-5


def test_context_packing_doctests():
    import doctest

    from hf_gradfix.parallel import context_packing

    result = doctest.testmod(context_packing, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
