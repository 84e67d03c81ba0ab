"""The vision tower in a plan: its activations at the planned image size and count, and the image tokens it adds.

A vision-language model's micro-batch runs two things the text trace (:mod:`.activations`) does not see: the vision
tower (and its projector) over every image of the micro-batch, whose saved tensors live from the step's start to the
very end of backward (the tower runs first, its backward last), and the image tokens each image expands into in the
text row (hundreds to thousands per image: a sample's real length is its text plus ``images x tokens_per_image``).

Both are *measured*, as the text activations are: the model is built from its config under ``FakeTensorMode``, the
images of one micro-batch go through the model's own ``get_image_features`` (tower + projector) at the planned size,
and every distinct storage autograd saves for backward is counted (parameters skipped); the image tokens per image
are the rows of the features it returns. The tower's input layout is read from its config, not from a list of
classes: a config with ``temporal_patch_size`` and ``spatial_merge_size`` (Qwen2/2.5/3-VL, GLM-4V) takes flattened
patches plus ``image_grid_thw`` at the given size (rounded to whole merged patches, as the image processor does);
any other tower takes ``[images, channels, S, S]`` at its config's ``image_size`` S (the processor resizes every
image to it: LLaVA, Gemma 3's SigLIP), so the given size does not change it. The data-dependent steps of a
flattened-patch tower (per-image rotary positions, windows, ``cu_seqlens``: ``.tolist()`` loops fake tensors cannot
run) are computed on real tensors first by transformers' own ``vision_utils`` helpers and handed to the tower as the
precomputed keyword arguments it pops.

:func:`vision_term` is what :func:`.estimate.estimate` adds (a separate, additive term): with full recomputation the
tower is checkpointed per block too (transformers' ``gradient_checkpointing_enable`` wraps the vision blocks), so it
keeps each block's input plus the largest block's saved tensors.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from .common import PlanError, _fmt, build_model_for_config

__all__ = ["VisionRun", "VisionTrace", "vision_config_of", "parse_image_size", "with_text_sizes",
           "trace_vision", "vision_term"]


@dataclass
class VisionRun:
    """The images of the planned run: each sample's ``images_per_sample`` images of ``height x width`` pixels;
    ``text_len``: text tokens per sample beside its image tokens (packed rows: how many samples share a row)."""

    height: int
    width: int
    images_per_sample: int = 1
    text_len: int | None = None

    def check(self) -> None:
        for key, value in (("--image-size", self.height), ("--image-size", self.width)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**16:
                raise PlanError(f"{key} {self.height}x{self.width}: invalid value; give HEIGHTxWIDTH in pixels, each a "
                                "whole number from 1 to 65536 (e.g. --image-size 448x448)")
        n = self.images_per_sample
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 4096:
            raise PlanError(f"--images-per-sample {n!r}: invalid value; it must be a whole number from 0 to 4096 "
                            "(0: text-only samples)")
        if self.text_len is not None and (isinstance(self.text_len, bool) or not isinstance(self.text_len, int)
                                          or not 0 <= self.text_len <= 2**24):
            raise PlanError(f"--text-len {self.text_len!r}: invalid value; it must be a whole number from 0 to 16777216 "
                            "(text tokens per sample beside its image tokens)")


def parse_image_size(text: str) -> tuple[int, int]:
    """``448x448`` / ``336X504`` / ``448`` (square) -> (height, width).

    >>> parse_image_size("336x504"), parse_image_size("448")
    ((336, 504), (448, 448))
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX\*]\s*(\d+))?\s*", str(text))
    if not m:
        raise PlanError(f"--image-size {text!r}: invalid value; give HEIGHTxWIDTH in pixels (e.g. --image-size 448x448, "
                        "or 448 for a square image)")
    h = int(m.group(1))
    w = int(m.group(2)) if m.group(2) is not None else h
    if not (1 <= h <= 2**16 and 1 <= w <= 2**16):
        raise PlanError(f"--image-size {text}: invalid value; each side must be from 1 to 65536 pixels")
    return h, w


def vision_config_of(config) -> Any | None:
    """The vision tower's config of a vision-language model's config (None: no vision tower)."""
    return getattr(config, "vision_config", None)


_TEXT_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "head_dim", "max_position_embeddings")


def with_text_sizes(config):
    """A vision-language config whose top level lacks the decoder's sizes (transformers 5.x keeps them in
    ``text_config`` only): a copy with them lifted from its text config, so the closed form reads the decoder's
    ``hidden_size`` / heads / vocabulary where it reads a causal LM's; any other config unchanged."""
    if vision_config_of(config) is None or getattr(config, "hidden_size", None) is not None:
        return config
    text = config.get_text_config()
    if text is config:
        return config
    out = config.__class__.from_dict(config.to_dict())
    for key in _TEXT_SIZES:
        value = getattr(text, key, None)
        if value is not None:
            setattr(out, key, value)
    return out


def _flattened_patches(vc) -> bool:
    return getattr(vc, "temporal_patch_size", None) is not None and getattr(vc, "spatial_merge_size", None) is not None


def tower_image_size(config, height: int, width: int) -> tuple[int, int]:
    """The image as the tower sees it: a flattened-patch tower's size rounded to whole merged patches (the image
    processor's ``smart_resize`` rounding, at least one merged patch), a fixed-resolution tower's config size."""
    vc = vision_config_of(config)
    if _flattened_patches(vc):
        unit = int(vc.patch_size) * int(vc.spatial_merge_size)
        return max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit)
    size = getattr(vc, "image_size", None)
    if isinstance(size, (list, tuple)):
        return int(size[0]), int(size[-1])
    if not isinstance(size, int):
        raise PlanError(f"{type(config).__name__}: its vision config gives neither image_size nor a flattened-patch "
                        "layout (patch_size, temporal_patch_size, spatial_merge_size), so the planner cannot shape its "
                        "images; plan without --image-size")
    return size, size


@dataclass
class VisionTrace:
    """One micro-batch's images through the tower and projector (fake tensors)."""

    images: int
    saved: float  # bytes saved for backward (tower + projector), parameters excluded
    tokens_per_image: int  # rows of image features per image (image tokens in the text row)
    block_saved: float  # the most one tower block saves (full recomputation keeps one block's)
    block_inputs: float  # sum over blocks of each block's input (what checkpointing keeps per block)
    tower_size: tuple[int, int]
    blocks_total: float = 0.0  # what all the blocks save (the rest of ``saved``: patch embedding, merger / projector)


def _precomputed(vc, grid) -> dict:
    """The data-dependent tensors of a flattened-patch tower, computed on real tensors by transformers' own helpers,
    under the keyword names its forward pops (empty where transformers has no helper)."""
    try:
        from transformers import vision_utils as vu
        from transformers.utils.generic import get_max_seqlen  # noqa: F401 - present with vision_utils
    except ImportError:  # pragma: no cover - transformers without vision_utils (4.x)
        return {}
    merge = int(vc.spatial_merge_size)
    out: dict = {"position_ids": vu.get_vision_position_ids(grid, merge)}
    cu = vu.get_vision_cu_seqlens(grid)
    out["cu_seqlens"] = cu
    out["max_seqlen"] = int((cu[1:] - cu[:-1]).max())
    if getattr(vc, "window_size", None):
        idx, cu_w = vu.get_vision_window_index(grid, spatial_merge_size=merge, window_size=int(vc.window_size),
                                               patch_size=int(vc.patch_size))
        out.update(window_index=idx, cu_window_seqlens=cu_w, max_window_seqlen=int((cu_w[1:] - cu_w[:-1]).max()))
    return out


def trace_vision(config, *, images: int, height: int, width: int, dtype: str = "bf16",
                 attention: str = "fused") -> VisionTrace:
    """Saved-for-backward bytes of ``images`` images through the model's ``get_image_features`` (cached)."""
    from .activations import _CONFIGS, _config_key

    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    return _trace_vision_cached(key, int(images), *tower_image_size(config, height, width), dtype, attention)


@functools.lru_cache(maxsize=32)
def _trace_vision_cached(key: str, images: int, height: int, width: int, dtype: str, attention: str) -> VisionTrace:
    import contextlib

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from ..torch_private import private
    from .activations import _CONFIGS, _TRACE, _phase, decoder_layers, prepare_config, set_trace_attention

    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode", feature=_TRACE)
    DataDependentOutputException = private("torch._subclasses.fake_tensor", "DataDependentOutputException",
                                           feature=_TRACE)
    config = prepare_config(_CONFIGS[key])
    vc = vision_config_of(config)
    _phase(f"tracing the vision tower on {images} image(s) of {height}x{width} under fake tensors ...")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "amp" else contextlib.nullcontext()
    flat = _flattened_patches(vc)
    kwargs: dict = {}
    if flat:
        ps, tps = int(vc.patch_size), int(vc.temporal_patch_size)
        grid = torch.tensor([[1, height // ps, width // ps]] * images, dtype=torch.long)
        pre = _precomputed(vc, grid)
        channels = int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", None) or 3)
        shape = (images * (height // ps) * (width // ps), channels * tps * ps * ps)
    else:
        channels = int(getattr(vc, "num_channels", None) or 3)
        shape = (images, channels, height, width)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = build_model_for_config(config, dtype=torch_dtype)
        model.train()
        set_trace_attention(model, attention)
        skip = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        skip |= {StorageWeakRef(b.untyped_storage()) for b in model.buffers()}
        pixels = torch.randn(*shape, dtype=torch_dtype)
        if flat:
            kwargs["image_grid_thw"] = mode.from_tensor(grid)
        # the tower's blocks: each block's saved bytes and its input (full recomputation keeps those)
        mvc = vision_config_of(model.config)
        tower = next((m for n, m in model.named_modules() if n and getattr(m, "config", None) is mvc), None)
        blocks = decoder_layers(tower) if tower is not None else []
        state = {"block": None}
        per_block = [0.0] * len(blocks)
        inputs = [0.0] * len(blocks)
        handles = []
        for i, (_, blk) in enumerate(blocks):
            def pre_hook(m, a, kw, i=i):
                state["block"] = i
                x = a[0] if a else next((v for v in kw.values() if isinstance(v, torch.Tensor)), None)
                inputs[i] = float(x.untyped_storage().nbytes()) if x is not None else 0.0
            handles.append(blk.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(blk.register_forward_hook(lambda m, a, o: state.__setitem__("block", None)))
        saved: set = set()
        total = [0.0]

        def pack(t):
            w = StorageWeakRef(t.untyped_storage())
            if w in skip or w in saved:
                return t
            saved.add(w)
            nbytes = t.untyped_storage().nbytes()
            total[0] += nbytes
            if state["block"] is not None:
                per_block[state["block"]] += nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            if not flat:  # the model's own image path: tower, feature selection, projector
                try:
                    out = model.get_image_features(pixel_values=pixels)
                except (DataDependentOutputException, ValueError, TypeError, RuntimeError, IndexError) as exc:
                    first = (str(exc).splitlines() or [""])[0][:160]
                    raise PlanError(
                        f"{type(config).__name__}: its image path (get_image_features on {images} image(s) of "
                        f"{height}x{width}) cannot be traced under fake tensors ({type(exc).__name__}: {first}); the "
                        "planner counts flattened-patch towers (Qwen-VL, GLM-4V) and per-image towers that take "
                        "[images, C, S, S] (LLaVA): plan without --image-size") from None
            elif tower is None:
                raise PlanError(f"{type(config).__name__}: no module of the model holds its vision config, so the "
                                "planner cannot find its vision tower; plan without --image-size")
            else:  # the tower (its merger is the projector), with its data-dependent steps precomputed
                try:
                    out = tower(pixels, grid_thw=kwargs["image_grid_thw"],
                                **{k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                                   for k, v in pre.items()})
                except DataDependentOutputException as exc:
                    raise PlanError(f"{type(config).__name__}: its vision tower takes a data-dependent step ({exc}) "
                                    "that the planner cannot precompute, so its activations cannot be counted; plan "
                                    "without --image-size") from None
        for h in handles:
            h.remove()
        feats = getattr(out, "pooler_output", None)
        if feats is None:
            feats = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(feats, (tuple, list)):
            rows = sum(int(f.shape[0]) if f.dim() == 2 else int(math.prod(f.shape[:-1])) for f in feats)
        else:
            rows = int(math.prod(feats.shape[:-1]))
    return VisionTrace(images, total[0], rows // max(1, images), max(per_block, default=0.0), sum(inputs),
                       (height, width), sum(per_block))


def vision_term(config, vision: VisionRun, *, rows: int, seq_len: int, packing: bool, dtype: str, attention: str,
                recompute: str) -> dict:
    """The images of one micro-batch of ``rows`` rows of ``seq_len`` tokens, their image tokens and the tower's
    activations: ``bytes`` (what the estimate adds to the activations), ``how`` (its line), and the numbers."""
    vision.check()
    if vision_config_of(config) is None:
        raise PlanError(f"--image-size / --images-per-sample: {type(config).__name__} has no vision tower "
                        "(no vision_config); drop them, or plan a vision-language model")
    th, tw = tower_image_size(config, vision.height, vision.width)
    one = trace_vision(config, images=1, height=vision.height, width=vision.width, dtype=dtype, attention=attention)
    k = one.tokens_per_image
    per_sample = vision.images_per_sample * k
    if per_sample > seq_len:
        raise PlanError(f"--images-per-sample {vision.images_per_sample} --image-size {vision.height}x{vision.width}: "
                        f"{per_sample:,} image tokens per sample ({k:,} per {th}x{tw} image) exceed the row of "
                        f"{seq_len:,} tokens (--seq-len); raise --seq-len, or plan fewer / smaller images")
    text = vision.text_len
    if packing:
        sample_len = per_sample + (text or 0)
        samples = max(1, seq_len // max(1, sample_len))
        where = (f"packed rows: {samples} sample(s) of {per_sample:,} image + {text or 0:,} text tokens per "
                 f"{seq_len:,}-token row" + ("" if text else " (--text-len not given: the most images a row holds)"))
    else:
        if text is not None and per_sample + text > seq_len:
            raise PlanError(f"--text-len {text}: {per_sample:,} image + {text:,} text tokens per sample exceed the row of "
                            f"{seq_len:,} tokens (--seq-len); raise --seq-len or lower --text-len")
        samples = 1
        where = f"one sample per row ({per_sample:,} of its {seq_len:,} tokens are image tokens)"
    images = rows * samples * vision.images_per_sample
    if images == 0:
        return {"bytes": 0.0, "images": 0, "tokens_per_image": k, "tower_size": [th, tw],
                "how": f"vision tower: no images (--images-per-sample 0); {k:,} tokens per {th}x{tw} image"}
    tr = trace_vision(config, images=images, height=vision.height, width=vision.width, dtype=dtype,
                      attention=attention)
    full = recompute == "full" and tr.block_inputs > 0
    # checkpointed blocks keep their inputs and re-run one block at a time; what runs outside the blocks (patch
    # embedding, merger / projector) keeps its saved tensors
    outside = tr.saved - tr.blocks_total
    kept = (tr.block_inputs + tr.block_saved + outside) if full else tr.saved
    size_note = "" if (th, tw) == (vision.height, vision.width) else f" (the tower sees {th}x{tw})"
    how = (f"vision tower + projector on {images} image(s) of {vision.height}x{vision.width}{size_note}: "
           + (f"checkpointed blocks' inputs {_fmt(tr.block_inputs)} + one block {_fmt(tr.block_saved)} + outside "
              f"the blocks {_fmt(outside)}" if full
              else f"saved {_fmt(tr.saved)}")
           + f", counted from its forward; {k:,} image tokens per image, {where}")
    return {"bytes": float(kept), "saved": tr.saved, "images": images, "tokens_per_image": k, "tower_size": [th, tw],
            "samples_per_row": samples, "image_tokens_per_row": samples * per_sample, "how": how}
