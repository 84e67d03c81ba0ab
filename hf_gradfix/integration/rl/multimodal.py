"""Multimodal GRPO / RLOO batches in the packed log-prob forwards (``packing.rl_forwards``, issue 52 item 4).

TRL 1.16's ``_get_per_token_logps_and_entropies`` takes a batch's images beside its rows (``pixel_values``,
``image_grid_thw``, ``num_images``, ``pixel_attention_mask``, ``image_sizes``, ``mm_token_type_ids``, ...) and slices
them per chunk of ``batch_size`` samples by layout. The packed forward (:mod:`.packing`) makes each chunk ONE row whose
documents are the chunk's samples in order, so the chunk's images are handed over exactly as TRL slices them (the
samples' images in sample order are the documents' images in document order), and per-token keys are packed like the
tokens. The layouts, told apart by the keys and shapes TRL passes (never by the model class):

- flattened patches + ``image_grid_thw`` (Qwen2/2.5/3-VL, GLM-4V): the chunk's patch rows and grids, as TRL; the
  model reads mRoPE positions, so the row gets the 4-row ``position_ids`` of :func:`hf_gradfix.packing.multimodal.
  mrope_positions` (row 0 restarted per document, rows 1-3 the model's own rope index run on each document alone);
- one ``pixel_values`` row per image (LLaVA, ``pixel_values.size(0) == sum(num_images)``; ``image_sizes`` alike);
- a per-sample stack ``[B, N, C, H, W]`` with ``pixel_attention_mask`` (Idefics3 / SmolVLM): the chunk's stacks
  flattened to ``[1, b N, ...]`` in sample order (the model drops the all-zero padding images wherever they sit).

Refused (the batch stays padded, one warning naming the key): ``token_type_ids`` (Gemma 3's bidirectional image-token
mask: a packed row's sliding layers may read it at shifted positions, not measured exact), ``image_position_ids``
(Gemma 4), ``spatial_shapes`` (LFM2-VL), ``num_tiles`` (InternVL), and any ``pixel_values`` layout not above.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["multimodal_reason", "chunk_images", "pack_multimodal", "varlen_kwargs_allowed"]

#: keys TRL passes that the packed row knows how to lay out
KNOWN = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "image_sizes", "mm_token_type_ids")
#: keys that keep a batch padded, and why
REFUSED = {
    "token_type_ids": "token_type_ids (a bidirectional image-token mask, Gemma 3: its packed rows are not measured exact)",
    "image_position_ids": "image_position_ids (Gemma 4's per-patch positions: not packed here)",
    "spatial_shapes": "spatial_shapes (LFM2-VL's tiles: not packed here)",
    "num_tiles": "num_tiles (InternVL's tiles: not packed here)",
}


def _layout(extra: dict) -> str | None:
    pv = extra.get("pixel_values")
    if pv is None:
        return "text"
    if extra.get("image_grid_thw") is not None:
        return "grid"
    if extra.get("pixel_attention_mask") is not None and pv.dim() == 5:
        return "stack"
    num = extra.get("num_images")
    if num is not None and pv.size(0) == sum(num):
        return "per_image"
    return None


def varlen_kwargs_allowed(extra: dict[str, Any]) -> bool:
    """Whether the packed row may carry ``cu_seq_lens_q/k`` / ``max_length_q/k``. Not with per-image or per-sample
    pixel layouts: those models hand the forward's keyword arguments on to their vision tower (LLaVA's
    ``get_image_features`` passes ``**kwargs`` to it), whose attention would then read the text row's boundaries as
    its own (measured: the varlen kernel refuses boundaries summing to the row's length over the tower's tokens). Their
    documents are delimited by the restarted ``position_ids`` alone, from which transformers builds the packed mask
    (sdpa / eager / flex) or FlashAttention's boundaries (``prepare_fa_kwargs_from_position_ids``). A flattened-patch
    tower computes its own ``cu_seqlens`` from ``image_grid_thw`` (and pops them), so the grid layout keeps them."""
    return _layout(extra) in ("grid", "text")


def multimodal_reason(extra: dict[str, Any], rows: int) -> str | None:
    """Why this batch's multimodal inputs cannot be packed exactly (None: they can; ``extra`` holds only the keys
    given, none None)."""
    for key, why in REFUSED.items():
        if key in extra:
            return why
    unknown = sorted(k for k in extra if k not in KNOWN)
    if unknown:
        return f"{', '.join(unknown)} (inputs the packed forward does not know)"
    layout = _layout(extra)
    if layout is None:
        return "a pixel_values layout the packed forward does not know (not patches + grid, per image, or per sample)"
    if layout != "text" and extra.get("num_images") is None:
        return "images without num_images (their samples unknown)"
    if extra.get("num_images") is not None and len(extra["num_images"]) != rows:
        return f"num_images for {len(extra['num_images'])} samples, not the batch's {rows}"
    return None


def chunk_images(extra: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """The images of samples ``start:end`` as ONE packed row takes them (TRL's own slicing; a stack flattened)."""
    out: dict[str, Any] = {}
    layout = _layout(extra)
    num = list(extra.get("num_images") or [])
    cum = [0]
    for n in num:
        cum.append(cum[-1] + int(n))
    pv = extra.get("pixel_values")
    if layout == "grid":
        grid = extra["image_grid_thw"]
        patches = grid.prod(-1).tolist()
        first = sum(patches[: cum[start]])
        last = first + sum(patches[cum[start]: cum[end]])
        out["pixel_values"] = pv[first:last]
        out["image_grid_thw"] = grid[cum[start]: cum[end]]
    elif layout == "per_image":
        out["pixel_values"] = pv[cum[start]: cum[end]]
    elif layout == "stack":
        stack, mask = pv[start:end], extra["pixel_attention_mask"][start:end]
        out["pixel_values"] = stack.reshape(1, -1, *stack.shape[2:])
        out["pixel_attention_mask"] = mask.reshape(1, -1, *mask.shape[2:])
    if extra.get("image_sizes") is not None:
        out["image_sizes"] = extra["image_sizes"][cum[start]: cum[end]]
    return out


def pack_multimodal(inputs: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    extra: dict[str, Any], start: int, end: int, *, rope_fn=None, text_start: int = 0,
                    mrope: bool = True) -> dict[str, Any]:
    """``inputs`` (one packed row of samples ``start:end``, :func:`.packing.pack_chunk`'s) with the chunk's images and
    packed per-token keys, and for a model with a rope index (``rope_fn``: :func:`hf_gradfix.packing.multimodal.
    rope_index_fn`) the 4-row ``position_ids`` computed per document. ``mrope=False`` keeps the 2-D restarted
    positions: the wrong row the tests use as a control."""
    from ...packing.multimodal import mrope_positions

    ids, mask = input_ids[start:end], attention_mask[start:end].bool()
    out = dict(inputs)
    out.update(chunk_images(extra, start, end))
    mm = extra.get("mm_token_type_ids")
    if mm is not None:
        out["mm_token_type_ids"] = mm[start:end][mask][None]
    if extra.get("token_type_ids") is not None:  # packed like the tokens (only reached by a measurement: refused above)
        out["token_type_ids"] = extra["token_type_ids"][start:end][mask][None]
    if rope_fn is None or not mrope:
        return out
    num = list(extra.get("num_images") or [0] * end)
    grid = extra.get("image_grid_thw")
    first = sum(int(n) for n in num[:start])
    docs = []
    for i in range(end - start):
        keep = mask[i]
        if not bool(keep.any()):
            continue
        doc: dict[str, Any] = {"input_ids": ids[i][keep].cpu()}
        if mm is not None:
            doc["mm_token_type_ids"] = mm[start + i][keep].cpu()
        n = int(num[start + i]) if num else 0
        if grid is not None and n:
            doc["image_grid_thw"] = grid[first: first + n].cpu()
        first += n
        docs.append(doc)
    positions = mrope_positions(docs, rope_fn, text_start=text_start)
    out["position_ids"] = positions[:, None, :].to(ids.device)
    return out
