"""The packing guard for vision-language models: measured on the user's model with the user's own samples, decided
by the structure of the packed row (which documents share it), before any step.

A VLM packs correctly only if every document of a packed row computes what it computes alone: its text positions must
isolate the documents (mRoPE families read isolation only from row 0 of 4-row positions), its images must be the
document's own, and any image-token attention mask (Gemma 3's bidirectional ``token_type_ids`` mask) must follow the
restarted positions. :func:`check_vlm_packs_correctly` runs three probes built by
:class:`~hf_gradfix.packing.multimodal.MultimodalPackedCollator` exactly as in training, each against the documents
run alone (batch of one, their own images, the model's own positions):

1. a mixed row: a text-only document first (where the data has one), then image documents and text documents, so
   that image documents sit after another document; plus a leak probe (document k perturbed, k+1 must not move);
2. if that fails: the same documents laid out with every image document in a row of its own (first in it) and the
   text-only documents sharing a row (the collator's ``image_rows="alone"``).

Outcome (:class:`VLMPackingPlan`): ``"shared"`` (1 passed: pack freely), ``"alone"`` (2 passed: every image document
gets a row of its own, text-only documents are packed; the plan's ``reason`` is the one line that says why), or
:class:`~hf_gradfix.packing.guard.PackingCheckError` naming the family and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

from ..probe_mode import probe_mode
from .guard import PackingCheckError
from .multimodal import MultimodalPackedCollator, _normalize, rope_index_fn

__all__ = ["VLMPackingPlan", "check_vlm_packs_correctly", "has_images", "model_family"]


@dataclass
class VLMPackingPlan:
    """What :func:`check_vlm_packs_correctly` measured and decided.

    >>> VLMPackingPlan("Gemma3ForConditionalGeneration (gemma3)", "shared", None, 1e-7).packs_images_together
    True
    """

    family: str
    image_rows: Literal["shared", "alone"]
    reason: str | None
    max_diff: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def packs_images_together(self) -> bool:
        return self.image_rows == "shared"


def model_family(model: Any) -> str:
    """``Class (model_type)``: how the guard's lines name a model."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} ({mt})" if mt else type(model).__name__


def has_images(sample: Any) -> bool:
    """Whether a processed sample holds at least one image or video (a non-empty pixel tensor).

    >>> has_images({"input_ids": [1], "pixel_values": torch.zeros(0, 3, 2, 2)}), has_images({"input_ids": [1]})
    (False, False)
    """
    for key in ("pixel_values", "pixel_values_videos"):
        v = sample.get(key) if hasattr(sample, "get") else None
        if v is not None and torch.as_tensor(v).numel() > 0:
            return True
    return False


def _device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _alone_inputs(doc: dict, stack: bool) -> dict:
    """A normalized document as a batch of one, as unpacked training runs it (no mask, the model's own positions)."""
    out = {}
    for k, v in doc.items():
        if k == "labels":
            continue
        if k in ("input_ids", "mm_token_type_ids", "token_type_ids"):
            out[k] = v.view(1, -1)
        elif stack and k in ("pixel_values", "pixel_attention_mask"):
            out[k] = v[None]
        else:
            out[k] = v
    return out


def _logits(model, inputs: dict, device) -> torch.Tensor:
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out = model(**inputs, use_cache=False)
    t = getattr(out, "logits", None)
    if t is None:
        t = out[0]
    return t.float()


def _probe_docs(samples: Sequence[dict]) -> tuple[list[int], list[int]]:
    """(image sample indices, text-only sample indices) among ``samples``."""
    img = [i for i, s in enumerate(samples) if has_images(s)]
    txt = [i for i, s in enumerate(samples) if not has_images(s)]
    return img, txt


def check_vlm_packs_correctly(
    model: torch.nn.Module,
    samples: Sequence[dict],
    *,
    pad_token_id: int = 0,
    tolerance: float = 1e-4,
    max_probe_documents: int = 4,
    raise_on_failure: bool = True,
) -> VLMPackingPlan:
    """Probe ``model`` on packed rows of ``samples`` (processed samples from the training data) against each document
    alone; return the :class:`VLMPackingPlan` or raise :class:`PackingCheckError` (one line: the family, the reason,
    the numbers, the fix). ``tolerance``: max |packed - alone| / max(1, max |alone|) over the probed documents.
    Sets ``use_cache = False`` on the model's (and its text model's) config."""
    family = model_family(model)
    for cfg in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    img, txt = _probe_docs(samples)
    if not img:
        raise PackingCheckError(f"{family}: the VLM packing probe needs at least one training sample with an image "
                                f"among the {len(samples)} it was given; none has pixel_values")
    # a mixed row: text first (where there is text), image documents after it, text between and after them
    order: list[int] = []
    pool_t, pool_i = list(txt), list(img)
    while len(order) < max_probe_documents and (pool_t or pool_i):
        if pool_t and (not order or not pool_i or len(order) % 2 == 0):
            order.append(pool_t.pop(0))
        elif pool_i:
            order.append(pool_i.pop(0))
    if len(order) < 2:
        order = (img + txt)[:2]
    if len(order) < 2:
        raise PackingCheckError(f"{family}: the VLM packing probe needs at least two training samples, got "
                                f"{len(samples)}")
    rope = rope_index_fn(model)
    collator = MultimodalPackedCollator(rope, pad_token_id=pad_token_id)
    docs = {i: _normalize(samples[i], f"probe sample {i}", -100) for i in order}
    stack = any(d.layout == "stack" for d in docs.values())
    device = _device(model)
    details: dict[str, Any] = {"probe_order": order, "rope_index": rope is not None}

    split_collator = MultimodalPackedCollator(rope, pad_token_id=pad_token_id, image_rows="alone")

    def row(indices: list[int], poke: int | None = None, split: bool = False) -> list[torch.Tensor]:
        """Logits of each document of the packed row ``indices`` (in that order), as the collator lays it out."""
        batch_docs = [dict(docs[i]) for i in indices]
        if poke is not None:
            d = batch_docs[poke]
            g = torch.Generator().manual_seed(poke)
            if "pixel_values" in d and d["pixel_values"].numel():
                noise = torch.randn(d["pixel_values"].shape, generator=g).to(d["pixel_values"].dtype)
                d["pixel_values"] = d["pixel_values"] + noise * (0.5 * float(d["pixel_values"].abs().max()) + 0.5)
        batch = (split_collator if split else collator)([dict(d) for d in batch_docs])
        batch.pop("labels")
        out = _logits(model, batch, device)
        # where each document lands: one row in order, or (split) image documents a row each, then the text ones
        rows = [list(range(len(indices)))]
        if split and any(docs[i].n_images for i in indices):
            rows = [[k] for k, i in enumerate(indices) if docs[i].n_images]
            plain = [k for k, i in enumerate(indices) if not docs[i].n_images]
            rows += [plain] if plain else []
        pieces: list[torch.Tensor] = [None] * len(indices)  # type: ignore[list-item]
        for r, members in enumerate(rows):
            at = 0
            for k in members:
                n = batch_docs[k]["input_ids"].numel()
                pieces[k] = out[r, at:at + n]
                at += n
        return pieces

    with probe_mode(model), torch.no_grad():
        alone = {i: _logits(model, _alone_inputs(docs[i], stack), device)[0] for i in order}
        scale = max(1.0, max(float(a.abs().max()) for a in alone.values()))
        tol = tolerance * scale

        def diffs(indices: list[int], split: bool = False) -> list[float]:
            try:
                pieces = row(indices, split=split)
            except Exception as e:  # noqa: BLE001 - a model that cannot run the packed row: refused in one line
                first = str(e).splitlines()[0][:200] if str(e) else ""
                raise PackingCheckError(
                    f"{family} cannot be trained on packed multimodal rows: it raised {type(e).__name__} on a packed "
                    f"row ({first}). Train it unpacked (packing.enabled: false).") from e
            return [float((p - alone[i]).abs().max()) for p, i in zip(pieces, indices)]

        mixed = diffs(order)
        details["mixed_row_diffs"] = dict(zip(order, mixed))
        leak = 0.0
        poke_at = next((k for k, i in enumerate(order[:-1]) if i in img), None)
        if poke_at is not None and max(mixed) <= tol:
            base, poked = row(order), row(order, poke=poke_at)
            leak = max(float((b - p).abs().max()) for b, p in zip(base[poke_at + 1:], poked[poke_at + 1:]))
            details["leak_probe"] = leak
        if max(mixed) <= tol and leak <= tol:
            return VLMPackingPlan(family, "shared", None, max(mixed), details)
        # 2. the same documents with every image document in a row of its own (first in it), the text-only ones
        # sharing a row: the collator's image_rows="alone" layout, as training would run it
        split = diffs(order, split=True)
        details["split_row_diffs"] = dict(zip(order, split))
    worst = max(mixed) if leak <= tol else leak
    where = ", ".join(f"document {k} ({'image' if i in img else 'text'}): {mixed[k]:.3g}"
                      for k, i in enumerate(order) if mixed[k] > tol) or f"leak probe {leak:.3g}"
    mask = "token_type_ids" in docs[order[0]] or any("token_type_ids" in d for d in docs.values())
    text_cfg = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    sliding = "sliding_attention" in (getattr(text_cfg, "layer_types", None) or ())
    cause = ("its image-token attention mask (token_type_ids, bidirectional over each image)"
             + (" on its sliding-window layers" if sliding else "") + " does not follow the restarted positions"
             if mask else "its packed documents do not stay apart (text positions that do not isolate, or images "
                          "read across documents)")
    if max(split) <= tol:
        reason = (f"{family}: a packed row that holds an image document and other documents differs from the "
                  f"documents alone ({where}; tolerance {tol:.3g}): {cause}; so every image document gets a row of its "
                  "own and text-only documents are packed together (measured exact on this model)")
        details["reason"] = reason
        return VLMPackingPlan(family, "alone", reason, worst, details)
    msg = (f"{family} cannot be trained on packed multimodal rows: {cause} ({where}; even an image document alone in a "
           f"row differs by {max(split):.3g} > {tol:.3g}). Train it unpacked (packing.enabled: false).")
    if raise_on_failure:
        err = PackingCheckError(msg)
        err.report = details  # type: ignore[attr-defined]
        raise err
    return VLMPackingPlan(family, "alone", msg, worst, details)
