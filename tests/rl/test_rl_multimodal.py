"""Packed log-prob forwards on multimodal GRPO batches (``packing.rl_forwards``, issue 52 item 4;
``hf_gradfix/integration/rl/multimodal.py``).

Batches in TRL 1.16's layout, built from real processor outputs (tests/support/vlm.py: tiny Qwen2.5-VL and LLaVA
with their own processors, 0 / 1 / several images of different sizes per sample): each processed sample is a prompt
(left-padded to the longest), followed by a random completion (right-padded); the images concatenated per layout with
``num_images``, ``mm_token_type_ids`` padded like the tokens. Checks:

- TRL's own padded ``_get_per_token_logps_and_entropies`` vs the packed one (one varlen row per chunk, with and
  without TRL's chunking): log-probs equal within fp32 rounding;
- the gradient of a GRPO loss (on-policy ratio, advantages per sample, token mean) through the packed log-probs
  against a plain-PyTorch reference: every sample alone and unpadded, its own images, ``log_softmax(logits / T)``
  gathered at its completion tokens, relative error <= 1e-5;
- controls that must fail: Qwen2.5-VL's packed row with 2-D restarted positions instead of the per-document 4-row
  mRoPE positions; LLaVA's images handed over in the wrong order;
- the hook: a multimodal batch is packed (Qwen2.5-VL, LLaVA), Gemma 3's ``token_type_ids`` keeps it padded with one
  warning naming the key.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

trl = pytest.importorskip("trl")

import harness as H  # noqa: E402
import vlm as V  # noqa: E402

from hf_gradfix.integration.rl import packing as RP  # noqa: E402
from hf_gradfix.packing.attention import register_reference_varlen_attention, use_attention_implementation  # noqa: E402
from hf_gradfix.packing.multimodal import rope_index_fn  # noqa: E402

FP32_TOL = 2e-6  # max |packed - padded| of a log-prob (tests/rl/test_rl_packing.py's fp32 rounding bound)
GRAD_TOL = 1e-5
TEMPERATURE = 0.7
COMPLETIONS = [5, 1, 9, 3, 7, 2]


def _model(family):
    from trl.trainer.utils import add_fused_lm_head

    model = V.build_vlm(family, seed=0)
    model.eval()  # TRL's log-prob forwards; no dropout in these models either way
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def grpo_batch(family, n=6, seed=0):
    """TRL's layout from ``n`` processed samples (the prompt: the whole processed conversation) plus completions."""
    feats = V.processed_samples(family, V.make_samples(family, n=n, seed=seed))
    g = torch.Generator().manual_seed(seed)
    pad = V.pad_id(family)
    prompt_w, keep = max(len(f["input_ids"]) for f in feats), max(COMPLETIONS[:n])
    ids = torch.full((n, prompt_w + keep), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    mm = torch.zeros_like(ids) if "mm_token_type_ids" in feats[0] else None
    completions = []
    for i, f in enumerate(feats):
        p, c = len(f["input_ids"]), COMPLETIONS[i % len(COMPLETIONS)]
        comp = torch.randint(10, 100, (c,), generator=g)  # plain word tokens of the tiny vocabulary
        completions.append(comp)
        ids[i, prompt_w - p: prompt_w] = f["input_ids"]
        ids[i, prompt_w: prompt_w + c] = comp
        mask[i, prompt_w - p: prompt_w + c] = 1
        if mm is not None:
            mm[i, prompt_w - p: prompt_w] = f["mm_token_type_ids"]
    batch = V.collate_processed(family, feats)
    extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "image_sizes") if k in batch}
    if family == "qwen2_5_vl":
        extra["num_images"] = [int(f["image_grid_thw"].shape[0]) if "image_grid_thw" in f else 0 for f in feats]
    elif family == "idefics3":  # the images of each sample (its stack holds their tiles), TRL's count
        extra["pixel_attention_mask"] = batch["pixel_attention_mask"]
        extra["num_images"] = [V.IMAGE_COUNTS[i % len(V.IMAGE_COUNTS)] for i in range(n)]
    else:
        extra["num_images"] = [int(f["pixel_values"].shape[0]) if "pixel_values" in f else 0 for f in feats]
    if mm is not None:
        extra["mm_token_type_ids"] = mm
    return dict(ids=ids, mask=mask, keep=keep, extra=extra, feats=feats, completions=completions)


def _padded(model, b, **kw):
    from accelerate import Accelerator

    fake = types.SimpleNamespace(accelerator=Accelerator(cpu=True))
    return trl.GRPOTrainer._get_per_token_logps_and_entropies(fake, model, b["ids"], b["mask"], b["keep"],
                                                               **b["extra"], **kw)


def _packed(model, b, extra=None, **kw):
    with use_attention_implementation(model, register_reference_varlen_attention()):
        return RP.packed_per_token_logps(model, b["ids"], b["mask"], b["keep"], multimodal=extra or b["extra"],
                                         rope_fn=rope_index_fn(model), **kw)


def _grpo_grads(model, logps, mask, keep, adv):
    """GRPO's on-policy loss: -adv * exp(logp - logp.detach()), token mean over the batch's completion tokens."""
    model.zero_grad(set_to_none=True)
    comp = mask[:, -keep:].float()
    ratio = torch.exp(logps - logps.detach())
    (-(ratio * adv[:, None]) * comp).sum().div(comp.sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_grads(model, b, adv, family):
    """Plain PyTorch: every sample alone, unpadded, its own images; the same GRPO loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    count = sum(len(c) for c in b["completions"])
    for f, comp, a in zip(b["feats"], b["completions"], adv):
        one = V.collate_processed(family, [f])
        one.pop("labels")
        one["input_ids"] = torch.cat([one["input_ids"], comp[None]], 1)
        one["attention_mask"] = torch.ones_like(one["input_ids"])
        if "mm_token_type_ids" in one:
            one["mm_token_type_ids"] = torch.cat([one["mm_token_type_ids"], torch.zeros_like(comp)[None]], 1)
        logits = model(**one).logits[0, -len(comp) - 1: -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, comp[:, None])[:, 0]
        total = total + (-(torch.exp(logp - logp.detach()) * a)).sum()
    (total / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "idefics3"])
def test_packed_multimodal_log_probs_and_grpo_gradient_are_exact(family):
    model = _model(family)
    b = grpo_batch(family)
    assert sum(b["extra"]["num_images"]) >= 4 and 0 in b["extra"]["num_images"]  # none, one and several per sample
    adv = torch.linspace(-1.0, 1.0, b["ids"].size(0))
    ref = _reference_grads(model, b, adv, family)
    for batch_size in (None, 4):  # TRL's chunks: one packed row each (the second: 4 + 2 samples)
        lp, _, _ = _padded(model, b, batch_size=batch_size)
        lp2, _, _ = _packed(model, b, batch_size=batch_size)
        assert lp2.shape == lp.shape
        assert _maxdiff(lp, lp2) <= FP32_TOL, (family, batch_size, _maxdiff(lp, lp2))
        got = _grpo_grads(model, lp2, b["mask"], b["keep"], adv)
        print(f"{family} batch_size={batch_size}: log-probs {_maxdiff(lp, lp2):.2e}, GRPO gradient vs reference "
              f"{H.rel_err(got, ref):.2e} (padded: {H.rel_err(_grpo_grads(model, lp, b['mask'], b['keep'], adv), ref):.2e})")
        assert any("visual" in n or "vision" in n for n in got)  # the tower gets its gradient through the row
        assert H.rel_err(got, ref) <= GRAD_TOL, (family, batch_size, H.rel_err(got, ref))


def test_controls_fail():
    # Qwen2.5-VL: 2-D restarted positions (isolated documents, but the image tokens lose their mRoPE grid positions)
    model = _model("qwen2_5_vl")
    b = grpo_batch("qwen2_5_vl")
    lp, _, _ = _padded(model, b)
    bad, _, _ = _packed(model, b, mrope=False)
    print(f"control: {_maxdiff(lp, bad):.2e}")
    assert _maxdiff(lp, bad) > 10 * FP32_TOL, _maxdiff(lp, bad)  # fails the check above by far
    # LLaVA: the chunk's images in the wrong order (samples 0 and 2 swap their image slots' contents)
    model = _model("llava")
    b = grpo_batch("llava")
    lp, _, _ = _padded(model, b)
    extra = dict(b["extra"])
    extra["pixel_values"] = extra["pixel_values"].flip(0)
    bad, _, _ = _packed(model, b, extra=extra)
    print(f"control: {_maxdiff(lp, bad):.2e}")
    assert _maxdiff(lp, bad) > 10 * FP32_TOL, _maxdiff(lp, bad)  # fails the check above by far


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_hook_packs_images_and_keeps_gemma3_padded():
    from test_rl_packing import _trainer

    logger, keep_ = logging.getLogger("hf_gradfix"), _Keep()
    logger.addHandler(keep_)
    try:
        trainer, config = _trainer()
        packing = RP.attach(trainer, config)
        model = _model("qwen2_5_vl")
        b = grpo_batch("qwen2_5_vl")
        want, _, _ = _padded(model, b)
        got, _, _ = trainer._get_per_token_logps_and_entropies(model, b["ids"], b["mask"], b["keep"], batch_size=4,
                                                               **b["extra"])
        assert _maxdiff(got, want) <= FP32_TOL
        assert packing.calls["packed"] == 1 and packing.calls["packed multimodal"] == 1, packing.calls
        # Gemma 3's bidirectional image mask: padded, one warning naming token_type_ids
        g = V.build_processor("gemma3")
        feats = V.processed_samples("gemma3", V.make_samples("gemma3", n=2), g)
        assert "token_type_ids" in feats[0]
        ids = torch.zeros(2, 4, dtype=torch.long)
        mask = torch.ones_like(ids)
        calls = dict(packing.calls)
        with pytest.raises(Exception):  # the padded call itself runs TRL's forward on the model given
            trainer._get_per_token_logps_and_entropies(None, ids, mask, 2, token_type_ids=torch.zeros_like(ids))
        assert packing.calls["padded: multimodal inputs"] == calls.get("padded: multimodal inputs", 0) + 1
        assert any("token_type_ids" in m and "bidirectional" in m for m in keep_.messages), keep_.messages
    finally:
        logger.removeHandler(keep_)


def test_grpo_trainer_run_with_images_packed_is_the_padded_run():
    """TRL's GRPOTrainer end to end with the tiny Qwen2.5-VL and its processor (1-3 images of different sizes per
    prompt, generation included): with packing.rl_forwards every log-prob forward runs packed with its images, and
    the step's gradient is the padded run's (same generations: the generation does not depend on the setting)."""
    import vlm_rl

    packed, g_packed, warned = vlm_rl.run_vlm_grpo(patch_config={"packing": {"rl_forwards": True}})
    padded, g_padded, _ = vlm_rl.run_vlm_grpo()
    calls = RP.rl_packing_of(packed).calls
    assert calls["packed multimodal"] == calls["packed"] >= 1 and not any(k.startswith("padded") for k in calls), calls
    assert not warned, warned
    assert RP.rl_packing_of(padded) is None
    assert len(g_packed) == len(g_padded) == 1
    assert sum(float(v.norm()) for v in g_packed[0].values()) > 0
    err = H.rel_err(g_packed[0], g_padded[0])
    print(f"GRPOTrainer run, packed vs padded gradient: {err:.2e}")
    assert err <= GRAD_TOL, err


def test_gemma3_packed_rows_are_not_exact_which_is_why_they_stay_padded():
    """The measurement behind keeping Gemma 3 padded: its rows packed the only way its attention allows (eager, no
    attention mask, restarted positions, ``token_type_ids`` packed like the tokens) against every sample alone. TRL's
    padded forward is exact; the packed row is exact on its first document only (later documents read the
    bidirectional image-token mask of the sliding-window layers at shifted positions: research section 1.2)."""
    from trl.trainer.utils import add_fused_lm_head

    model = V.build_vlm("gemma3", attn_implementation="eager").eval()
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    b = grpo_batch("gemma3")
    prompt = b["ids"].shape[1] - b["keep"]
    tt = torch.zeros_like(b["ids"])
    for i, f in enumerate(b["feats"]):
        tt[i, prompt - len(f["input_ids"]): prompt] = f["token_type_ids"]
    b["extra"]["token_type_ids"] = tt
    from hf_gradfix.integration.rl.multimodal import multimodal_reason

    assert "token_type_ids" in multimodal_reason(b["extra"], 6)  # the hook keeps such a batch padded
    with torch.no_grad():
        padded, _, _ = _padded(model, b)
        packed, _, _ = RP.packed_per_token_logps(model, b["ids"], b["mask"], b["keep"], multimodal=b["extra"],
                                                 document_mask=False)
        alone = torch.zeros_like(padded)
        for i, (f, comp) in enumerate(zip(b["feats"], b["completions"])):
            one = V.collate_processed("gemma3", [f])
            one.pop("labels")
            one["input_ids"] = torch.cat([one["input_ids"], comp[None]], 1)
            one["attention_mask"] = torch.ones_like(one["input_ids"])
            one["token_type_ids"] = torch.cat([one["token_type_ids"], torch.zeros_like(comp)[None]], 1)
            logits = model(**one).logits[0, -len(comp) - 1: -1].float() / TEMPERATURE
            alone[i, : len(comp)] = torch.log_softmax(logits, -1).gather(-1, comp[:, None])[:, 0]
    comp = b["mask"][:, -b["keep"]:].bool()
    per_sample = ((packed - alone).abs() * comp).amax(1)
    print(f"gemma3: padded vs alone {float(((padded - alone).abs() * comp).max()):.2e}, packed per sample "
          f"{[f'{x:.1e}' for x in per_sample.tolist()]}")
    assert float(((padded - alone).abs() * comp).max()) <= FP32_TOL  # stock padded: exact
    assert float(per_sample[0]) <= FP32_TOL  # the first document of the row: exact
    assert float(per_sample.max()) > 1e3 * FP32_TOL  # a later one: not
