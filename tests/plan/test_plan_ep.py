"""hf-gradfix plan under expert parallelism (``--ep`` / ``parallel.ep``): which parameters are routed experts, the
per-rank split and FSDP2's padding by hand, the command line and its refusals (config check's lines).

The check against a real split (transformers' DistributedConfig(fsdp_size=2, ep_size=2) on 2 gloo processes) is in
tests/parallel/test_ep.py (``test_planner_per_rank_shards_equal_the_expert_parallel_split``): it needs the 2-process launch.
"""

import json

import pytest

import harness as H
from hf_gradfix.parallel import ParallelDims
from hf_gradfix.parallel.ep import EPError, check_combination
from hf_gradfix.plan import Settings, estimate, param_table
from hf_gradfix.plan.command import plan_main


@pytest.fixture(scope="module")
def moe_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("planep") / "qwen3_moe.json"
    H.build_moe("qwen3_moe").config.to_json_file(str(path))
    return str(path)


def test_routed_experts_from_the_ep_plan_shared_and_dense_layers_stay_dense():
    """DeepSeek-V3: the first layer dense (first_k_dense_replace), a shared expert per MoE layer, the router: only
    the routed experts' grouped tensors are expert parameters. Mixtral (num_local_experts) the same way."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, tie_word_embeddings=False)
    rows = param_table(cfg)
    assert [p.name for p in rows if p.expert] == [f"model.layers.{i}.mlp.experts.{w}" for i in (1, 2)
                                                   for w in ("gate_up_proj", "down_proj")]
    assert all(p.shape[0] == 8 for p in rows if p.expert)
    assert any("shared_experts" in p.name for p in rows if not p.expert)
    mixtral = param_table(H.build_moe("mixtral").config)
    assert sum(p.expert for p in mixtral) == 4 and all(p.shape[0] == 4 for p in mixtral if p.expert)


def test_four_ranks_ep2_efsdp2_by_hand():
    """dp_shard 4, ep 2: rank r holds experts of ep rank r % 2 (3 of the 6), FSDP2 cuts them over efsdp 2 into 2 + 1
    (rank r // 2 of the pair), both stored as 2; dense rows over 4: the 97-row embedding as 25, 25, 25, 22."""
    cfg = H.build_moe("qwen3_moe").config
    rows = param_table(cfg)
    plan = estimate(cfg, ParallelDims(4, dp_shard=4, ep=2), Settings(dtype="fp32", seq_len=16), params=rows)
    ep = plan.extra["ep"]
    assert (ep["ep"], ep["efsdp"], ep["fsdp"], ep["num_experts"], ep["top_k"]) == (2, 2, 4, 6, 2)
    per_expert_layer = 32 * 32 + 32 * 16  # gate_up (2 x 16, 32) + down (32, 16) of one expert
    for r, experts in enumerate((2, 2, 1, 1)):
        assert plan.extra["ep"]["per_rank"][r]["expert_local"] == 2 * experts * per_expert_layer
    assert ep["expert_padded"] == 2 * 2 * per_expert_layer
    emb = {r: plan.extra["ep"]["per_rank"][r]["dense_local"] for r in range(4)}
    # the embedding and the head (25 vs 22 rows), the routers of both layers (6 rows: 2, 2, 2, 0)
    assert emb[0] - emb[3] == 2 * (25 - 22) * 32 + 2 * 2 * 32
    assert plan.components["parameters"] == 4 * (ep["expert_padded"] + ep["dense_padded"]) + rows.buffer_bytes
    # all-to-all: dispatch + combine of one MoE layer, 16 tokens x top-2 x hidden 32, fp32
    assert ep["all_to_all_bytes"] == 2 * 16 * 2 * 32 * 4


def test_plan_ep_on_the_command_line(moe_json, capsys):
    assert plan_main(["--model", moe_json, "--num-gpus", "2", "--ep", "2", "--seq-len", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    assert out["mesh"]["ep"] == 2 and out["mesh"]["efsdp"] == 1
    ep = out["extra"]["ep"]
    assert (ep["expert_padded"], ep["dense_padded"]) == (9216, 6512)  # 3 whole experts x 2 layers; dense / 2, padded
    # bf16 (the default): 2 B weights on the padded shards + the 64 B rotary buffer, fp32 master 4 B
    assert out["components"]["parameters"] == 2 * (9216 + 6512) + 64
    assert out["components"]["master_weights"] == 4 * (9216 + 6512)


def test_parallel_ep_from_the_config_and_keep_one_of_them(moe_json, capsys):
    assert plan_main(["--model", moe_json, "--config", str(H.REPO_ROOT / "configs/cpu_ep.yaml"), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "ep=2 (efsdp=1)" in out and "EP all-to-all" in out and "6/2 whole experts per rank" in out
    cfg = str(H.REPO_ROOT / "configs/cpu_ep.yaml")
    assert plan_main(["--model", moe_json, "--config", cfg, "--ep", "1", "--seq-len", "16"]) == 2
    assert f"--ep 1: {cfg} sets parallel.ep=2; keep one of them" in capsys.readouterr().err


@pytest.mark.parametrize("argv,expected", [
    (["--num-gpus", "4", "--pp", "2"], dict(ep=2, pp=2)),
    (["--num-gpus", "2", "--optimizer", "galore_adamw"], dict(ep=2, optimizer="galore_adamw", optimizer_key="--optimizer")),
    (["--num-gpus", "2", "--packing"], dict(ep=2, packing=True)),
], ids=["pp", "galore", "packing"])
def test_refusals_say_config_checks_line(moe_json, capsys, argv, expected):
    with pytest.raises(EPError) as err:
        check_combination(**expected)
    assert plan_main(["--model", moe_json, "--ep", "2", "--seq-len", "16", *argv]) == 2
    assert str(err.value) in capsys.readouterr().err


def test_bad_ep_values_are_one_line(moe_json, capsys):
    assert plan_main(["--model", "tiny-llama", "--num-gpus", "2", "--ep", "2"]) == 2
    assert "parallel.ep=2: the model (LlamaConfig) has no routed experts" in capsys.readouterr().err
    assert plan_main(["--model", moe_json, "--num-gpus", "2", "--ep", "4"]) == 2
    assert "parallel.ep=4 does not divide dp_shard x cp x tp = 2" in capsys.readouterr().err
    assert plan_main(["--model", moe_json, "--num-gpus", "2", "--ep", "0"]) == 2
    assert "--ep 0: invalid value" in capsys.readouterr().err
    assert plan_main(["--model", moe_json, "--num-gpus", "2", "--ep", "2", "--deepspeed"]) == 2
    assert "--ep 2 with --deepspeed" in capsys.readouterr().err
