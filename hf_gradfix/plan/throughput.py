"""Expected training throughput per GPU for a layout: an analytic roofline model, used to rank ``--suggest``.

Pure arithmetic (no torch, no transformers).  Nothing here was measured on a GPU (none was available); the
model is what the Ultra-Scale Playbook and the Megatron papers reason with, written out so that every term can
be checked and re-fitted:

* compute: ``6 N`` FLOPs per token for the matmuls plus ``6 L h s`` for causal attention (``12 L h s`` halved
  by the mask), ``x 4/3`` with full recomputation; divided over ``tp x cp``; at ``peak x efficiency``, where the
  efficiency saturates with the GEMM row count (tokens per micro-batch per rank): ``0.55 x m / (m + 1024)``.
* tensor parallelism without sequence parallelism: 4 all-reduces of the layer activations per layer and step
  (2 forward, 2 backward; 6 with recomputation), ring cost ``2 (t-1)/t x bytes / bandwidth``, on the critical
  path.
* context parallelism: the ring passes each layer's K/V ``cp-1`` times forward and twice that backward,
  overlapped with attention compute (only the excess shows).
* FSDP2 (``dp_shard``): all-gather of the weights in forward and backward and a reduce-scatter of the grads per
  micro-batch, overlapped with compute (only the excess shows).
* data-parallel replicas (DDP / HSDP): one all-reduce of the grads per optimizer step, overlapped with the last
  micro-batch's backward (2/3 of its compute).
* pipeline parallelism (``pp`` stages, outermost in the mesh): each rank computes ``1 / pp`` of the layers; the
  accumulation window's micro-batches run through the schedule and the step stretches by ``1 / (1 - bubble)``
  (``bubble``: :func:`hf_gradfix.parallel.pipeline_schedule.bubble_fraction`); each micro-batch sends its layer output to
  the next stage and its gradient back (one hidden state each way per stage boundary, on the critical path).
* bandwidth: NVLink inside a node (``gpus_per_node``), the network across nodes; a group that spans nodes runs at
  the network's speed.

>>> spec = GPU_SPECS["h100"]
>>> t = layout_throughput(8.03e9, 32, 4096, 1024, seq_len=4096, micro_batch=1, grad_accum=8, dp_replicate=1,
...                       dp_shard=8, tp=1, cp=1, recompute=False, gpu=spec)
>>> 2_000 < t["tokens_per_s_per_gpu"] < 20_000 and t["mfu"] < 0.55
True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuSpec", "GPU_SPECS", "layout_throughput"]


@dataclass(frozen=True)
class GpuSpec:
    """Dense bf16 tensor-core peak (TFLOP/s, vendor sheet, no sparsity) and link bandwidths (GB/s, one
    direction): NVLink / Infinity Fabric inside a node, the network (per GPU) across nodes."""

    tflops: float
    intra_gbps: float
    inter_gbps: float
    gpus_per_node: int = 8


GPU_SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec(989, 450, 50), "h100-80gb": GpuSpec(989, 450, 50), "h100-94gb": GpuSpec(989, 450, 50),
    "h200": GpuSpec(989, 450, 50), "b200": GpuSpec(2250, 900, 50),
    "a100": GpuSpec(312, 300, 25), "a100-80gb": GpuSpec(312, 300, 25), "a100-40gb": GpuSpec(312, 300, 25),
    "l40s": GpuSpec(362, 32, 12.5), "l4": GpuSpec(121, 32, 12.5), "a10g": GpuSpec(125, 32, 12.5),
    "rtx4090": GpuSpec(165, 32, 12.5), "rtx3090": GpuSpec(71, 32, 12.5), "v100": GpuSpec(125, 150, 12.5),
    "v100-16gb": GpuSpec(125, 150, 12.5), "t4": GpuSpec(65, 16, 12.5),
    "mi300x": GpuSpec(1307, 448, 50), "mi250x": GpuSpec(383, 200, 25),
}


def _bandwidth(group: int, inner: int, gpu: GpuSpec) -> float:
    """Bytes/s of a collective over ``group`` ranks whose consecutive ranks are ``inner`` apart in the mesh."""
    return (gpu.intra_gbps if group * inner <= gpu.gpus_per_node else gpu.inter_gbps) * 1e9


def layout_throughput(n_params: float, n_layers: int, hidden: int, kv_hidden: int, *, seq_len: int, micro_batch: int,
                      grad_accum: int, dp_replicate: int, dp_shard: int, tp: int, cp: int, recompute: bool,
                      gpu: GpuSpec, bytes_per_elem: int = 2, optimizer_overhead: float = 1.0, pp: int = 1,
                      bubble: float = 0.0) -> dict:
    """Seconds per optimizer step and tokens/s per GPU for one layout (mesh order: pp, dp_replicate, dp_shard, cp,
    tp, with tp innermost as in ``ParallelDims``).  ``kv_hidden``: the K/V width (heads_kv x head_dim);
    ``bubble``: the pipeline schedule's idle share of the step (0 without pp)."""
    world = pp * dp_replicate * dp_shard * tp * cp
    tokens = micro_batch * seq_len  # per micro-batch of one data-parallel rank
    flops = (6 * n_params * tokens + 6 * n_layers * hidden * seq_len * tokens) / (tp * cp * pp)
    n_layers_all, n_params_all = n_layers, n_params
    n_layers, n_params = max(1, n_layers // pp), n_params / pp  # this rank's stage
    if recompute:
        flops *= 4 / 3
    rows = tokens / cp  # GEMM row count on a rank
    eff = 0.55 * rows / (rows + 1024)
    t_compute = flops / (gpu.tflops * 1e12 * eff)

    act_bytes = rows * hidden * bytes_per_elem
    t_tp = 0.0
    if tp > 1:
        per_layer = (6 if recompute else 4) * 2 * (tp - 1) / tp * act_bytes
        t_tp = n_layers * per_layer / _bandwidth(tp, 1, gpu)
    t_cp = 0.0
    if cp > 1:
        kv_bytes = 2 * rows * kv_hidden * bytes_per_elem
        ring = 3 * (cp - 1) * kv_bytes * n_layers / _bandwidth(cp, tp, gpu)
        attn_share = n_layers * hidden * seq_len / (n_params + n_layers * hidden * seq_len)  # of the FLOPs
        attn_compute = t_compute * attn_share
        t_cp = max(0.0, ring - attn_compute)
    t_fsdp = 0.0
    local = n_params / tp
    if dp_shard > 1:
        frac = (dp_shard - 1) / dp_shard
        comm = (2 * local * bytes_per_elem + local * 4) * frac / _bandwidth(dp_shard, tp * cp, gpu)
        t_fsdp = max(0.0, comm - t_compute)
    t_dp = 0.0
    if dp_replicate > 1:
        grad_bytes = local / dp_shard * 4
        comm = 2 * (dp_replicate - 1) / dp_replicate * grad_bytes / _bandwidth(dp_replicate, dp_shard * tp * cp, gpu)
        t_dp = max(0.0, comm - (2 / 3) * t_compute)
    t_pp = 0.0
    if pp > 1:  # a hidden state forward and its gradient back per micro-batch, across the stage boundary
        t_pp = 2 * act_bytes / _bandwidth(2, dp_replicate * dp_shard * tp * cp, gpu)
    step = ((grad_accum * (t_compute + t_tp + t_cp + t_fsdp + t_pp)) / (1 - bubble) + t_dp) * optimizer_overhead
    step_tokens = tokens * grad_accum * dp_replicate * dp_shard
    model_flops = 6 * n_params_all * step_tokens + 6 * n_layers_all * hidden * seq_len * step_tokens
    return {
        "seconds_per_step": step,
        "tokens_per_s_per_gpu": step_tokens / step / world,
        "mfu": model_flops / (step * world * gpu.tflops * 1e12),
        "exposed_comm_fraction": 1 - grad_accum * t_compute * optimizer_overhead / step,
        "bubble_fraction": bubble,
    }
