"""Ground truth for VLM packing tests: every document run ALONE as unpacked training runs it (a batch of one, its own
images, no attention mask, the model's own positions), its loss summed in plain PyTorch; and the packed row's logits
cut back into documents.

Independent of hf_gradfix.packing.multimodal: the batch of one is built here by hand from the sample's own tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100
TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "token_type_ids")


def _t(v: Any) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(v)


def alone_inputs(sample: dict) -> dict:
    """The model inputs of ``sample`` alone (batch of one), without labels."""
    out = {}
    for k, v in sample.items():
        if k in ("labels", "attention_mask", "idx", "length"):
            continue
        t = _t(v)
        if k in TOKEN_KEYS:
            out[k] = t.view(1, -1).long()
        elif k == "pixel_values" and "pixel_attention_mask" in sample and t.dim() == 4:
            out[k] = t[None]  # a per-sample stack: [1, images, C, H, W]
        elif k == "pixel_attention_mask" and t.dim() == 3:
            out[k] = t[None]
        else:
            out[k] = t
    return out


def labels_of(sample: dict) -> torch.Tensor:
    return _t(sample.get("labels", sample["input_ids"])).view(-1).long()


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sum of the shifted next-token cross-entropy (labels -100 ignored), plain PyTorch."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE, reduction="sum")


def docs_alone(model, samples: Sequence[dict], *, grad: bool = False):
    """[logits of each document alone], and with ``grad`` the gradients of sum over documents of their summed
    losses (dict name -> tensor)."""
    model.zero_grad(set_to_none=True)
    logits = []
    total = 0.0
    for s in samples:
        with torch.set_grad_enabled(grad):
            out = model(**alone_inputs(s), use_cache=False).logits[0]
        logits.append(out.detach())
        if grad:
            total = total + summed_loss(out, labels_of(s))
    grads = None
    if grad:
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return logits, grads


def split_row(logits: torch.Tensor, samples: Sequence[dict]) -> list[torch.Tensor]:
    """The packed row's logits [T, V] cut into the documents' pieces (documents back to back, in order)."""
    out, at = [], 0
    for s in samples:
        n = _t(s["input_ids"]).numel()
        out.append(logits[at:at + n])
        at += n
    return out


def packed_run(model, batch: dict, *, grad: bool = False):
    """Logits [T, V] of a one-row packed batch, and with ``grad`` the gradients of the summed loss over its labels
    (which mask every document's first label)."""
    batch = dict(batch)
    labels = batch.pop("labels")
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out = model(**batch, use_cache=False).logits[0]
    grads = None
    if grad:
        summed_loss(out, labels[0]).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return out.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def worst_rel(pieces: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    return max(rel(p, r) for p, r in zip(pieces, refs))


def grad_rel(g: dict, g_ref: dict) -> float:
    """||g - g_ref|| / ||g_ref|| over every parameter both hold (float64); a parameter only one side holds counts
    whole (so a tower that gets no gradient on one side is an error)."""
    keys = sorted(set(g) | set(g_ref))
    num = den = 0.0
    for k in keys:
        a = g.get(k)
        b = g_ref.get(k)
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        num += float((a.double() - b.double()).pow(2).sum())
        den += float(b.double().pow(2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-300)
