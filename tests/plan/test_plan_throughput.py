"""The --suggest throughput model: pure arithmetic, checked against the properties it must have and against
hand-computed roofline numbers (not against GPU measurements: none were available)."""

import pytest

from hf_gradfix.plan.throughput import GPU_SPECS, GpuSpec, layout_throughput

N8B = dict(n_params=8.03e9, n_layers=32, hidden=4096, kv_hidden=1024)


def _t(**kw):
    args = dict(seq_len=4096, micro_batch=1, grad_accum=8, dp_replicate=1, dp_shard=1, tp=1, cp=1, recompute=False,
                gpu=GPU_SPECS["h100"])
    args.update(kw)
    return layout_throughput(**N8B, **args)


def test_single_gpu_is_the_roofline():
    """One GPU, no communication: tokens/s = peak x efficiency / FLOPs per token, computed by hand here."""
    spec = GpuSpec(tflops=1000, intra_gbps=1, inter_gbps=1)
    t = _t(gpu=spec)
    flops_per_token = 6 * 8.03e9 + 6 * 32 * 4096 * 4096
    eff = 0.55 * 4096 / (4096 + 1024)
    assert t["tokens_per_s_per_gpu"] == pytest.approx(1000e12 * eff / flops_per_token, rel=1e-9)
    assert t["exposed_comm_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert t["mfu"] == pytest.approx(eff, rel=1e-9)


def test_recompute_costs_a_third_more_compute():
    assert _t(recompute=True)["seconds_per_step"] == pytest.approx(4 / 3 * _t()["seconds_per_step"], rel=1e-9)


def test_tensor_parallel_pays_its_all_reduces_and_more_across_nodes():
    inside = _t(tp=8, micro_batch=8)
    assert inside["exposed_comm_fraction"] > 0.05
    slow_link = _t(tp=8, micro_batch=8, gpu=GpuSpec(989, 450, 50, gpus_per_node=4))  # tp group spans 2 nodes
    assert slow_link["tokens_per_s_per_gpu"] < 0.5 * inside["tokens_per_s_per_gpu"]


def test_fsdp_overlaps_until_the_network_is_too_slow():
    assert _t(dp_shard=8)["exposed_comm_fraction"] == pytest.approx(0.0, abs=1e-12)
    slow = _t(dp_shard=8, gpu=GpuSpec(989, 1, 1))
    assert slow["exposed_comm_fraction"] > 0.5


def test_replicas_scale_throughput_per_gpu_unchanged_when_overlapped():
    assert _t(dp_replicate=4)["tokens_per_s_per_gpu"] == pytest.approx(_t()["tokens_per_s_per_gpu"], rel=1e-9)


def test_small_micro_batches_lose_gemm_efficiency():
    assert _t(seq_len=512)["mfu"] < _t(seq_len=4096)["mfu"]
