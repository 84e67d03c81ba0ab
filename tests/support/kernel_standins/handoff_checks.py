"""Hybrid packing with the varlen kernels installed (stand-ins of causal-conv1d, fla and mamba-ssm, see README.md): hf_gradfix hands the document
boundaries to the kernels (one mixer call per layer) where the probe measures that they keep the documents apart, and
splits where they do not. Run by ``tests/packing/test_packing_hybrid_kernels.py`` in its own process, with this folder first on
``PYTHONPATH`` (transformers binds the kernels when it imports a modeling module).

Ground truth: each document alone through the same model (``harness.ground_truth``: CE summed, divided by the
targets), which runs the same stand-in kernels on one document at a time.
"""

from __future__ import annotations

import causal_conv1d
import pytest
import torch
import transformers
from fla.ops import gated_delta_rule
from mamba_ssm.ops.triton import ssd_combined

import harness as H
import hf_gradfix
from hf_gradfix.packing import state_reset
from hf_gradfix.packing.collator import PackedCollator
from test_exactness import GRAD_TOL
from test_packing_hybrid import _has, build, packed_row_error, row_grad_error
from test_packing_trainer import BUDGET, _train, _windows

FAMILIES = ["lfm2", "qwen3_5", "bamba"]
families = pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.skipif(
    not _has(f), reason=f"this transformers has no {f}")) for f in FAMILIES])


def _kernels_called(model) -> bool:
    """Whether this transformers' model calls the installed (stand-in) kernels on this device: measured, one forward."""
    before = causal_conv1d.CALLS["causal_conv1d_fn"]
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=False)
    return causal_conv1d.CALLS["causal_conv1d_fn"] > before


def _built(family):
    model = build(family)
    if not _kernels_called(model):
        pytest.skip(f"transformers {transformers.__version__}'s {family} does not call causal-conv1d on a CPU")
    return model


def _probe_mixers(model):
    mixers = state_reset.probe_sequence_mixers(model)
    assert mixers, "the probe finds the layers that carry state"
    return mixers


@families
@pytest.mark.parametrize("mode", ["varlen", "rows"])
def test_trainer_hands_the_boundaries_to_the_kernels_exactly(family, mode):
    model = _built(family)
    samples = H.make_samples("causal", n=10, seed=0, lo=3, hi=30, prompt_mask_frac=0.3)
    with_seq_idx = causal_conv1d.CALLS["with_seq_idx"]
    scans = ssd_combined.CALLS["with_seq_idx"]
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": mode}})
    try:
        trainer, grads = _train(model, samples, ga=2)
    finally:
        hf_gradfix.unpatch()
    line = " ".join(hf_gradfix.state_of(trainer).fixes)
    assert "documents kept apart by the kernels (seq_idx / cu_seq_lens) in" in line, line
    assert "documents run one by one" not in line, line
    split = model._hf_gradfix_document_split
    assert split.handoff_calls > 0 and split.calls == 0, (split.handoff_calls, split.calls)
    assert causal_conv1d.CALLS["with_seq_idx"] > with_seq_idx
    if family == "bamba":  # training runs mamba-ssm's fused split-conv1d-scan, with seq_idx
        assert ssd_combined.CALLS["with_seq_idx"] > scans
    windows = _windows(samples, 2)
    assert len(windows) == len(grads) >= 2 and any(len(b) > 1 for w in windows for b in w)
    for k, (window, g) in enumerate(zip(windows, grads)):
        _, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"{family} {mode} step {k}: {H.rel_err(g, gt):.3e}"
    split.restore()


def _rows_error(model, bins) -> float:
    """Several packed rows in one batch (``rows`` mode, padded): relative gradient error vs each document alone."""
    _, gt = H.ground_truth(model, [s for b in bins for s in b], "causal")
    batch = PackedCollator(mode="rows", pad_token_id=H.PAD_ID)(
        [[{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in b] for b in bins])
    return row_grad_error(model, gt, {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]},
                          batch["labels"])


@families
def test_several_rows_are_flattened_into_one_for_the_kernels(family):
    """fla's ``cu_seqlens`` takes one row: a batch of two padded packed rows goes to the kernels as one row and back."""
    model = _built(family)
    samples = H.make_samples("causal", n=5, seed=2, lo=4, hi=14)
    mixers = _probe_mixers(model)
    assert all(m.handoff for m in mixers), [(m.label, m.handoff) for m in mixers]
    split = state_reset.split_documents(model, mixers)
    calls = gated_delta_rule.CALLS["with_cu_seqlens"]
    err = _rows_error(model, [samples[:3], samples[3:]])
    assert err <= GRAD_TOL, err
    assert split.handoff_calls > 0 and split.calls == 0
    if family == "qwen3_5":  # Gated DeltaNet reads cu_seq_lens_q as fla's cu_seqlens
        assert gated_delta_rule.CALLS["with_cu_seqlens"] > calls
    split.restore()


@families
def test_stock_with_the_kernels_is_exact_only_with_seq_idx(family):
    """transformers alone, the kernels installed, a row packed by DataCollatorWithFlattening: with its defaults, and
    with ``return_flash_attn_kwargs=True`` alone, nothing hands the convolution a ``seq_idx`` and the window crosses
    the boundary; with ``return_seq_idx=True`` as well the kernels keep the documents apart (what docs/packing.md
    says about stock)."""
    model = _built(family)
    samples = H.make_samples("causal", n=4, seed=1, lo=6, hi=20)
    assert packed_row_error(model, samples) > GRAD_TOL
    assert packed_row_error(model, samples, return_flash_attn_kwargs=True) > GRAD_TOL
    assert packed_row_error(model, samples, return_flash_attn_kwargs=True, return_seq_idx=True) <= GRAD_TOL


@families
@pytest.mark.parametrize("misbehaviour", ["HF_GRADFIX_STANDIN_IGNORE_SEQ_IDX", "HF_GRADFIX_STANDIN_MISREAD_SEQ_IDX"])
def test_control_a_kernel_that_ignores_or_misreads_seq_idx_is_split_not_handed_off(family, misbehaviour, monkeypatch):
    """The convolution takes ``seq_idx`` and ignores it (the probe measures the leak), or reads it as a padding mask
    (no document reaches another, so the structural check passes, but the values are not each document's alone: the
    probe's value check): either way the probe splits it (still exact), and the same kernel handed the boundaries
    anyway (the probe's verdict overridden) fails the tolerance."""
    monkeypatch.setenv(misbehaviour, "1")
    model = _built(family)
    samples = H.make_samples("causal", n=5, seed=2, lo=4, hi=14)
    mixers = _probe_mixers(model)
    assert not any(m.handoff for m in mixers)
    split = state_reset.split_documents(model, mixers)
    assert _rows_error(model, [samples[:3], samples[3:]]) <= GRAD_TOL and split.calls > 0
    split.restore()
    for m in mixers:
        m.handoff = True
    forced = state_reset.split_documents(model, mixers)
    err = _rows_error(model, [samples[:3], samples[3:]])
    assert forced.handoff_calls > 0 and err > GRAD_TOL, err
    forced.restore()


def test_an_attention_handed_off_on_one_row_runs_per_document_with_several_masked_rows():
    """Inkling2's sliding-window attention reads ``seq_idx`` itself and is handed off on the probe's one row; with
    several padded rows it receives a ``[rows, 1, T, T]`` mask, which cannot be flattened: those calls run once per
    document (no error), the convolutions stay handed off, and the rows are exact."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hybrid_packing_table",
                                                  H.REPO_ROOT / "benchmarks" / "hybrid_packing_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    try:
        model = table.build("inkling2_text").float()
    except Exception as e:  # noqa: BLE001 - a transformers without the family
        pytest.skip(f"transformers {transformers.__version__} cannot build inkling2_text: {e}")
    mixers = _probe_mixers(model)
    assert all(m.handoff for m in mixers), [(m.label, m.handoff) for m in mixers]
    split = state_reset.split_documents(model, mixers)
    samples = H.make_samples("causal", n=5, seed=2, lo=4, hi=14, vocab=int(model.config.vocab_size))
    err = _rows_error(model, [samples[:3], samples[3:]])
    assert err <= GRAD_TOL, err
    # every kind was handed off on one row, so a per-document call can only be the mask's fallback
    assert split.calls > 0 and split.handoff_calls > 0, (split.calls, split.handoff_calls)
    split.restore()
