"""Padding-free VLM packing (hf_gradfix.packing.multimodal), per family, against every document run ALONE.

Families (tiny random-init, offline processors: tests/support/vlm.py): Qwen2.5-VL (mRoPE, flattened patches +
image_grid_thw), Gemma 3 (per-image pixel_values, token_type_ids, bidirectional image mask, sliding-window layers),
Idefics3 (per-sample image stacks + pixel_attention_mask), LLaVA (per-image pixel_values). Samples hold 0, 1 and several
images of different sizes, with image documents in non-first positions of the row.

Ground truth (tests/support/vlm_packing.py): each document alone, as unpacked training runs it (batch of one, its own
images, no attention mask, the model's own positions), summed cross-entropy in plain PyTorch, summed over documents.
Controls that must fail: 2-D (2-row) positions for the mRoPE family, images concatenated in the wrong order, a packed
row without restarted positions; and a leak probe (perturbing document k leaves document k+1's logits unchanged).
"""

from __future__ import annotations

import pytest
import torch

import vlm as V
import vlm_packing as P
from hf_gradfix.packing.collator import check_packed_batch, PackedBatchError
from hf_gradfix.packing.multimodal import MultimodalPackedCollator, rope_index_fn

LOGIT_TOL = 1e-5  # max |packed - alone| / max |alone|: fp32 rounding
GRAD_TOL = 1e-5  # ||g_packed - g_alone|| / ||g_alone||
CONTROL_MIN = 1e-3  # a control's error must be at least this (and >= 100x the packed error)
COUNTS = (0, 3, 1, 0, 2)  # text-only first: every image document sits after another document in the row

_CACHE: dict = {}


def setup(family: str):
    """(model, processed samples, collator) for ``family``; built once per module."""
    if family not in _CACHE:
        model = V.build_vlm(family)
        model.eval()  # no dropout anyway; eval keeps the comparison free of train-only branches
        feats = V.processed_samples(family, V.make_samples(family, len(COUNTS), seed=3, counts=COUNTS))
        collator = MultimodalPackedCollator(rope_index_fn(model), pad_token_id=V.pad_id(family))
        _CACHE[family] = (model, feats, collator)
    return _CACHE[family]


def _alone(model, feats, family):
    key = ("alone", family)
    if key not in _CACHE:
        _CACHE[key] = P.docs_alone(model, feats, grad=True)
    return _CACHE[key]


@pytest.mark.parametrize("family", [f for f in V.FAMILIES if f != "gemma3"])
def test_packed_equals_each_document_alone(family):
    model, feats, collator = setup(family)
    batch = collator(feats)
    check_packed_batch(batch)
    assert "attention_mask" not in batch
    ref_logits, ref_grads = _alone(model, feats, family)
    logits, grads = P.packed_run(model, batch, grad=True)
    err = P.worst_rel(P.split_row(logits, feats), ref_logits)
    gerr = P.grad_rel(grads, ref_grads)
    assert err <= LOGIT_TOL, (family, err)
    assert gerr <= GRAD_TOL, (family, gerr)
    # the vision tower is inside the comparison: its parameters get a gradient on both sides
    tower = [n for n in V.tower_and_projector_names(model) if n in ref_grads]
    assert tower and all(n in grads for n in tower)
    # control: the same row with no restarted positions (one document to the model) is far off
    plain = {k: v for k, v in batch.items() if k not in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                          "max_length_q", "max_length_k")}
    control, _ = P.packed_run(model, plain)
    cerr = P.worst_rel(P.split_row(control, feats), ref_logits)
    assert cerr > max(CONTROL_MIN, 100 * err), (family, cerr, err)


def _image_slices(batch, family):
    """[(tensor key, index) of every image in the packed batch], in document order, and their shapes."""
    pv = batch["pixel_values"]
    if "image_grid_thw" in batch:  # flattened patches: image i is rows [sum of earlier grids, + its own)
        sizes = batch["image_grid_thw"].prod(-1).tolist()
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(slice(a, a + n), tuple(g)) for a, n, g in zip(starts, sizes, batch["image_grid_thw"].tolist())]
    if pv.dim() == 5:  # a stack [rows, N, C, H, W]
        return [((0, i), tuple(pv.shape[2:])) for i in range(pv.shape[1])]
    return [(i, tuple(pv.shape[1:])) for i in range(pv.shape[0])]


@pytest.mark.parametrize("family", [f for f in V.FAMILIES if f != "gemma3"])
def test_images_in_the_wrong_order_are_caught(family):
    """Control: two images of the same shape from different documents swapped in the concatenation (grids and
    tokens untouched, so the model runs): the documents' logits are far from each alone."""
    model, feats, collator = setup(family)
    batch = collator(feats)
    ref_logits, _ = _alone(model, feats, family)
    images = _image_slices(batch, family)
    # the first and last image of the same shape (for the stack layout: tiles of the first and last image document)
    pair = next((a, b) for i, a in enumerate(images) for b in images[::-1] if a[1] == b[1] and a is not b)
    swapped = dict(batch, pixel_values=batch["pixel_values"].clone())
    pv = swapped["pixel_values"]
    pv[pair[0][0]], pv[pair[1][0]] = batch["pixel_values"][pair[1][0]], batch["pixel_values"][pair[0][0]]
    logits, _ = P.packed_run(model, swapped)
    good, _ = P.packed_run(model, batch)
    err = P.worst_rel(P.split_row(good, feats), ref_logits)
    cerr = P.worst_rel(P.split_row(logits, feats), ref_logits)
    assert err <= LOGIT_TOL and cerr > max(CONTROL_MIN, 100 * err), (family, cerr, err)


def test_two_row_positions_for_an_mrope_family_are_caught():
    """Control: Qwen2.5-VL given the restarted 2-D text positions only (what TRL #7081 / axolotl #3817 emit): no
    packed mask is built (transformers reads isolation from row 0 of a 4-row tensor only) and the image tokens lose
    their grid positions; and the 3 mRoPE rows without the text row; both far off. check_packed_batch refuses 3 rows."""
    model, feats, collator = setup("qwen2_5_vl")
    batch = collator(feats)
    assert tuple(batch["position_ids"].shape[:2]) == (4, 1)
    ref_logits, _ = _alone(model, feats, "qwen2_5_vl")
    good, _ = P.packed_run(model, batch)
    err = P.worst_rel(P.split_row(good, feats), ref_logits)
    for bad_pos in (batch["position_ids"][0], batch["position_ids"][1:]):
        logits, _ = P.packed_run(model, dict(batch, position_ids=bad_pos))
        cerr = P.worst_rel(P.split_row(logits, feats), ref_logits)
        assert cerr > max(CONTROL_MIN, 100 * err), (tuple(bad_pos.shape), cerr, err)
    with pytest.raises(PackedBatchError, match="3-row mRoPE positions do not isolate"):
        check_packed_batch(dict(batch, position_ids=batch["position_ids"][1:]))


@pytest.mark.parametrize("family", [f for f in V.FAMILIES if f != "gemma3"])
def test_leak_probe_perturbing_one_document_leaves_the_next_unchanged(family):
    """Perturb document k (its text tokens and its images' pixels): document k+1's logits do not move; on the same
    row without restarted positions they do (the probe can see a leak)."""
    model, feats, collator = setup(family)
    k = next(i for i, f in enumerate(feats[:-1]) if "pixel_values" in f and f["pixel_values"].numel())
    poked = [dict(f) for f in feats]
    ids = poked[k]["input_ids"].clone()
    text = (poked[k]["labels"] != -100).nonzero().flatten()[:-1]  # assistant tokens (not special/image tokens)
    ids[text] = ids[text].roll(1)
    poked[k]["input_ids"] = ids
    poked[k]["pixel_values"] = poked[k]["pixel_values"] + 0.5 * torch.randn_like(poked[k]["pixel_values"])
    plain_keys = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    outs = {}
    for name, samples in (("base", feats), ("poked", poked)):
        batch = collator(samples)
        outs[name] = P.split_row(P.packed_run(model, batch)[0], samples)
        plain = {a: b for a, b in batch.items() if a not in plain_keys}
        outs[name + "_plain"] = P.split_row(P.packed_run(model, plain)[0], samples)
    assert P.rel(outs["poked"][k], outs["base"][k]) > CONTROL_MIN  # the perturbation reaches document k itself
    moved = P.rel(outs["poked"][k + 1], outs["base"][k + 1])
    moved_plain = P.rel(outs["poked_plain"][k + 1], outs["base_plain"][k + 1])
    assert moved <= 1e-6 and moved_plain > CONTROL_MIN, (family, moved, moved_plain)
