"""The per-document rope index of hf_gradfix.packing.multimodal on the installed transformers (5.x: get_rope_index
takes mm_token_type_ids; 4.57: it finds the image tokens in input_ids): called once per image document with only
that document's grids, and the packed row's logits equal each document alone. Uses only the harness's tiny
Qwen2.5-VL (builds on both versions), so this file also runs in the 4.57 phase.
"""

from __future__ import annotations

import functools

import torch

import harness as H
from hf_gradfix.packing.collator import check_packed_batch
from hf_gradfix.packing.multimodal import MultimodalPackedCollator, _find_rope_index, rope_index_fn

IMAGE, VSTART = 96, 95
PATCH_DIM = 3 * 2 * 14 * 14


def _model():
    model = H.build_model("qwen2_5_vl", attn_implementation="sdpa")
    for c in (model.config, getattr(model.config, "text_config", None), getattr(model.model, "config", None)):
        if c is not None:
            c.image_token_id, c.vision_start_token_id = IMAGE, VSTART
    return model.eval()


def _sample(g, grids):
    ids, mm, pv = [], [], []
    for h, w in grids:
        ids += torch.randint(4, 90, (3,), generator=g).tolist() + [VSTART] + [IMAGE] * (h * w // 4)
        mm += [0] * 4 + [1] * (h * w // 4)
        pv.append(torch.randn(h * w, PATCH_DIM, generator=g))
    tail = torch.randint(4, 90, (6,), generator=g).tolist()
    s = dict(input_ids=torch.tensor(ids + tail), mm_token_type_ids=torch.tensor(mm + [0] * 6))
    if grids:
        s["pixel_values"], s["image_grid_thw"] = torch.cat(pv), torch.tensor([[1, h, w] for h, w in grids])
    return s


def test_rope_index_once_per_document_and_packed_equals_alone():
    model = _model()
    g = torch.Generator().manual_seed(0)
    docs = [_sample(g, []), _sample(g, [(4, 4)]), _sample(g, [(2, 4), (6, 4)]), _sample(g, []), _sample(g, [(4, 2)])]
    owner = model.model if callable(getattr(model.model, "get_rope_index", None)) else model
    calls = []
    original = _find_rope_index(model)

    @functools.wraps(original)
    def spy(input_ids, *args, **kwargs):
        calls.append((input_ids.shape, kwargs.get("image_grid_thw")))
        return original(input_ids, *args, **kwargs)

    owner.get_rope_index = spy
    try:
        batch = MultimodalPackedCollator(rope_index_fn(model))(docs)
    finally:
        del owner.get_rope_index
    image_docs = [d for d in docs if "image_grid_thw" in d]
    assert len(calls) == len(image_docs)  # once per image document (text-only documents: arange)
    for (shape, grids), d in zip(calls, image_docs):
        assert tuple(shape) == (1, d["input_ids"].numel()) and torch.equal(grids, d["image_grid_thw"])
    check_packed_batch(batch)
    assert tuple(batch["position_ids"].shape) == (4, 1, sum(d["input_ids"].numel() for d in docs))
    labels = batch.pop("labels")
    starts = batch["cu_seq_lens_q"][:-1].long()
    assert bool((labels[0, starts] == -100).all())
    with torch.no_grad():
        out = model(**batch, use_cache=False).logits[0]
        at, worst, control = 0, 0.0, 0.0
        three = model(**dict(batch, position_ids=batch["position_ids"][1:]), use_cache=False).logits[0]
        for d in docs:
            alone = model(**{k: (v[None] if k in ("input_ids", "mm_token_type_ids") else v) for k, v in d.items()},
                          use_cache=False).logits[0]
            n = d["input_ids"].numel()
            scale = float(alone.abs().max())
            worst = max(worst, float((out[at:at + n] - alone).abs().max()) / scale)
            control = max(control, float((three[at:at + n] - alone).abs().max()) / scale)
            at += n
    assert worst <= 1e-5 and control > 1e-2, (worst, control)
