"""The planner's accounting of GaLore low-rank gradient accumulation and 8-bit state (issue 17, item 3).

Ground truth: the gradient storage a real run holds after backward (``.grad`` tensors plus the optimizer's rank-r
accumulators), measured on a tiny Llama; the LLaMA-7B verdict of the issue, with the accumulator bytes recomputed here
from the shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_gradfix.parallel import ParallelDims
from hf_gradfix.plan import PlanError, Settings, estimate, load_model_config

GiB = 1024**3
SEVEN_B = dict(seq_len=256, micro_batch=1, grad_accum=4, dtype="bf16-pure", optimizer="galore_adamw8bit", rank=1024,
               recompute="full")


def test_llama7b_fits_24gib_with_lowrank_grads_and_not_without():
    cfg = load_model_config("llama-7b")
    full = estimate(cfg, ParallelDims(1), Settings(**SEVEN_B), gpu_memory=24 * GiB)
    low = estimate(cfg, ParallelDims(1), Settings(**SEVEN_B, lowrank_grads=True), gpu_memory=24 * GiB)
    assert not full.fits and low.fits
    # accumulators recomputed from the shapes: (out-features x rank) per projected matrix ('auto' side), bf16
    h, f, L = 4096, 11008, 32
    acc = L * (4 * h + 2 * f + h) * 1024 * 2  # q k v o (out h), gate up (out f), down (out h)
    unprojected = 2 * 32000 * h * 2 + (2 * L + 1) * h * 2  # embeddings, head, norms
    refreshing = 2 * f * h * 2  # ceil(224 / 200) = 2 matrices of the largest shape
    assert low.components["gradients"] == pytest.approx(acc + unprojected + refreshing, rel=1e-9)
    assert full.components["gradients"] - low.components["gradients"] > 9 * GiB
    print(f"\nLLaMA-7B, 8-bit GaLore r=1024, GA 4: peak {full.peak / GiB:.2f} GiB with full gradients, "
          f"{low.peak / GiB:.2f} GiB with lowrank_grads (24 GiB GPU: {24 - low.peak / GiB:.2f} GiB left)")


def test_lowrank_grads_refused_where_it_cannot_run():
    cfg = load_model_config("tiny-llama")
    with pytest.raises(PlanError, match="--lowrank-grads.*GaLore"):
        estimate(cfg, ParallelDims(1), Settings(optimizer="apollo_adamw", lowrank_grads=True, seq_len=16))
    with pytest.raises(PlanError, match="not with ZeRO-2/3 / FSDP2"):
        estimate(cfg, ParallelDims(2, dp_shard=2), Settings(optimizer="galore_adamw", lowrank_grads=True, seq_len=16))


def test_lowrank_gradient_bytes_match_a_measured_run():
    """After the backward of a window that is not the first: .grad bytes + accumulator bytes, measured, are at most
    the planner's gradients component, and above it by less than the one refreshing matrix it assumes."""
    from transformers import AutoModelForCausalLM

    from hf_gradfix.optim import GaLoreAdamW

    cfg = load_model_config("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gap = 200
    opt = GaLoreAdamW(model, lr=1e-3, rank=16, proj_method="svd", update_proj_gap=gap, lowrank_grads=True)
    measured = []
    for step in range(3):
        for _ in range(2):
            ids = torch.randint(0, cfg.vocab_size, (2, 16))
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        held = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        held += sum(a.numel() * a.element_size() for a in opt._lowrank_acc.values())
        measured.append(held)
        opt.step()
        opt.zero_grad()
    plan = estimate(cfg, ParallelDims(1), Settings(dtype="fp32", seq_len=16, micro_batch=2, grad_accum=2,
                                                  optimizer="galore_adamw", rank=16, lowrank_grads=True,
                                                  update_proj_gap=gap))
    full = estimate(cfg, ParallelDims(1), Settings(dtype="fp32", seq_len=16, micro_batch=2, grad_accum=2,
                                                   optimizer="galore_adamw", rank=16))
    assert measured[0] == full.components["gradients"]  # the first step: every gradient (initial_basis accumulated)
    largest = max(p.numel() * 4 for p in opt._plans)
    for held in measured[1:]:
        assert held <= plan.components["gradients"] < held + largest + 1, (held, plan.components["gradients"])
    assert plan.components["gradients"] < 0.6 * full.components["gradients"]


def test_suggest_offers_lowrank_grads_for_llama7b_on_24gib():
    from hf_gradfix.plan.command import suggest

    cfg = load_model_config("llama-7b")
    rows = suggest(cfg, 1, 24 * GiB, Settings(**SEVEN_B), gpu="rtx4090")
    assert rows and all(r["lowrank_grads"] and r["optimizer"] == "galore_adamw8bit" for r in rows)
    assert all(r["peak_gib"] <= 24 for r in rows)
