"""Tiny vision-language models, their real processors and conversational samples, all built offline.

Families (``FAMILIES``):

- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration`` + ``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessorPil``):
  flattened patches + ``image_grid_thw``, ``mm_token_type_ids``, mRoPE; an image's token count follows its size
  (28x28 -> 1 token ... 112x112 -> 16). ``accepts_loss_kwargs=False``.
- ``gemma3``: ``Gemma3ForConditionalGeneration`` + ``Gemma3Processor`` (``Gemma3ImageProcessorPil``): one
  ``pixel_values`` row per image (resized to 32x32), ``token_type_ids`` (bidirectional image mask), 4 tokens per image.
- ``idefics3``: ``Idefics3ForConditionalGeneration`` + ``Idefics3Processor`` (``Idefics3ImageProcessorPil``, image
  splitting on): per-sample image stacks ``[B, N_img, C, H, W]`` + ``pixel_attention_mask``; an image of longest edge
  <= 32 is 1 tile, larger ones are split into up to 2x2 tiles + the global image (4 tokens per tile).
  SmolVLM is NOT built: ``SmolVLMProcessor`` needs the ``num2words`` package (not installed in the locked venv) and a
  ``SmolVLMVideoProcessor`` (torchvision, not installed); Idefics3 is its direct ancestor (same model code path:
  ``SmolVLMModel`` is generated from ``Idefics3Model``, same connector, same pixel layout).
- ``llava``: ``LlavaForConditionalGeneration`` (CLIP tower) + ``LlavaProcessor`` (``CLIPImageProcessorPil``): one
  row per image (32x32 crop), 16 tokens per image (CLS dropped, ``vision_feature_select_strategy="default"``).

Every model: text vocab 128 (the family's special tokens included), hidden 32, 2 layers, every dropout 0, eager
attention, fp32; vision tower hidden 32, 1 layer. Video (Qwen2.5-VL): the video processors need torchvision, which
the locked venv does not have, so no video sample is produced (``VIDEO_SUPPORTED`` says so, measured at import).

API::

    model = build_vlm("gemma3", seed=0)                 # tiny random-init fp32, .train() mode
    processor = build_processor("gemma3")              # the family's real processor class, tiny tokenizer
    samples = make_samples("gemma3", n=8, seed=0)      # {"messages", "images"} and {"prompt","completion","images"}
    feats = processed_samples("gemma3", samples, processor)   # per-sample processor outputs (+ labels), for Trainer
    batch = collate_processed("gemma3", feats, pad_id)        # a padded micro-batch the model accepts

Samples: 0, 1 or several images of different sizes per sample (``IMAGE_SIZES``), conversational
``{"messages": [...], "images": [PIL, ...]}`` (``kind="messages"``) or prompt-completion
``{"prompt": [...], "completion": [...], "images": [...]}`` (``kind="prompt_completion"``).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch
from torch import nn

FAMILIES = ("qwen2_5_vl", "gemma3", "idefics3", "llava")
VOCAB = 128
IGNORE_INDEX = -100

#: the words of every sample's text (and the chat templates' role words): all in the tiny vocabulary
WORDS = ("a the cat dog sees red blue green big small one two three on in under near what is this image shows "
         "picture tell me about describe it yes no there are and of to with look here left right top bottom "
         "system user assistant model").split()
PUNCT = list(":,.?!\n") + ["[", "]"]

#: (width, height) of the images a sample may carry: the families that keep sizes (Qwen's grids, Idefics3's tiles)
#: get different token counts per image
IMAGE_SIZES = ((28, 28), (56, 28), (28, 56), (56, 56), (84, 56), (112, 84), (40, 24), (64, 48))

_FAMILY_SPECIALS = {
    "qwen2_5_vl": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>"],
    "gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
               "<end_of_image>", "<image_soft_token>"],
    "idefics3": ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                 "<global-img>"] + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)],
    "llava": ["<pad>", "<s>", "</s>", "<unk>", "<image>"],
}

# Chat templates modelled on each family's real one, with {% generation %} markers around assistant turns (so
# assistant-only masks work) and the family's image placeholder.
_CONTENT = ("{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
            "{% if c.type == 'image' %}IMG{% elif c.type == 'video' %}VID{% else %}{{ c.text }}{% endif %}"
            "{% endfor %}{% endif %}")


def _content(image: str, video: str = "") -> str:
    return _CONTENT.replace("IMG", image).replace("VID", video)


_TEMPLATES = {
    "qwen2_5_vl": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}" + _content("") + "<|im_end|>{% endgeneration %}\n"
        "{% else %}" + _content("<|vision_start|><|image_pad|><|vision_end|>",
                                  "<|vision_start|><|video_pad|><|vision_end|>") + "<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "gemma3": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}" + _content("") + "<end_of_turn>{% endgeneration %}\n"
        "{% else %}" + _content("<start_of_image>") + "<end_of_turn>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "idefics3": (
        "<|im_start|>{% for m in messages %}{{ m.role | capitalize }}:"
        "{% if m.role == 'assistant' %}{% generation %} " + _content("") + "<end_of_utterance>{% endgeneration %}\n"
        "{% else %}" + _content("<image>") + "<end_of_utterance>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
    "llava": (
        "{% for m in messages %}{{ m.role | upper }}: "
        "{% if m.role == 'assistant' %}{% generation %}" + _content("") + "</s>{% endgeneration %}\n"
        "{% else %}" + _content("<image>\n") + " \n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise KeyError(f"vlm family={family!r} is not built here; use one of {FAMILIES}")


# ----------------------------------------------------------------------------------------------------------------------
# tokenizer and processor
# ----------------------------------------------------------------------------------------------------------------------


def build_tokenizer(family: str):
    """A ``PreTrainedTokenizerFast`` over a WordLevel vocabulary: the family's special tokens first, then
    :data:`WORDS` (lower and capitalized/upper role words) and punctuation; at most :data:`VOCAB` entries."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _check_family(family)
    specials = _FAMILY_SPECIALS[family]
    words = list(WORDS) + ["System", "User", "Assistant", "SYSTEM", "USER", "ASSISTANT", "[UNK]"]
    vocab: dict[str, int] = {}
    for tok in specials + words + PUNCT:
        vocab.setdefault(tok, len(vocab))
    assert len(vocab) <= VOCAB, len(vocab)
    unk = "<unk>" if "<unk>" in vocab else "[UNK]"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    kw: dict[str, Any] = dict(tokenizer_object=tok, unk_token=unk, chat_template=_TEMPLATES[family])
    if family == "qwen2_5_vl":
        kw.update(pad_token="<|endoftext|>", eos_token="<|im_end|>")
    elif family == "gemma3":
        kw.update(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", extra_special_tokens=dict(
            image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>"))
    elif family == "idefics3":
        kw.update(pad_token="<|endoftext|>", eos_token="<end_of_utterance>", bos_token="<|im_start|>")
    else:
        kw.update(pad_token="<pad>", eos_token="</s>", bos_token="<s>", extra_special_tokens=dict(image_token="<image>"))
    t = PreTrainedTokenizerFast(**kw)
    t.padding_side = "right"
    return t


#: tokens per tile / image and the tower geometry the processors are sized for
QWEN_PATCH, QWEN_MERGE = 14, 2
GEMMA_IMAGE, GEMMA_PATCH, GEMMA_TOKENS = 32, 8, 4
IDEFICS_TILE, IDEFICS_PATCH, IDEFICS_SCALE = 32, 8, 2
IDEFICS_SEQ = (IDEFICS_TILE // IDEFICS_PATCH) ** 2 // IDEFICS_SCALE**2  # 4 tokens per tile
LLAVA_IMAGE, LLAVA_PATCH = 32, 8


def _qwen_processor_class():
    """``Qwen2_5_VLProcessor`` itself where its video processor's base class is importable (torchvision
    installed); else a subclass of the same name with ``video_processor=None`` let through its constructor's class check (the
    locked venv has no torchvision: ``BaseVideoProcessor`` is not exported, so the check raises even for None).
    Nothing else changes: images, the chat template and ``mm_token_type_ids`` run the real code."""
    import transformers as tf

    try:
        tf.ProcessorMixin.get_possibly_dynamic_module("VideoProcessorMixin")
        return tf.Qwen2_5_VLProcessor
    except (AttributeError, ValueError, ImportError):
        pass

    class Qwen2_5_VLProcessor(tf.Qwen2_5_VLProcessor):  # same name: TRL and the logs see the real class's name
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return Qwen2_5_VLProcessor


def build_processor(family: str):
    """The family's real processor class over :func:`build_tokenizer` and a PIL image processor sized for the tiny
    tower of :func:`build_vlm` (no torchvision needed)."""
    import transformers as tf

    tokenizer = build_tokenizer(family)
    template = _TEMPLATES[family]
    if family == "qwen2_5_vl":
        ip = tf.Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, temporal_patch_size=2, merge_size=QWEN_MERGE,
                                         min_pixels=28 * 28, max_pixels=112 * 112)
        return _qwen_processor_class()(image_processor=ip, tokenizer=tokenizer, video_processor=None,
                                       chat_template=template)
    if family == "gemma3":
        ip = tf.Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE}, do_pan_and_scan=False)
        return tf.Gemma3Processor(image_processor=ip, tokenizer=tokenizer, chat_template=template,
                                  image_seq_length=GEMMA_TOKENS)
    if family == "idefics3":
        ip = tf.Idefics3ImageProcessorPil(size={"longest_edge": 2 * IDEFICS_TILE},
                                          max_image_size={"longest_edge": IDEFICS_TILE}, do_image_splitting=True)
        return tf.Idefics3Processor(image_processor=ip, tokenizer=tokenizer, image_seq_len=IDEFICS_SEQ,
                                    chat_template=template)
    ip = tf.CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                  crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    return tf.LlavaProcessor(image_processor=ip, tokenizer=tokenizer, patch_size=LLAVA_PATCH,
                             vision_feature_select_strategy="default", num_additional_image_tokens=1,
                             chat_template=template)


# ----------------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------------

_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=256, attention_dropout=0.0,
             rms_norm_eps=1e-6, use_cache=False)


def _ids(family: str) -> dict[str, int]:
    t = build_tokenizer(family)
    return {s: t.convert_tokens_to_ids(s) for s in _FAMILY_SPECIALS[family]}


def _build(family: str, attn: str) -> nn.Module:
    import transformers as tf

    ids = _ids(family)
    if family == "qwen2_5_vl":
        text = dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "rope_type": "default"}, bos_token_id=None,
                    pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                      fullatt_block_indexes=[0], window_size=28, patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE,
                      temporal_patch_size=2)
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                  image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
        for c in (cfg, cfg.text_config):
            c.use_cache = False
        return tf.Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    if family == "gemma3":
        text = tf.Gemma3TextConfig(**dict(_TEXT, query_pre_attn_scalar=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"],
                                          pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
                                          eos_token_id=ids["<eos>"]))
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=GEMMA_IMAGE, patch_size=GEMMA_PATCH, attention_dropout=0.0)
        cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS,
                              image_token_id=ids["<image_soft_token>"], boi_token_id=ids["<start_of_image>"],
                              eoi_token_id=ids["<end_of_image>"], tie_word_embeddings=False)
        return tf.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    if family == "idefics3":
        text = tf.LlamaConfig(**dict(_TEXT, pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|im_start|>"],
                                     eos_token_id=ids["<end_of_utterance>"], tie_word_embeddings=False))
        vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=IDEFICS_TILE, patch_size=IDEFICS_PATCH,
                                         attention_dropout=0.0)
        cfg = tf.Idefics3Config(text_config=text, vision_config=vision, scale_factor=IDEFICS_SCALE,
                                image_token_id=ids["<image>"], pad_token_id=ids["<|endoftext|>"],
                                tie_word_embeddings=False, use_cache=False)
        return tf.Idefics3ForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    text = tf.LlamaConfig(**dict(_TEXT, pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                 tie_word_embeddings=False))
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=LLAVA_IMAGE, patch_size=LLAVA_PATCH, projection_dim=32,
                                 attention_dropout=0.0, dropout=0.0)
    cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"],
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    return tf.LlavaForConditionalGeneration._from_config(cfg, attn_implementation=attn)


def build_vlm(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """Tiny random-init VLM of ``family`` (see the module docstring), ``dtype`` (fp32 by default), train mode."""
    _check_family(family)
    torch.manual_seed(seed)
    model = _build(family, attn_implementation).to(dtype)
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p != 0.0:
            raise AssertionError(f"{family}: dropout {m} left at p={m.p}")
        for name in ("dropout", "attention_dropout"):
            value = getattr(m, name, None)
            if isinstance(value, float) and value != 0.0:
                raise AssertionError(f"{family}: {type(m).__name__}.{name}={value}")
    model._hgf_family = family
    model.train()
    return model


def tower_and_projector_names(model: nn.Module) -> list[str]:
    """Names of the vision tower's and the projector's parameters (detected: every parameter outside the language
    model and the LM head)."""
    out = []
    for name, _ in model.named_parameters():
        if "language_model" in name or ".text_model." in name or name.startswith("lm_head"):
            continue
        out.append(name)
    return out


def freeze_tower(model: nn.Module) -> list[str]:
    """``requires_grad=False`` on the vision tower (not the projector); returns the frozen names."""
    outside = set(tower_and_projector_names(model))
    frozen = []
    for name, p in model.named_parameters():
        if name in outside and any(k in name for k in ("visual.blocks", "visual.patch_embed", "vision_tower",
                                                       "vision_model")):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


# ----------------------------------------------------------------------------------------------------------------------
# samples
# ----------------------------------------------------------------------------------------------------------------------


def _image(size: tuple[int, int], rng: random.Random):
    from PIL import Image

    w, h = size
    data = bytes(rng.randrange(256) for _ in range(w * h * 3))
    return Image.frombytes("RGB", (w, h), data)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS[:-4]) for _ in range(rng.randint(lo, hi))]
    return " ".join(words) + rng.choice([" .", " ?", " !", ""])


#: images per sample, cycled: 0, 1 and several (2 or 3) in every window of 4 consecutive samples
IMAGE_COUNTS = (1, 0, 3, 2, 1, 2, 0, 3)


def make_samples(family: str, n: int = 8, seed: int = 0, kind: str = "messages",
                 counts: Sequence[int] = IMAGE_COUNTS) -> list[dict]:
    """``n`` conversational samples with ``counts[i % len(counts)]`` images each, of different sizes
    (:data:`IMAGE_SIZES`), and captions of 2-12 words. ``kind``: ``"messages"`` (user turn with the images, then an
    assistant turn; a system turn on every third sample) or ``"prompt_completion"``. Every sample also has ``idx``.
    The images are placed by TRL's ``prepare_multimodal_messages`` (in front of the first user turn's text)."""
    _check_family(family)
    if kind not in ("messages", "prompt_completion"):
        raise ValueError(f"make_samples kind={kind!r}: use 'messages' or 'prompt_completion'")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = counts[i % len(counts)]
        images = [_image(IMAGE_SIZES[rng.randrange(len(IMAGE_SIZES))], rng) for _ in range(k)]
        if k >= 2 and images[0].size == images[1].size:  # several images: at least two different sizes
            images[1] = _image(IMAGE_SIZES[(IMAGE_SIZES.index(images[0].size) + 3) % len(IMAGE_SIZES)], rng)
        prompt = [{"role": "user", "content": _sentence(rng, 2, 6)}]
        if i % 3 == 2:
            prompt.insert(0, {"role": "system", "content": _sentence(rng, 1, 3)})
        completion = [{"role": "assistant", "content": _sentence(rng, 2, 12)}]
        if kind == "messages":
            out.append(dict(idx=i, messages=prompt + completion, images=images))
        else:
            out.append(dict(idx=i, prompt=prompt, completion=completion, images=images))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# the plain-tensor path: per-sample processor outputs, collated for the Trainer
# ----------------------------------------------------------------------------------------------------------------------

#: per-token keys (padded along the sequence); the rest are per-image / per-sample keys
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids")


def process_one(family: str, sample: dict, processor, assistant_only: bool = True) -> dict:
    """One sample through ``processor.apply_chat_template`` (TRL's path: ``prepare_multimodal_messages`` first),
    unpadded, as tensors without the batch dimension where per-token; ``labels`` = ``input_ids`` with -100 on every
    non-assistant token (``assistant_only``) else on nothing. Keeps ``idx``."""
    from trl.data_utils import prepare_multimodal_messages

    messages = sample.get("messages") or (sample["prompt"] + sample["completion"])
    messages = prepare_multimodal_messages(messages, images=sample["images"])
    out = processor.apply_chat_template([messages], tokenize=True, return_dict=True, return_tensors="pt",
                                        return_assistant_tokens_mask=assistant_only,
                                        processor_kwargs=dict(padding=False, add_special_tokens=False))
    feat: dict[str, Any] = {}
    for k, v in out.items():
        if k in TOKEN_KEYS or k == "assistant_masks":
            feat[k] = torch.as_tensor(v)[0]
        elif torch.is_tensor(v):
            feat[k] = v
    labels = feat["input_ids"].clone()
    if assistant_only:
        labels[feat.pop("assistant_masks") == 0] = IGNORE_INDEX
    feat["labels"] = labels
    if "idx" in sample:
        feat["idx"] = int(sample["idx"])
    return feat


def processed_samples(family: str, samples: Sequence[dict], processor=None, assistant_only: bool = True) -> list[dict]:
    processor = processor or build_processor(family)
    return [process_one(family, s, processor, assistant_only) for s in samples]


def pad_id(family: str) -> int:
    return build_tokenizer(family).pad_token_id


def collate_processed(family: str, features: Sequence[dict], pad: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad per-token keys; concatenate per-image keys in sample order, each family in its own layout:
    Qwen (``pixel_values`` patches, ``image_grid_thw``) and Gemma / LLaVA (one row per image) by concatenation along
    dim 0, Idefics3 (``[1, N_img, C, H, W]`` per sample + ``pixel_attention_mask``) padded with all-zero images to
    the batch's largest count (the processor's own padding). Samples without images add nothing."""
    pad = pad_id(family) if pad is None else pad
    width = max(len(f["input_ids"]) for f in features)
    batch: dict[str, Any] = {}
    for key in TOKEN_KEYS:
        if key not in features[0]:
            continue
        fill = {"input_ids": pad, "labels": IGNORE_INDEX}.get(key, 0)
        rows = [torch.cat([f[key], torch.full((width - len(f[key]),), fill, dtype=f[key].dtype)]) for f in features]
        batch[key] = torch.stack(rows)
    image_keys = sorted({k for f in features for k in f if k not in TOKEN_KEYS and k != "idx"})
    for key in image_keys:
        parts = [f[key] for f in features if key in f and f[key].numel()]
        if not parts:
            continue
        if family == "idefics3" and key in ("pixel_values", "pixel_attention_mask"):
            most = max(p.shape[1] for p in parts)
            rows = []
            for f in features:
                p = f.get(key)
                if p is None or not p.numel():
                    ref = parts[0]
                    p = torch.zeros((1, 0, *ref.shape[2:]), dtype=ref.dtype)
                pad_shape = (1, most - p.shape[1], *p.shape[2:])
                rows.append(torch.cat([p, torch.zeros(pad_shape, dtype=p.dtype)], dim=1))
            batch[key] = torch.cat(rows)
        else:
            batch[key] = torch.cat(parts)
    return batch


def forward_backward(model: nn.Module, batch: dict) -> float:
    """One forward + backward of ``model`` on ``batch`` (labels included); returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach())


def sample_loss_sum(model: nn.Module, feature: dict, family: str, dtype: torch.dtype = torch.float64):
    """The causal-LM loss SUM of one processed sample alone (its own images), computed from the logits in ``dtype``
    (the model must already be in ``dtype``), and its target count (``labels[1:] != -100``)."""
    import torch.nn.functional as F

    batch = collate_processed(family, [feature])
    labels = batch.pop("labels")
    batch = {k: (v.to(dtype) if torch.is_floating_point(v) else v) for k, v in batch.items()}
    logits = model(**batch).logits[:, :-1].to(dtype)
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, int(target.ne(IGNORE_INDEX).sum())


if __name__ == "__main__":  # a smoke run: every family forward + backward on one processed batch of 4 samples
    for fam in FAMILIES:
        proc = build_processor(fam)
        m = build_vlm(fam)
        feats = processed_samples(fam, make_samples(fam, 4), proc)
        b = collate_processed(fam, feats)
        loss = forward_backward(m, {k: v for k, v in b.items()})
        tower = tower_and_projector_names(m)
        tg = sum(float(p.grad.norm()) for n, p in m.named_parameters() if n in tower and p.grad is not None)
        print(fam, "frozen", len(freeze_tower(build_vlm(fam))), "of", len(tower_and_projector_names(m)), "tokens", [len(f["input_ids"]) for f in feats], "targets",
              [int(f["labels"][1:].ne(-100).sum()) for f in feats], "loss", round(loss, 4), "tower grad", round(tg, 4),
              {k: tuple(v.shape) for k, v in b.items() if k not in TOKEN_KEYS})
