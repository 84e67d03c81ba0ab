"""``hf-gradfix verify`` on mixture-of-experts runs: the router load-balancing term of the ground truth.

A MoE run's gradient is the token loss's plus ``coef *`` the router load-balancing loss's (router and expert
weights, and every layer below a router). What the router term of the window *is* depends on the convention the run
declares (``loss.aux_loss``, docs/moe.md), so the ground truth is built for that convention and the others are
candidates that name a mismatch:

================  ==========================================================================================
``router_micro``  the mean over micro-batches (every rank) of each micro-batch's load-balancing loss
``router_global`` the load-balancing loss of the whole window (frequencies over every micro-batch and rank)
``router_as_is``  stock transformers: each micro-batch's term added once, the loss then x the ranks: GA x W x micro
``router_none``   no router term
================  ==========================================================================================

A run without hf_gradfix is held to ``micro`` (what transformers and TRL intend); a patched run to its configured
convention (``micro`` for ``micro_batch_mean``; ``previous`` has no closed form and is reported against ``global``
with a note). The load-balancing loss is written out here from its definition (softmax of each layer's router
logits, top-k, padding rows dropped, every layer's rows together), independently of ``hf_gradfix.loss.moe``.

>>> import torch
>>> counts, probs, rows = _switch_terms((torch.tensor([[2.0, 0.0], [0.0, 2.0]]),), torch.ones(1, 2), top_k=1)
>>> counts.tolist(), rows
([1.0, 1.0], 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = ["RouterSpec", "router_references", "router_spec"]

CANDIDATES = ("micro", "global", "as_is", "none")


@dataclass
class RouterSpec:
    """What the run trains as its router term: ``coef * convention`` over the window, ``top_k`` experts per row."""

    convention: str
    coef: float
    top_k: int
    note: str | None = None


def router_spec(trainer: Any, model: Any) -> RouterSpec | None:
    """The router term a trainer trains with, or None where the model adds none (no ``output_router_logits``, a zero
    coefficient, or no ``num_experts_per_tok``)."""
    base = getattr(model, "module", model)
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is None or not getattr(text, "output_router_logits", False):
        return None
    coef = getattr(trainer, "router_aux_loss_coef", None)  # TRL's trainers set their own
    coef = float(coef if coef is not None else getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not coef or not top_k:
        return None
    try:
        from ..integration.state import state_of

        state = state_of(trainer)
    except Exception:  # noqa: BLE001 - transformers absent in a pure-math use: no plugin state
        state = None
    convention, note = "micro", None
    if state is not None and state.config.loss.enabled:
        convention = state.config.loss.aux_loss
        convention = {"micro_batch_mean": "micro"}.get(convention, convention)
        if convention == "previous":
            convention, note = "global", ("loss.aux_loss='previous' approximates the window's router loss (the previous "
                                          "window's frequencies): compared against 'global', it is not exact by design")
        if convention == "bias":
            return None  # no router loss in the objective (balancing moves a buffer)
    return RouterSpec(convention, coef, int(top_k), note)


def _switch_terms(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None, top_k: int):
    """(per-expert top-k selections, per-expert probability sums, rows) of one forward, padding rows dropped."""
    keep = None if attention_mask is None else attention_mask.reshape(-1).bool()
    counts, probs, rows = 0.0, 0.0, 0
    for gate in router_logits:
        gate = gate if keep is None else gate[keep.to(gate.device)]
        p = torch.softmax(gate.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts + F.one_hot(chosen, p.shape[-1]).sum(dim=(0, 1)).double().detach()
        probs = probs + p.sum(0)
        rows += p.shape[0]
    return counts, probs, rows


def _router_forward(ctx: Any, batch: dict):
    keys = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids") and torch.is_tensor(v)}
    device = ctx.params[0].device if ctx.params else "cpu"
    keys = {k: v.to(device) for k, v in keys.items()}
    with ctx.amp():
        out = ctx.model(**keys, output_router_logits=True, use_cache=False)
    logits = out.get("router_logits") if isinstance(out, dict) else getattr(out, "router_logits", None)
    if not logits:
        return None
    return _switch_terms(tuple(logits), keys.get("attention_mask"), ctx.router.top_k)


def router_references(ctx: Any, window: list[list[dict]], world: int, ga: int) -> dict[str, tuple[list, float]] | None:
    """Per candidate convention, ``(gradient of coef * the window's router term, its value)`` at the model's current
    parameters; None where the model returned no router logits."""
    terms = []
    for rank in window:
        for batch in rank:
            t = _router_forward(ctx, batch)
            if t is None:
                return None
            terms.append(t)
    experts = terms[0][0].numel()
    micro = torch.stack([experts * ((c / r) * (p / r)).sum() for c, p, r in terms if r]).mean()
    counts = sum(t[0] for t in terms)
    probs = sum(t[1] for t in terms)
    rows = sum(t[2] for t in terms)
    global_ = experts * ((counts / rows) * (probs / rows)).sum()
    out = {}
    coef = ctx.router.coef
    for name, value, retain in (("micro", micro, True), ("global", global_, False)):
        gs = torch.autograd.grad(coef * value, ctx.params, retain_graph=retain, allow_unused=True)
        out[name] = ([torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float()
                      for p, g in zip(ctx.params, gs)], coef * float(value.detach()))
    g_micro, v_micro = out["micro"]
    out["as_is"] = ([ga * world * x for x in g_micro], ga * world * v_micro)
    out["none"] = ([torch.zeros_like(x) for x in g_micro], 0.0)
    return out
