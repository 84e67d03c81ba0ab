"""Packing hybrid and state-space models (issue 37): the layers that carry a recurrent state or a convolution window
along the sequence run once per document, so a packed row trains exactly what each document alone trains.

Three families transformers 5.x ships, tiny and random-init (fp32, torch fallbacks: what runs on a CPU): LFM2 (a short
convolution), Qwen3.5 (Gated DeltaNet: a convolution and a recurrent state), Bamba (a Mamba-2 mixer). For each:

* the Trainer with hf_gradfix's packing: every optimizer window's gradient and logged loss vs the unpacked float64-free
  ground truth (each sample alone, CE summed, divided by the window's targets: ``harness.ground_truth``);
* stock beside it: one row of the same documents packed by transformers' ``DataCollatorWithFlattening`` (restarted
  ``position_ids``, no mask) through the unchanged model: its gradient error (or the error it raises);
* the controls that must fail: the split undone (the state and the window carried over: stock's leak), and the split
  at wrong boundaries (two documents run as one: the state not reset at that boundary).

The per-family table over every hybrid family (guard verdicts, kernels) is ``benchmarks/hybrid_packing_table.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import harness as H
import hf_gradfix
from hf_gradfix.packing import state_reset
from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_correctly
from test_packing_trainer import BUDGET, _train, _windows

from test_exactness import GRAD_TOL, LOSS_TOL  # noqa: E402  (1e-5; the logged loss: 4.57 rounds it to 4 digits)
FAMILIES = ["lfm2", "qwen3_5", "bamba"]


def build(family: str):
    common = dict(vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=H.PAD_ID, tie_word_embeddings=False)
    if family == "lfm2":
        cfg = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common, head_dim=8, layer_types=["linear_attention", "full_attention"],
                                             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                             linear_value_head_dim=8)
    elif family == "bamba":
        cfg = transformers.BambaConfig(**common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                       mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
    else:
        raise KeyError(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def _has(family: str) -> bool:
    return hasattr(transformers, {"lfm2": "Lfm2Config", "qwen3_5": "Qwen3_5TextConfig", "bamba": "BambaConfig"}[family])


families = pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.skipif(
    not _has(f), reason=f"this transformers has no {f}")) for f in FAMILIES])


def row_grad_error(model, gt: dict, inputs: dict, labels: torch.Tensor) -> float:
    """Packed rows (``inputs``, ``labels`` [rows, T] with -100 at every document's first token and on padding) through
    ``model``: the relative gradient error of their token-mean loss (shifted within each row) against ``gt``."""
    model.zero_grad(set_to_none=True)
    model.train()
    # use_cache=False, as hf_gradfix's packing sets it (a cache holds the state across the row by design)
    logits = model(**inputs, use_cache=False).logits.float()
    shifted = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), ignore_index=-100,
                                             reduction="sum")
    (loss / (shifted != -100).sum()).backward()
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return H.rel_err(got, gt)


def packed_row_error(model, samples, **collator_kw) -> float:
    """One row of ``samples`` packed by transformers' DataCollatorWithFlattening (``collator_kw``: e.g.
    ``return_seq_idx=True``; every key it returns goes to the model) through ``model`` as it is: the relative gradient
    error of its token-mean loss against each sample alone (the ground truth); inf where the model refuses packed
    input."""
    _, gt = H.ground_truth(model, samples, "causal")
    batch = transformers.DataCollatorWithFlattening(**collator_kw)(
        [{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in samples])
    try:
        return row_grad_error(model, gt, {k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
    except ValueError:  # transformers' own refusal of packed input on this path (Qwen3.5 without fla)
        model.zero_grad(set_to_none=True)
        return float("inf")


@families
def test_trainer_packs_hybrid_layers_exactly_and_stock_does_not(family):
    model = build(family)
    samples = H.make_samples("causal", n=10, seed=0, lo=3, hi=30, prompt_mask_frac=0.3)
    stock = packed_row_error(model, samples[:4])
    assert stock > GRAD_TOL, f"{family}: stock's packed row should leak between documents or be refused ({stock:.3e})"
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": "varlen"}})
    try:
        try:
            trainer, grads = _train(model, samples, ga=2)
        except PackingCheckError as err:  # measured here: this release's model does not run the packed path at all
            message = str(err)
            assert "\n" not in message and message.startswith(type(model).__name__), message
            assert not check_model_packs_correctly(model, token_budget=BUDGET, raise_on_failure=False).passed
            pytest.skip(f"{family} on transformers {transformers.__version__}: refused before any step ({message[:160]})")
    finally:
        hf_gradfix.unpatch()
    line = " ".join(hf_gradfix.state_of(trainer).fixes)
    assert "documents run one by one through" in line and "guard passed" in line, line
    windows = _windows(samples, 2)
    assert len(windows) == len(grads) >= 2
    assert any(len(b) > 1 for w in windows for b in w)  # rows really hold several documents
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for k, (window, g) in enumerate(zip(windows, grads)):
        gt_loss, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"{family} step {k}: {H.rel_err(g, gt):.3e} (stock packed row: {stock:.3e})"
        assert abs(logged[k] - gt_loss) / gt_loss <= LOSS_TOL
    model._hf_gradfix_document_split.restore()


@families
def test_controls_state_carried_over_or_reset_at_the_wrong_boundary_fail(family, monkeypatch):
    """With the split the packed row is exact; undone (stock's path), or with two documents run as one (the state and
    the convolution window not reset at that boundary), the same row fails the tolerance."""
    model = build(family)
    samples = H.make_samples("causal", n=4, seed=1, lo=6, hi=20)
    probe = transformers.DataCollatorWithFlattening()([{"input_ids": list(s["input_ids"])} for s in samples[:3]])
    model.eval()
    mixers = state_reset.find_sequence_mixers(model, {"input_ids": probe["input_ids"], "position_ids": probe["position_ids"]})
    assert mixers and all(m.leak > 0 for m in mixers)
    split = state_reset.split_documents(model, mixers)
    exact = packed_row_error(model, samples)
    assert exact <= GRAD_TOL, exact
    assert split.calls > 0
    true_bounds = state_reset.segment_bounds

    def merged(position_ids):  # documents 0 and 1 as one segment: no reset between them
        rows = true_bounds(position_ids)
        return [[(r[0][0], r[1][1])] + r[2:] if len(r) > 1 else r for r in rows]

    monkeypatch.setattr(state_reset, "segment_bounds", merged)
    wrong = packed_row_error(model, samples)
    monkeypatch.setattr(state_reset, "segment_bounds", true_bounds)
    assert split.restore() == sum(len(m.modules) for m in mixers)
    carried = packed_row_error(model, samples)  # inf: transformers refuses the packed row on this path (Qwen3.5)
    assert wrong > GRAD_TOL and carried > GRAD_TOL, (wrong, carried)


def _table():
    import importlib.util

    path = H.REPO_ROOT / "benchmarks" / "hybrid_packing_table.py"
    spec = importlib.util.spec_from_file_location("hybrid_packing_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE_FAMILIES = sorted(_table().FAMILIES)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="the table's tiny configs are written for transformers 5.x (4.57: LFM2 / Bamba above)")
@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_every_hybrid_family_packs_exactly_with_the_split(family):
    """Every hybrid / state-space / linear-attention family of benchmarks/hybrid_packing_table.py (tiny, torch
    fallbacks): stock's packed row leaks (gradient error > 1e-5) and the guard refuses it unsplit; with the measured
    mixers split, the guard passes and the packed row's gradient is within 1e-5 of each document alone."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    table = _table()
    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    row = table.measure(family)
    if "build" in row:
        assert "no AutoModelForCausalLM class" in row["build"], row["build"]  # a text decoder shipped only in a VLM
        pytest.skip(row["build"])
    assert row["stock_grad"] is None or row["stock_grad"] > GRAD_TOL, row
    assert not (row["guard_before"] or {}).get("passed"), row
    assert row.get("mixers"), row
    assert row["guard_after"]["passed"] and row["guard_after"]["leak"] == 0.0, row
    assert row["split_grad"] <= GRAD_TOL, row
