"""Padding-free packing of vision-language samples: whole samples per row, each family's image tensors concatenated
in document order, positions restarted per document (the 4-row mRoPE layout where the model has a rope index).

A multimodal sample is what a processor returns for ONE sample (a leading batch dimension of 1 is accepted): token-axis
keys (``input_ids``, ``labels``, ``mm_token_type_ids``, ``token_type_ids``; ``input_ids`` already holds the expanded
image placeholder runs, so a sample's length is ``len(input_ids)``) and per-image keys in one of three layouts, told
apart by the keys and shapes present (never by the model class):

- ``"grid"`` (Qwen2/2.5/3-VL, GLM-4V): flattened patches ``pixel_values [patches, D]`` plus ``image_grid_thw
  [images, 3]`` (and ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts``): concatenated along dim 0;
- ``"stack"`` (Idefics3 / SmolVLM): a per-sample stack ``pixel_values [images, C, H, W]`` with ``pixel_attention_mask
  [images, H, W]``: one ``[rows, N, C, H, W]`` tensor per batch, re-padded with all-zero images (which the model drops)
  to the largest count and with zero pixels (mask 0) to the largest size;
- ``"per_image"`` (Gemma 3, LLaVA): ``pixel_values [images, C, H, W]`` (plus ``image_sizes`` / ``image_position_ids``
  where the family has them): concatenated along dim 0.

:func:`rope_index_fn` wraps the model's own rope-index function (``get_rope_index``) so that it runs on ONE document
with only that document's grids; :class:`MultimodalPackedCollator` calls it once per document and lays out
``position_ids [4, rows, T]``: row 0 the per-document ``arange`` (what transformers builds the packed-sequence mask and
FlashAttention's boundaries from), rows 1-3 the per-document mRoPE positions. Never an ``attention_mask``.

This module needs only torch (the model is called, not imported).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from ..errors import InvalidArgumentError
from .collator import IGNORE_INDEX, PackedBatchError, PackedCollator, _split_bins

__all__ = ["MultimodalPackedCollator", "TOKEN_KEYS", "image_layout", "is_multimodal_sample", "mrope_positions",
           "rope_index_fn"]

#: keys with one entry per token: sliced and concatenated exactly like ``input_ids``
TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")
#: per-image keys of the flattened-patch ("grid") layout, concatenated along dim 0
GRID_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
#: per-image keys of the per-image layout, concatenated along dim 0
PER_IMAGE_KEYS = ("pixel_values", "image_sizes", "image_position_ids")
#: per-image keys of the per-sample stack layout
STACK_KEYS = ("pixel_values", "pixel_attention_mask")
#: keys a sample may carry that the packed batch does not need (checked, then dropped)
_DROPPED = ("attention_mask", "length")

_IMAGE_MARKERS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")

Layout = Literal["grid", "stack", "per_image", "text"]


def is_multimodal_sample(sample: Mapping[str, Any]) -> bool:
    """Whether a sample carries image inputs or a multimodal token-type key (so it needs this packer). A
    ``token_type_ids`` alone is not one: text tokenizers (BERT-style) give segment ids under that name; Gemma 3's
    image samples carry ``pixel_values`` beside it, and its text-only samples pack as text.

    >>> is_multimodal_sample({"input_ids": [1], "pixel_values": torch.zeros(1, 3, 2, 2)}), is_multimodal_sample({"input_ids": [1]})
    (True, False)
    >>> is_multimodal_sample({"input_ids": [1, 2], "token_type_ids": [0, 0]})
    False
    """
    return any(k in sample for k in _IMAGE_MARKERS + ("mm_token_type_ids", "pixel_attention_mask"))


def image_layout(sample: Mapping[str, Any]) -> Layout:
    """The per-image layout of one sample, from its keys and shapes (see the module docstring).

    >>> image_layout({"pixel_values": torch.zeros(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])})
    'grid'
    >>> image_layout({"pixel_values": torch.zeros(1, 2, 3, 8, 8), "pixel_attention_mask": torch.ones(1, 2, 8, 8)})
    'stack'
    >>> image_layout({"pixel_values": torch.zeros(2, 3, 8, 8)}), image_layout({"input_ids": [1, 2]})
    ('per_image', 'text')
    """
    if any(k in sample for k in ("image_grid_thw", "video_grid_thw")):
        return "grid"
    if "pixel_attention_mask" in sample:
        return "stack"
    pv = sample.get("pixel_values")
    if pv is None:
        return "text"
    if torch.as_tensor(pv).dim() == 5:
        return "stack"
    return "per_image"


def _tensor(value: Any, key: str, where: str) -> torch.Tensor:
    try:
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise PackedBatchError(f"{where}: key {key!r} is not a tensor or array ({type(value).__name__}: {e})") from e


def _tokens(value: Any, key: str, where: str) -> torch.Tensor:
    t = _tensor(value, key, where)
    if t.dim() == 2 and t.shape[0] == 1:  # a processor's batch of one
        t = t[0]
    if t.dim() != 1:
        raise PackedBatchError(f"{where}: {key!r} must hold one unpadded sample (1-D, or [1, n]), got shape "
                               f"{tuple(t.shape)}; call the processor on one sample at a time")
    return t.long()


# --------------------------------------------------------------------------------------------- rope index
def _find_rope_index(model: Any) -> Callable | None:
    """The model's own rope-index function: the first module (the model itself, then its children in order) with a
    callable ``get_rope_index``."""
    fn = getattr(model, "get_rope_index", None)
    if callable(fn):
        return fn
    modules = model.modules() if hasattr(model, "modules") else ()
    for m in modules:
        fn = getattr(m, "get_rope_index", None)
        if callable(fn):
            return fn
    return None


def rope_index_fn(model: Any) -> Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None:
    """The model's own rope-index function, called on ONE document: ``fn(doc) -> LongTensor [3, n]`` (the mRoPE
    positions of that document, starting at 0, from only its own grids); ``None`` when the model has no
    ``get_rope_index`` (not an mRoPE family: restarted 2-D positions are its packed layout).

    ``doc`` holds that document's 1-D ``input_ids``, ``mm_token_type_ids`` (derived from the config's image / video
    token ids where the sample has none) and its own ``image_grid_thw`` / ``video_grid_thw`` / ``second_per_grid_ts``.
    The call is made with the keywords the function's signature names (transformers 5.x: ``mm_token_type_ids``
    required; 4.57: the image tokens found from ``input_ids``), with no ``attention_mask`` (the document is unpadded).
    A document without vision tokens gets ``arange(n)`` on the 3 rows, what the model computes for it alone.
    """
    fn = _find_rope_index(model)
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C function: call with the 5.x keywords
        params = {}
    names = set(params)
    config = getattr(model, "config", None)
    image_token = getattr(config, "image_token_id", None)
    video_token = getattr(config, "video_token_id", None)
    cls = type(model).__name__

    def per_document(doc: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = doc["input_ids"]
        n = ids.numel()
        mm = doc.get("mm_token_type_ids")
        if mm is None:
            mm = torch.zeros_like(ids)
            if image_token is not None:
                mm = mm.masked_fill(ids == int(image_token), 1)
            if video_token is not None:
                mm = mm.masked_fill(ids == int(video_token), 2)
        grids = {k: doc[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if doc.get(k) is not None}
        if not bool((mm != 0).any()) or not any(k in grids for k in ("image_grid_thw", "video_grid_thw")):
            return torch.arange(n, dtype=torch.long).expand(3, n).clone()
        device = ids.device
        kwargs: dict[str, Any] = {}
        for k, v in grids.items():
            if not names or k in names:
                kwargs[k] = v
        if not names or "mm_token_type_ids" in names:
            kwargs["mm_token_type_ids"] = mm[None].to(device)
        if "attention_mask" in names or not names:
            kwargs["attention_mask"] = None
        try:
            out = fn(ids[None], **kwargs)
        except TypeError as e:
            raise PackedBatchError(
                f"{cls}.get_rope_index could not be called per document ({e}); its signature "
                f"({', '.join(params) or 'unknown'}) is neither transformers 5.x's (input_ids, mm_token_type_ids, "
                "image_grid_thw, ...) nor 4.57's; pack this model unpacked (packing.enabled: false)") from e
        pos = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(pos, torch.Tensor) or pos.dim() != 3 or pos.shape[0] != 3 or pos.shape[-1] != n:
            shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise PackedBatchError(f"{cls}.get_rope_index returned positions of shape {shape} for a document of {n} "
                                   "tokens, not [3, 1, n]; cannot build the 4-row packed positions")
        return pos[:, 0].to("cpu", torch.long)

    per_document.model_class = cls  # type: ignore[attr-defined]
    return per_document


def mrope_positions(docs: Sequence[Mapping[str, torch.Tensor]], rope_fn: Callable, text_start: int = 0) -> torch.Tensor:
    """``[4, T]`` positions of documents back to back: row 0 ``arange`` restarted per document, rows 1-3 each
    document's own rope index (``rope_fn`` called once per document, with only its own grids).

    >>> fake = lambda doc: torch.arange(doc["input_ids"].numel()).expand(3, -1) * 10
    >>> mrope_positions([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3])}], fake).tolist()
    [[0, 1, 0], [0, 10, 0], [0, 10, 0], [0, 10, 0]]
    """
    parts = []
    for doc in docs:
        n = doc["input_ids"].numel()
        parts.append(torch.cat([torch.arange(text_start, text_start + n).view(1, n), rope_fn(doc)], 0))
    return torch.cat(parts, 1)


# --------------------------------------------------------------------------------------------- samples
class _Doc(dict):
    """One normalized document: 1-D token-axis tensors, per-image tensors, its layout."""

    layout: Layout = "text"
    n_images: int = 0


def _normalize(sample: Mapping[str, Any], where: str, label_pad_id: int) -> _Doc:
    if "input_ids" not in sample:
        raise PackedBatchError(f"{where}: no 'input_ids' key (keys: {sorted(sample)})")
    if sample.get("seq_lengths") is not None:
        raise PackedBatchError(
            f"{where}: key 'seq_lengths': an already packed multimodal sample cannot be split back into its "
            "documents' images; give one processed sample per document (the packer packs them)")
    doc = _Doc()
    ids = _tokens(sample["input_ids"], "input_ids", where)
    n = ids.numel()
    if n == 0:
        raise PackedBatchError(f"{where}: empty sample (0 input_ids); drop empty samples before packing")
    doc["input_ids"] = ids
    for key in TOKEN_KEYS[1:]:
        if sample.get(key) is not None:
            t = _tokens(sample[key], key, where)
            if t.numel() != n:
                raise PackedBatchError(f"{where}: {key!r} has {t.numel()} entries but input_ids has {n}; token-axis "
                                       "keys must be sliced exactly like input_ids (a truncation that cut only one of them)")
            doc[key] = t
    if sample.get("attention_mask") is not None:
        m = _tensor(sample["attention_mask"], "attention_mask", where).reshape(-1)
        if m.numel() != n or not bool((m != 0).all()):
            raise PackedBatchError(f"{where}: attention_mask has zeros or a different length than input_ids; packed "
                                   "samples must be unpadded (strip the padding before packing)")
    pos = sample.get("position_ids")
    if pos is not None:
        raise PackedBatchError(
            f"{where}: key 'position_ids': a multimodal sample's positions are rebuilt per document by the packer "
            "(the model's rope index for mRoPE families); drop the column")
    layout = image_layout(sample)
    doc.layout = layout
    allowed = set(TOKEN_KEYS) | set(_DROPPED) | {"position_ids", "seq_lengths"}
    allowed |= set({"grid": GRID_KEYS, "stack": STACK_KEYS, "per_image": PER_IMAGE_KEYS, "text": ()}[layout])
    for key, value in sample.items():
        if key in allowed or value is None or isinstance(value, (str, bytes, int, float, bool)):
            continue
        raise PackedBatchError(
            f"{where}: key {key!r} is not a token-axis key ({', '.join(TOKEN_KEYS)}) nor a per-image key of its "
            f"image layout {layout!r}, so the packer cannot tell how to concatenate it; drop it from the sample "
            "(remove_unused_columns) or pack this dataset unpacked")
    if layout == "grid":
        for key in GRID_KEYS:
            if sample.get(key) is not None:
                t = _tensor(sample[key], key, where)
                if key in ("image_grid_thw", "video_grid_thw") and t.dim() == 1:
                    t = t.view(1, -1)
                if key == "second_per_grid_ts":
                    t = t.reshape(-1)
                doc[key] = t
        for pv, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if (pv in doc) != (grid in doc):
                raise PackedBatchError(f"{where}: {pv!r} without {grid!r} (or the reverse); the grid layout needs both")
            if pv in doc and int(doc[grid].prod(-1).sum()) != doc[pv].shape[0]:
                raise PackedBatchError(
                    f"{where}: {pv!r} has {doc[pv].shape[0]} patch rows but {grid!r} {doc[grid].tolist()} accounts "
                    f"for {int(doc[grid].prod(-1).sum())}; patches and grids must come from the same processor call")
        doc.n_images = int(doc["image_grid_thw"].shape[0]) if "image_grid_thw" in doc else 0
        mm = doc.get("mm_token_type_ids")
        if mm is not None:
            for kind, grid in ((1, "image_grid_thw"), (2, "video_grid_thw")):
                runs = _runs(mm == kind)
                have = int(doc[grid].shape[0]) if grid in doc else 0
                if len(runs) != have:
                    raise PackedBatchError(
                        f"{where}: {len(runs)} {'image' if kind == 1 else 'video'} placeholder run(s) in "
                        f"mm_token_type_ids but {have} {grid} row(s): a placeholder run was cut (truncation) or an "
                        "image belongs to another sample; re-process the sample without truncating inside it")
    elif layout == "stack":
        pv = _tensor(sample["pixel_values"], "pixel_values", where)
        if pv.dim() == 5:
            if pv.shape[0] != 1:
                raise PackedBatchError(f"{where}: pixel_values of shape {tuple(pv.shape)}: a per-sample stack must be "
                                       "[1, images, C, H, W] or [images, C, H, W] (one sample)")
            pv = pv[0]
        if pv.dim() != 4:
            raise PackedBatchError(f"{where}: pixel_values of shape {tuple(pv.shape)}; the stack layout needs "
                                   "[images, C, H, W]")
        pam = sample.get("pixel_attention_mask")
        if pam is None:
            pam = torch.ones(pv.shape[0], *pv.shape[-2:], dtype=torch.bool)
        pam = _tensor(pam, "pixel_attention_mask", where)
        if pam.dim() == 4 and pam.shape[0] == 1:
            pam = pam[0]
        if tuple(pam.shape) != (pv.shape[0], *pv.shape[-2:]):
            raise PackedBatchError(f"{where}: pixel_attention_mask of shape {tuple(pam.shape)} does not match "
                                   f"pixel_values {tuple(pv.shape)} ([images, H, W] expected)")
        # all-zero images are the processor's own padding (the model drops them): keep only the real ones
        real = (pv != 0).flatten(1).any(1)
        doc["pixel_values"], doc["pixel_attention_mask"] = pv[real], pam[real]
        doc.n_images = int(real.sum())
    elif layout == "per_image":
        for key in PER_IMAGE_KEYS:
            if sample.get(key) is not None:
                doc[key] = _tensor(sample[key], key, where)
        pv = doc["pixel_values"]
        if pv.dim() == 5 and pv.shape[0] == 1:
            doc["pixel_values"] = pv = pv[0]
        doc.n_images = int(pv.shape[0])
        tt = doc.get("token_type_ids")
        if tt is not None:
            runs = _runs(tt == 1)
            if runs and len(runs) != doc.n_images:
                raise PackedBatchError(
                    f"{where}: {len(runs)} image placeholder run(s) in token_type_ids but {doc.n_images} image(s) in "
                    "pixel_values: a placeholder run was cut (truncation) or an image belongs to another sample")
    labels = doc.get("labels")
    if labels is not None:
        bad = (labels < 0) & (labels != label_pad_id)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise PackedBatchError(f"{where}: labels[{at}] = {int(labels[at])}: a label is a token id >= 0 or the "
                                   f"ignore index {label_pad_id}")
    return doc


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of True."""
    f = flags.to(torch.int8)
    edges = torch.diff(f, prepend=f.new_zeros(1), append=f.new_zeros(1))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


# --------------------------------------------------------------------------------------------- collator
class MultimodalPackedCollator:
    """Collate bins of multimodal samples (see the module docstring) into padding-free model inputs.

    Args:
        rope_fn: the per-document rope index (:func:`rope_index_fn` of the model); given, ``position_ids`` are
            ``[4, rows, T]`` (row 0 the per-document ``arange``); ``None``: restarted ``[rows, T]`` positions.
        mode, max_tokens, pad_token_id, label_pad_id, pad_to_multiple_of, return_seq_idx: as
            :class:`~hf_gradfix.packing.collator.PackedCollator` (which lays out the text part: labels
            ``label_pad_id`` at every document start, ``cu_seq_lens_q/k`` and ``max_length_q/k`` in varlen mode).

    Token-axis keys are concatenated in the order of ``input_ids`` (padding: ``mm_token_type_ids`` /
    ``token_type_ids`` 0); per-image keys in the same document order. All samples of a batch must share one image
    layout (text-only samples fit any). Never an ``attention_mask``. ``image_rows="alone"``: every image document gets
    a row of its own and the bin's text-only documents share one (rows mode, tail-padded), for a family whose
    image-token mask does not follow restarted positions (see :mod:`hf_gradfix.packing.multimodal_guard`).

    >>> c = MultimodalPackedCollator()
    >>> b = c([{"input_ids": [5, 6, 7], "token_type_ids": [0, 1, 0], "pixel_values": torch.zeros(1, 3, 2, 2) + 1},
    ...        {"input_ids": [8, 9], "token_type_ids": [0, 0]}])
    >>> b["position_ids"].tolist(), b["token_type_ids"].tolist(), tuple(b["pixel_values"].shape)
    ([[0, 1, 2, 0, 1]], [[0, 1, 0, 0, 0]], (1, 3, 2, 2))
    """

    def __init__(
        self,
        rope_fn: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
        mode: Literal["varlen", "rows"] = "varlen",
        *,
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        label_pad_id: int = IGNORE_INDEX,
        pad_to_multiple_of: int | None = None,
        return_seq_idx: bool = False,
        image_rows: Literal["shared", "alone"] = "shared",
    ) -> None:
        if rope_fn is not None and not callable(rope_fn):
            raise InvalidArgumentError(f"MultimodalPackedCollator: rope_fn must be callable or None, got {rope_fn!r}")
        if image_rows not in ("shared", "alone"):
            raise InvalidArgumentError(f"MultimodalPackedCollator: image_rows must be 'shared' or 'alone', got {image_rows!r}")
        common = dict(max_tokens=max_tokens, pad_token_id=pad_token_id, label_pad_id=label_pad_id,
                      pad_to_multiple_of=pad_to_multiple_of, return_seq_idx=return_seq_idx)
        self.text = PackedCollator(mode, **common)
        # image_rows="alone" (a family whose image-token mask does not follow restarted positions, measured by
        # multimodal_guard): every image document in a row of its own, first in it; the text-only documents of the
        # bin share one row; the rows tail-padded ("rows" mode: no cu_seq_lens)
        self.split_text = PackedCollator("rows", **common)
        self.rope_fn = rope_fn
        self.mode = mode
        self.image_rows = image_rows
        self.label_pad_id = label_pad_id

    def __repr__(self) -> str:
        return (f"MultimodalPackedCollator(rope_fn={'yes' if self.rope_fn else None}, image_rows={self.image_rows!r}, "
                f"{self.text!r})")

    def __call__(self, samples: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
        bins = _split_bins(samples)
        docs = [[_normalize(s, f"sample {j}" if len(bins) == 1 else f"bin {b}, sample {j}", self.label_pad_id)
                 for j, s in enumerate(bin_)] for b, bin_ in enumerate(bins)]
        mode, text = self.mode, self.text
        if self.image_rows == "alone" and any(d.n_images for row in docs for d in row):
            split: list[list[_Doc]] = []
            for row in docs:
                plain = [d for d in row if not d.n_images]
                split.extend([d] for d in row if d.n_images)
                if plain:
                    split.append(plain)
            docs, mode, text = split, "rows", self.split_text
        layouts = {d.layout for row in docs for d in row} - {"text"}
        if len(layouts) > 1:
            raise PackedBatchError(f"a packed batch mixes image layouts {sorted(layouts)}; every sample must come from "
                                   "the same model's processor")
        layout = layouts.pop() if layouts else "text"
        batch = text([[{k: d[k] for k in ("input_ids", "labels") if k in d} for d in row] for row in docs])
        rows, T = batch["input_ids"].shape
        if mode == "varlen":
            docs = [[d for row in docs for d in row]]
        for key in TOKEN_KEYS[2:]:
            present = [key in d for row in docs for d in row]
            if not any(present):
                continue
            if not all(present):
                raise PackedBatchError(f"{key!r} is in some samples of the batch and not in others; a processor "
                                       "gives it to every sample (text-only ones too)")
            out = torch.zeros(rows, T, dtype=torch.long)
            for r, row in enumerate(docs):
                out[r, : sum(d[key].numel() for d in row)] = torch.cat([d[key] for d in row])
            batch[key] = out
        if self.rope_fn is not None:
            text_pos = batch["position_ids"]
            pos = torch.empty(4, rows, T, dtype=torch.long)
            pos[0] = text_pos
            for r, row in enumerate(docs):
                n = sum(d["input_ids"].numel() for d in row)
                pos[1:, r, :n] = mrope_positions(row, self.rope_fn)[1:]
                pos[1:, r, n:] = text_pos[r, n:]  # padding: its own restarted segment, as row 0
            batch["position_ids"] = pos
        if layout in ("stack", "per_image"):
            # a per-image / per-sample model may hand the forward's keyword arguments on to its vision tower
            # (LLaVA's get_image_features passes **kwargs: measured in tests/packing/test_packing_vlm.py), whose varlen
            # attention would read the text row's boundaries as its own and fail; restarted positions alone delimit the documents (transformers builds the packed mask, or
            # FlashAttention's boundaries via prepare_fa_kwargs_from_position_ids). The grid tower pops them itself.
            for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                batch.pop(key, None)
        batch.update(_images(docs, layout))
        return batch


def _images(docs: list[list[_Doc]], layout: Layout) -> dict[str, torch.Tensor]:
    """The per-image keys of every document, in row then document order, in the family's layout."""
    flat = [d for row in docs for d in row]
    out: dict[str, torch.Tensor] = {}
    if layout in ("grid", "per_image"):
        keys = GRID_KEYS if layout == "grid" else PER_IMAGE_KEYS
        for key in keys:
            have = [d[key] for d in flat if key in d]
            if have:
                out[key] = torch.cat(have, 0)
        return out
    if layout == "stack":
        with_images = [d for d in flat if d.n_images]
        if not with_images:
            return out
        ref = with_images[0]["pixel_values"]
        C = ref.shape[1]
        H = max(d["pixel_values"].shape[2] for d in with_images)
        W = max(d["pixel_values"].shape[3] for d in with_images)
        N = max(sum(d.n_images for d in row) for row in docs)
        pv = torch.zeros(len(docs), N, C, H, W, dtype=ref.dtype)
        pam = torch.zeros(len(docs), N, H, W, dtype=with_images[0]["pixel_attention_mask"].dtype)
        for r, row in enumerate(docs):
            at = 0
            for d in row:
                k = d.n_images
                if k:
                    h, w = d["pixel_values"].shape[2:]
                    pv[r, at:at + k, :, :h, :w] = d["pixel_values"]
                    pam[r, at:at + k, :h, :w] = d["pixel_attention_mask"]
                    at += k
        out["pixel_values"], out["pixel_attention_mask"] = pv, pam
    return out
