"""Padding-free packing: bin packing, a rank-balanced batch sampler, an online packer for streams, up-front
dataset validation, a varlen collator (and its vision-language form, ``multimodal``), varlen attention (torch's own FlashAttention kernel, and a reference for
CPU), and a guard that refuses models which mix packed sequences.

``binpack``, ``sampler``, ``stream``, ``validate`` and ``collator`` need only torch/numpy; ``attention`` and
``guard`` import transformers and are loaded on first use.

>>> from hf_gradfix.packing import pack
>>> [sorted(b) for b in pack([5, 3, 4], budget=8)]
[[0, 1], [2]]
"""

from __future__ import annotations

from .binpack import pack
from .collator import PackedBatchError, PackedCollator, check_packed_batch
from .multimodal import MultimodalPackedCollator, rope_index_fn
from .sampler import PackedBatchSampler
from .stream import StreamingPacker
from .validate import PackedDataError, validate_packing_dataset


def __getattr__(name: str):
    if name in ("register_reference_varlen_attention", "register_torch_varlen_attention", "select_varlen_attention",
                "set_attention_implementation", "REFERENCE_VARLEN_ATTENTION", "TORCH_VARLEN_ATTENTION"):
        from . import attention

        return getattr(attention, name)
    if name in ("check_model_packs_correctly", "PackingCheckError", "probe_lengths"):
        from . import guard

        return getattr(guard, name)
    if name in ("check_vlm_packs_correctly", "VLMPackingPlan"):
        from . import multimodal_guard

        return getattr(multimodal_guard, name)
    raise AttributeError(f"module 'hf_gradfix.packing' has no attribute {name!r}")


__all__ = [
    "PackedBatchError",
    "PackedBatchSampler",
    "PackedDataError",
    "StreamingPacker",
    "validate_packing_dataset",
    "PackedCollator",
    "MultimodalPackedCollator",
    "rope_index_fn",
    "check_vlm_packs_correctly",
    "VLMPackingPlan",
    "check_packed_batch",
    "pack",
    "register_reference_varlen_attention",
    "register_torch_varlen_attention",
    "select_varlen_attention",
    "set_attention_implementation",
    "check_model_packs_correctly",
    "PackingCheckError",
    "probe_lengths",
]
