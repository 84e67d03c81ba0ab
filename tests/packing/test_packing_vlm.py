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


def processor(family: str):
    """The family's offline processor, built once (Qwen's takes seconds)."""
    if ("processor", family) not in _CACHE:
        _CACHE[("processor", family)] = V.build_processor(family)
    return _CACHE[("processor", family)]


def setup(family: str):
    """(model, processed samples, collator) for ``family``; built once per module."""
    if family not in _CACHE:
        model = V.build_vlm(family)
        model.eval()  # no dropout anyway; eval keeps the comparison free of train-only branches
        feats = V.processed_samples(family, V.make_samples(family, len(COUNTS), seed=3, counts=COUNTS),
                                    processor(family))
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


# ------------------------------------------------------------------ Gemma 3: measured, and the guard's answer
def test_gemma3_packed_rows_are_measured_and_the_guard_acts():
    """Gemma 3 (token_type_ids: bidirectional attention over each image; sliding-window layers): MEASURE a packed row
    with image documents after other documents against each document alone. Where it differs (research 1.2's
    suspicion; transformers 5.24 measures up to ~1 relative), the guard must not pack image documents with others: its
    plan gives every image document a row of its own, and that layout is exact (logits and gradients). Where it does
    not differ, the guard packs freely. Also measured: the same model with every layer full-attention packs exactly
    (the difference lives in the sliding-window layers)."""
    from hf_gradfix.packing.multimodal_guard import check_vlm_packs_correctly

    model, feats, collator = setup("gemma3")
    ref_logits, ref_grads = _alone(model, feats, "gemma3")
    shared, _ = P.packed_run(model, collator(feats))
    err_shared = P.worst_rel(P.split_row(shared, feats), ref_logits)
    plan = check_vlm_packs_correctly(model, feats, pad_token_id=V.pad_id("gemma3"))
    if err_shared <= LOGIT_TOL:
        assert plan.image_rows == "shared", plan
        return
    assert err_shared > 1e-2, err_shared  # a real difference, not rounding
    assert plan.image_rows == "alone", plan
    assert "Gemma3ForConditionalGeneration (gemma3)" in plan.reason and "token_type_ids" in plan.reason
    assert "sliding-window" in plan.reason and "\n" not in plan.reason
    alone = MultimodalPackedCollator(None, pad_token_id=V.pad_id("gemma3"), image_rows="alone")
    batch = alone(feats)
    check_packed_batch(batch)
    # where each document went: image documents a row each (in order), then the text-only ones sharing a row
    img = [i for i, f in enumerate(feats) if "pixel_values" in f]
    txt = [i for i, f in enumerate(feats) if "pixel_values" not in f]
    assert batch["input_ids"].shape[0] == len(img) + (1 if txt else 0)
    model.zero_grad(set_to_none=True)
    labels = batch.pop("labels")
    out = model(**batch, use_cache=False).logits
    pieces, total = {}, 0.0
    for r, members in enumerate([[i] for i in img] + ([txt] if txt else [])):
        at = 0
        for i in members:
            n = feats[i]["input_ids"].numel()
            pieces[i] = out[r, at:at + n]
            total = total + P.summed_loss(out[r, at:at + n], labels[r, at:at + n])
            at += n
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    err = P.worst_rel([pieces[i].detach() for i in range(len(feats))], ref_logits)
    assert err <= LOGIT_TOL, err
    assert P.grad_rel(grads, ref_grads) <= GRAD_TOL
    # localized: every layer full-attention packs exactly (same weights, only the layer kinds changed)
    for layer in model.model.language_model.layers:
        layer.attention_type = "full_attention"
        layer.self_attn.sliding_window, layer.self_attn.is_sliding = None, False
    model.config.text_config.layer_types = ["full_attention"] * len(model.model.language_model.layers)
    try:
        full_ref, _ = P.docs_alone(model, feats)
        full, _ = P.packed_run(model, collator(feats))
        assert P.worst_rel(P.split_row(full, feats), full_ref) <= LOGIT_TOL
    finally:
        _CACHE.pop("gemma3")  # the model was changed


@pytest.mark.parametrize("family", [f for f in V.FAMILIES if f != "gemma3"])
def test_guard_packs_families_that_isolate(family):
    from hf_gradfix.packing.multimodal_guard import check_vlm_packs_correctly

    model, feats, _ = setup(family)
    plan = check_vlm_packs_correctly(model, feats, pad_token_id=V.pad_id(family))
    assert plan.image_rows == "shared" and plan.reason is None, plan
    assert plan.details["leak_probe"] == 0.0 or plan.details["leak_probe"] < 1e-6


def test_guard_refuses_a_family_whose_text_positions_do_not_isolate():
    """A Qwen2.5-VL whose forward drops the text row of the positions (the 3 mRoPE rows only: no packed mask) mixes
    every packed row, with or without images: refused in one line naming the family, before any step."""
    from hf_gradfix.packing.guard import PackingCheckError
    from hf_gradfix.packing.multimodal_guard import check_vlm_packs_correctly

    model, feats, _ = setup("qwen2_5_vl")
    forward = model.forward

    def three_rows(*args, position_ids=None, **kwargs):
        if position_ids is not None and position_ids.dim() == 3:
            position_ids = position_ids[1:]
        return forward(*args, position_ids=position_ids, **kwargs)

    model.forward = three_rows
    try:
        with pytest.raises(PackingCheckError) as info:
            check_vlm_packs_correctly(model, feats, pad_token_id=V.pad_id("qwen2_5_vl"))
    finally:
        del model.forward
    msg = str(info.value)
    assert "Qwen2_5_VLForConditionalGeneration (qwen2_5_vl) cannot be trained on packed multimodal rows" in msg
    assert "\n" not in msg and "packing.enabled: false" in msg


def test_a_cut_placeholder_run_is_refused_in_one_line():
    """An image whose placeholder run was cut (truncation), or an over-budget row: one line naming the key."""
    _, feats, collator = setup("qwen2_5_vl")
    s = next(f for f in feats if "image_grid_thw" in f and f["image_grid_thw"].shape[0] >= 2)
    cut = dict(s, image_grid_thw=s["image_grid_thw"][:1], pixel_values=s["pixel_values"][:int(s["image_grid_thw"][0].prod())])
    with pytest.raises(PackedBatchError, match="placeholder run"):
        collator([cut])
    budget = MultimodalPackedCollator(None, max_tokens=len(s["input_ids"]) - 1)
    with pytest.raises(PackedBatchError, match="over the token budget"):
        budget([s])
    # before training, the dataset check: a sample longer than the row (its image tokens counted), by index
    from hf_gradfix.packing import validate_packing_dataset

    data = [{k: v for k, v in f.items() if k != "idx"} for f in feats]
    longest = max(len(f["input_ids"]) for f in feats)
    at = next(i for i, f in enumerate(feats) if len(f["input_ids"]) == longest)
    with pytest.raises(PackedBatchError, match=f"index {at}, column 'input_ids': has {longest} tokens"):
        validate_packing_dataset(data, token_budget=longest - 1)


# ------------------------------------------------------------------ through the Trainer and TRL's SFTTrainer
def _trainer_run(family, path, ga, budget, tmp_path, monkeypatch):
    import transformers

    import harness as H
    import hf_gradfix
    from hf_gradfix.packing import multimodal

    proc = processor(family)
    raw = V.make_samples(family, 6, seed=5, counts=(0, 2, 1, 0, 3, 1))
    model = V.build_vlm(family)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    rows: list[list[tuple]] = []
    call = multimodal.MultimodalPackedCollator.__call__

    def recording(self, samples):  # which documents each micro-batch held (by their token ids); the loader's
        if self.text.max_tokens is None:  # collator has the budget (the guard's probe collators do not)
            return call(self, samples)
        bins = samples if samples and not isinstance(samples[0], dict) else [samples]
        rows.append([tuple(torch.as_tensor(s["input_ids"]).view(-1).tolist()) for b in bins for s in b])
        return call(self, samples)

    monkeypatch.setattr(multimodal.MultimodalPackedCollator, "__call__", recording)
    common = dict(output_dir=str(tmp_path), optim="sgd", learning_rate=0.0, max_grad_norm=0.0,
                  gradient_accumulation_steps=ga, per_device_train_batch_size=1, num_train_epochs=1, report_to="none",
                  use_cpu=True, save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    cap = H.GradCapture()
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": budget}})
    try:
        if path in ("trainer", "stream"):
            feats = [{k: v for k, v in V.process_one(family, s, proc).items() if k != "idx"} for s in raw]
            dataset = H.ListDataset(feats)
            if path == "stream":  # an IterableDataset: hf_gradfix's StreamingPacker packs it online
                common.update(max_steps=1)
                dataset = _Stream(feats)
            trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                           train_dataset=dataset, callbacks=[cap])
        else:
            from trl import SFTConfig, SFTTrainer
            from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

            import datasets

            data = datasets.Dataset.from_list([{k: v for k, v in s.items() if k != "idx"} for s in raw])
            trainer = SFTTrainer(model=model, args=SFTConfig(**common, assistant_only_loss=True, max_length=None, bf16=False),
                                 train_dataset=data, processing_class=proc, callbacks=[cap])
            one = DataCollatorForVisionLanguageModeling(processor=proc, assistant_only_loss=True)
            feats = []
            for s in data:  # the ground truth's samples: TRL's own collator on each sample (as stored) alone
                b = one([dict(s)])
                feats.append({k: (v[0] if k in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids") else v)
                              for k, v in b.items() if k != "attention_mask" and torch.is_tensor(v)})
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    model.load_state_dict(init)
    by_ids = {tuple(f["input_ids"].tolist()): f for f in feats}
    windows = [sum(rows[k * ga:(k + 1) * ga], []) for k in range(len(cap.grads))]
    return model, cap.grads, [[by_ids[i] for i in w] for w in windows], trainer


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, feats):
        super().__init__()
        self.feats = feats

    def __iter__(self):
        yield from (dict(f) for f in self.feats)


def _gt(model, window):
    """d/dθ of (sum over the window's documents alone of their summed CE) / (their target count)."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for f in window:
        labels = P.labels_of(f)
        total = total + P.summed_loss(model(**P.alone_inputs(f), use_cache=False).logits[0], labels)
        count += int(labels[1:].ne(-100).sum())
    (total / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,path,ga", [("qwen2_5_vl", "trainer", 2), ("gemma3", "trainer", 1),
                                            ("llava", "stream", 2), ("qwen2_5_vl", "sft", 1), ("idefics3", "sft", 2)])
def test_trainer_and_sft_trainer_pack_vlm_exactly(family, path, ga, tmp_path, monkeypatch):
    """packing.enabled on a vision dataset: Trainer (processed samples, map-style and an IterableDataset) and TRL's SFTTrainer (its raw vision samples,
    its own collator per sample, assistant-only labels): every window's gradient within 1e-5 of the window's documents
    each alone (summed CE / the window's target count), and the epoch covers every document once."""
    model, grads, windows, trainer = _trainer_run(family, path, ga, 160, tmp_path, monkeypatch)
    assert grads and sum(len(w) for w in windows) == 6  # (a stream: max_steps 1, the window holds the whole stream)
    for g, window in zip(grads, windows):
        err = P.grad_rel(g, _gt(model, window))
        assert err <= GRAD_TOL, (family, path, err)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_rows_mode_two_rows_equal_each_document_alone(family):
    """mode="rows": two bins, two tail-padded rows (Qwen: [4, 2, T] positions; Idefics3: the per-row image stacks
    re-padded with all-zero images to the larger count): every document equals itself alone."""
    model, feats, _ = setup(family)
    ref_logits, _ = _alone(model, feats, family)
    rows = MultimodalPackedCollator(rope_index_fn(model), mode="rows", pad_token_id=V.pad_id(family))
    batch = rows([feats[:2], feats[2:]])
    check_packed_batch(batch)
    assert batch["input_ids"].shape[0] == 2 and "cu_seq_lens_q" not in batch
    batch.pop("labels")
    with torch.no_grad():
        out = model(**batch, use_cache=False).logits
    pieces = P.split_row(out[0], feats[:2]) + P.split_row(out[1], feats[2:])
    assert P.worst_rel(pieces, ref_logits) <= LOGIT_TOL


@pytest.mark.parametrize("family", ["llava"])
def test_varlen_kernel_with_a_tower_that_reads_the_forwards_kwargs(family):
    """LLaVA hands the forward's keyword arguments on to their vision tower, so a varlen kernel there would
    read the TEXT row's ``cu_seq_lens`` as the tower's own. The collator leaves them out for these layouts (restarted
    positions delimit the documents, transformers derives the kernel's boundaries from them): under hf_gradfix's
    reference varlen kernel the packed row equals each document alone; control: the same row with the text
    boundaries put back fails in the tower (or is far off)."""
    from hf_gradfix.packing.attention import register_reference_varlen_attention, use_attention_implementation

    model, feats, collator = setup(family)
    batch = collator(feats)
    assert "cu_seq_lens_q" not in batch and batch["position_ids"].dim() == 2
    ref_logits, _ = _alone(model, feats, family)
    with use_attention_implementation(model, register_reference_varlen_attention()):
        logits, _ = P.packed_run(model, batch)
        err = P.worst_rel(P.split_row(logits, feats), ref_logits)
        assert err <= LOGIT_TOL, (family, err)
        starts = torch.nonzero(batch["position_ids"][0] == 0).flatten().tolist() + [batch["input_ids"].shape[1]]
        cu = torch.tensor(starts, dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        bad = dict(batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
        try:
            control, _ = P.packed_run(model, bad)
        except Exception as e:  # noqa: BLE001 - the tower refuses the text row's boundaries: the failure we avoid
            print(f"{family}: text boundaries in the tower: {type(e).__name__}: {str(e)[:120]}")
        else:
            cerr = P.worst_rel(P.split_row(control, feats), ref_logits)
            assert cerr > max(CONTROL_MIN, 100 * err), (family, cerr, err)
