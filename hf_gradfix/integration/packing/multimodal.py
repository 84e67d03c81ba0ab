"""Packing glue for vision-language datasets, inside ``transformers.Trainer`` and TRL's ``SFTTrainer`` vision path.

Reached from :mod:`hf_gradfix.integration.packing.trainer` when ``packing.enabled`` and the train dataset is a vision
dataset:

- processed samples (``input_ids`` plus image keys or a multimodal token-type key, one processor call per sample):
  packed as they are;
- TRL's raw vision samples (``images`` / ``image`` with ``messages`` or ``prompt``/``completion``; ``SFTTrainer`` keeps
  them raw and processes them in its ``DataCollatorForVisionLanguageModeling``): every sample goes through the
  trainer's own collator ALONE (its chat template, its completion-only / assistant-only labels, no padding), then is
  packed. Users keep ``SFTTrainer`` and leave ``SFTConfig(packing=False, padding_free=False)`` (TRL refuses both for
  vision datasets); hf_gradfix's ``packing.enabled`` does the packing.

The model side: the guard (:func:`~hf_gradfix.packing.multimodal_guard.check_vlm_packs_correctly`) on the first
samples of the data, whose plan ("shared" rows, or every image document in a row of its own) the collator follows; the
model's attention implementation is kept (the guard measured it), the rope index is the model's own.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger("hf_gradfix")

_PLANS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_VIEWS: "weakref.WeakKeyDictionary[Any, tuple[Any, Any]]" = weakref.WeakKeyDictionary()
_IS_VISION: "weakref.WeakKeyDictionary[Any, tuple[Any, bool]]" = weakref.WeakKeyDictionary()
_PROBE_SAMPLES = 16  # samples the guard probes (image and text-only ones, from the first _SCAN)
_SCAN = 64  # samples read to tell a vision dataset (text-only samples of some families carry no image key)


def _head(dataset: Any, n: int) -> list:
    """The first ``n`` samples (map-style or a stream); [] where the dataset cannot be read."""
    try:
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            return [dataset[i] for i in range(min(n, len(dataset)))]
        out = []
        for s in dataset:
            out.append(s)
            if len(out) >= n:
                break
        return out
    except Exception:  # noqa: BLE001 - an unreadable dataset: the packing path's own checks say why
        return []


def _first(dataset: Any) -> Any:
    head = _head(dataset, 1)
    return head[0] if head else None


def _is_raw_vision(sample: Any, trainer) -> bool:
    """TRL's raw vision sample, processed by the trainer's collator (which holds the processor)."""
    return (isinstance(sample, Mapping) and "input_ids" not in sample and ("images" in sample or "image" in sample)
            and getattr(trainer.data_collator, "processor", None) is not None)


def is_vision_dataset(trainer) -> bool:
    """Whether the train dataset is a vision dataset this glue packs (processed multimodal samples, or TRL's raw
    vision samples with TRL's vision collator)."""
    from ...packing.multimodal import is_multimodal_sample

    dataset = trainer.train_dataset
    cached = _IS_VISION.get(trainer)
    if cached is not None and cached[0] is dataset:
        return cached[1]
    answer = any(isinstance(s, Mapping) and (is_multimodal_sample(s) or _is_raw_vision(s, trainer))
                 for s in _head(dataset, _SCAN))
    _IS_VISION[trainer] = (dataset, answer)
    return answer


def _one(trainer, raw: Mapping) -> dict:
    """One raw TRL vision sample through the trainer's own collator, alone: an unpadded processed sample."""
    batch = trainer.data_collator([raw])
    out: dict = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            continue
        if k in ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "token_type_ids"):
            if v.dim() == 2 and v.shape[0] == 1:
                v = v[0]
            if k == "attention_mask":
                continue
        out[k] = v
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):  # padding: cut it (the collator pads right)
        keep = mask.reshape(-1).bool()
        for k in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids"):
            if k in out:
                out[k] = out[k][keep]
    return out


class _ProcessedView(torch.utils.data.Dataset):
    """A raw TRL vision dataset as processed samples (map-style, processed on access)."""

    def __init__(self, dataset, trainer) -> None:
        self.dataset = dataset
        self._trainer = weakref.ref(trainer)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return _one(self._trainer(), self.dataset[i])


class _ProcessedStream(torch.utils.data.IterableDataset):
    """A raw TRL vision stream as processed samples."""

    def __init__(self, dataset, trainer) -> None:
        super().__init__()
        self.dataset = dataset
        self._trainer = weakref.ref(trainer)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        trainer = self._trainer()
        for raw in self.dataset:
            yield _one(trainer, raw)


def processed_dataset(trainer, dataset: Any) -> Any:
    """``dataset`` as processed samples: itself, or TRL's raw vision samples through the trainer's collator."""
    cached = _VIEWS.get(trainer)
    if cached is not None and cached[0] is dataset:
        return cached[1]
    view = dataset
    if _is_raw_vision(_first(dataset), trainer):
        stream = not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
        view = _ProcessedStream(dataset, trainer) if stream else _ProcessedView(dataset, trainer)
    _VIEWS[trainer] = (dataset, view)
    return view


def prepare_vlm_for_packing(trainer, cfg) -> str:
    """The VLM guard on the first samples of the training data; returns the fix-log line."""
    from ...packing.multimodal_guard import check_vlm_packs_correctly

    model = trainer.model
    from ...packing.multimodal_guard import has_images

    data = processed_dataset(trainer, trainer.train_dataset)
    head = _head(data, _SCAN)  # the probe: image samples first found, and text-only ones
    with_images = [s for s in head if has_images(s)][: _PROBE_SAMPLES // 2]
    samples = with_images + [s for s in head if not has_images(s)][: _PROBE_SAMPLES - len(with_images)]
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    line = f"packing: vision-language, {cfg.mode} mode, rows of <= {cfg.token_budget} tokens, attention {attention}"
    if not cfg.guard:
        logger.warning("hf_gradfix packing: packing.guard is false, so the VLM is not checked for mixing packed "
                       "documents; images are packed with other documents.")
        _PLANS[trainer] = "shared"
        return line + ", guard off"
    pad = _pad_id(model)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []), \
            trainer.accelerator.autocast():
        plan = check_vlm_packs_correctly(model, samples, pad_token_id=pad)
    _PLANS[trainer] = plan.image_rows
    if plan.image_rows == "alone":
        logger.warning("hf_gradfix packing: %s", plan.reason)
        return line + ", guard passed with every image document in a row of its own"
    return line + ", guard passed"


def _pad_id(model) -> int:
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int) and pad >= 0:
            return pad
    return 0


def vlm_collator(trainer, cfg, budget: int):
    """The multimodal collator for a vision dataset (the model's own rope index, the guard's plan); None otherwise."""
    if not is_vision_dataset(trainer):
        return None
    from ...packing.multimodal import MultimodalPackedCollator, rope_index_fn

    image_rows = _PLANS.get(trainer, "shared")
    return MultimodalPackedCollator(rope_index_fn(trainer.model), cfg.mode, max_tokens=budget,
                                    pad_token_id=_pad_id(trainer.model), image_rows=image_rows)
