"""The ground truth of ``hf-gradfix verify`` and its references, in plain PyTorch: every sequence on its own (no
padding, packed rows split), the per-target losses summed over the optimizer window and divided by the count of the
loss's own rule, and beside it each known bug's formula (mean of means, GA-scaled, off-by-one count, cross-sequence
attention, ...), computed at the recorded parameters; also the run's precision (:func:`run_precision`) and its ranks.

Apart from the trainer-driving code (:mod:`hf_gradfix.verify.trainer`): it sees recorded micro-batches and a model,
never a Trainer, and the policy-gradient reference (:mod:`hf_gradfix.verify.rl`) uses its pieces too.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..loss.counting import IGNORE_INDEX as IGNORE
from ..loss.counting import CountRule
from ..errors import InvalidArgumentError


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _base_model(model: nn.Module) -> nn.Module:
    fn = getattr(model, "get_base_model", None)
    return fn() if callable(fn) else model


def _is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(_base_model(model), "config", None), "is_encoder_decoder", False))


_DECODER_KEYS = ("decoder_input_ids", "decoder_attention_mask", "decoder_position_ids", "labels", "shift_labels")


def sequences_of(batch: Mapping[str, Any], encoder_decoder: bool = False,
                 declared: bool = True) -> list[dict[str, torch.Tensor]]:
    """The real sequences of a micro-batch, each a batch of one: packed rows split at ``position_ids``
    restarts, padding dropped (``attention_mask``).  Tensors of shape ``(rows, width)`` are cut to the
    sequence, other per-row tensors (sequence-level labels, decoder tensors of an encoder-decoder) taken whole.
    ``declared``: also where the batch's samples declared a document to begin (TRL's ``seq_lengths``, recorded by
    :mod:`hf_gradfix.verify.documents` during the run), whether or not the batch restarted its positions there.

    >>> b = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
    >>> [s["input_ids"].tolist() for s in sequences_of(b)]
    [[[5, 6]], [[7, 8, 9]]]
    """
    from .documents import KEY, declared_cuts

    ids = batch["input_ids"]
    rows, width = ids.shape[0], ids.shape[-1]
    pos, mask = batch.get("position_ids"), batch.get("attention_mask")
    keeps = [mask[r].bool().cpu() if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[-1] == width
             else torch.ones(width, dtype=torch.bool) for r in range(rows)]
    cuts = declared_cuts(batch, keeps) if declared and ids.dim() == 2 else None
    out = []
    for r in range(rows):
        keep = keeps[r]
        starts = [0]
        if torch.is_tensor(pos) and pos.dim() == 2 and pos.shape[-1] == width:
            starts += torch.nonzero(pos[r].cpu() == 0).flatten().tolist()
        own = set(starts)
        if cuts is not None:  # the declared starts, counted among the kept tokens
            starts += torch.nonzero(keep).flatten()[cuts[r]].tolist()
        starts = sorted(set(starts))
        spans = list(zip(starts, starts[1:] + [width]))
        for a, b in spans:
            idx = torch.arange(a, b)[keep[a:b]]
            if idx.numel() == 0:
                continue
            seq = {}
            for k, v in batch.items():
                if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != rows:
                    continue
                if k in ("attention_mask", KEY):
                    continue
                decoder_side = encoder_decoder and k in _DECODER_KEYS
                if v.dim() >= 2 and v.shape[1] == width and not decoder_side:
                    seq[k] = v[r:r + 1, idx]
                else:
                    seq[k] = v[r:r + 1]
            if a not in own and torch.is_tensor(seq.get("position_ids")) and seq["position_ids"].dim() == 2:
                # a document the batch did not restart: alone, it starts at the row's first position
                seq["position_ids"] = seq["position_ids"] - seq["position_ids"][:, :1] + pos[r, :1].cpu()
            out.append(seq)
    return out


def _forward_keys(model: nn.Module) -> set[str]:
    sig = inspect.signature(_base_model(model).forward)
    return {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    for m in (model, _base_model(model)):
        fn = getattr(m, "prepare_decoder_input_ids_from_labels", None)
        if callable(fn):
            return fn(labels=labels)
        fn = getattr(m, "_shift_right", None)
        if callable(fn):
            return fn(labels)
    raise InvalidArgumentError(f"{type(model).__name__}: no way to turn labels into decoder_input_ids")


def _logits(model: nn.Module, seq: Mapping[str, torch.Tensor], keys: set[str], encoder_decoder: bool,
            position_ids: torch.Tensor | None = None, keep_mask: bool = False) -> torch.Tensor:
    device = next(model.parameters()).device
    drop = ("labels", "shift_labels", "position_ids", "num_items_in_batch") + (() if keep_mask else ("attention_mask",))
    kwargs = {k: v.to(device) for k, v in seq.items() if k in keys and k not in drop and torch.is_tensor(v)}
    if position_ids is not None and "position_ids" in keys:
        kwargs["position_ids"] = position_ids.to(device)
    elif "position_ids" in seq and "position_ids" in keys:
        kwargs["position_ids"] = seq["position_ids"].to(device)
    if encoder_decoder and "decoder_input_ids" not in kwargs and "labels" in seq:
        kwargs["decoder_input_ids"] = _decoder_input_ids(model, seq["labels"].to(device))
    if "use_cache" in keys:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    logits = out["logits"] if isinstance(out, Mapping) else getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    return logits.float()


def _sequence_level_loss(logits: torch.Tensor, labels: torch.Tensor, config: Any, smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """transformers' sequence-classification rule (problem_type or inferred), summed over targets."""
    f = nn.functional
    problem = getattr(config, "problem_type", None)
    n_labels = logits.shape[-1]
    if problem == "regression" or (problem is None and n_labels == 1):
        x, y = logits.reshape(-1), labels.reshape(-1).to(logits.dtype)
        return f.mse_loss(x, y, reduction="sum"), int(y.numel())
    if problem == "multi_label_classification" or (problem is None and torch.is_floating_point(labels)):
        y = labels.reshape(logits.shape).to(logits.dtype)
        return f.binary_cross_entropy_with_logits(logits, y, reduction="sum"), int(y.numel())
    y = labels.reshape(-1).long()
    return (f.cross_entropy(logits.reshape(-1, n_labels), y, ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing),
            int((y != IGNORE).sum()))


def _token_loss(logits: torch.Tensor, labels: torch.Tensor, rule: CountRule, preshifted: bool,
                smoothing: float = 0.0, virtual_shift: bool = False) -> tuple[torch.Tensor, int]:
    """Summed CE of one sequence (batch of one) and its target count, by ``rule``.  ``virtual_shift``: the model
    prepends virtual tokens (PEFT prompt learning) to a causal LM, whose loss shifts over the longer sequence
    (its last virtual token predicts ``labels[0]``, so the count rule is unshifted)."""
    labels = labels.to(logits.device).long()
    extra = logits.shape[1] - labels.shape[1]
    if extra > 0:  # prompt learning: virtual tokens in front of the labels (PEFT pads labels the same way)
        labels = torch.cat([torch.full((labels.shape[0], extra), IGNORE, dtype=labels.dtype, device=labels.device), labels], 1)
    if (rule is CountRule.SHIFTED or (extra > 0 and virtual_shift)) and not preshifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.shape[:2] != labels.shape:
        raise InvalidArgumentError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    # label smoothing as transformers' LabelSmoother: (1 - eps) * nll + eps * mean over the classes of -log p
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                                       reduction="sum", label_smoothing=smoothing)
    return loss, int((labels != IGNORE).sum())


def _count(labels: torch.Tensor, rule: CountRule) -> int:
    if rule is CountRule.SHIFTED:
        labels = labels[..., 1:]
    return int((labels != IGNORE).sum())


def _label_offset(seqs: Sequence[Mapping[str, torch.Tensor]]) -> tuple[int, float]:
    """For causal LMs, whose labels are ``input_ids`` (with -100 masks): the offset ``k`` with
    ``labels[t] == input_ids[t + k]`` on (nearly) every target, when it is not 0; ``(0, share)`` otherwise."""
    hits = {k: [0, 0] for k in (-2, -1, 0, 1, 2)}
    for s in seqs:
        ids, lab = s.get("input_ids"), s.get("labels")
        if ids is None or lab is None or ids.shape != lab.shape:
            return 0, 1.0
        ids, lab = ids[0], lab[0]
        n = ids.numel()
        for k, h in hits.items():
            t = torch.arange(max(0, -k), min(n, n - k))
            if t.numel() == 0:
                continue
            valid = lab[t] != IGNORE
            h[0] += int((lab[t][valid] == ids[t + k][valid]).sum())
            h[1] += int(valid.sum())
    share = {k: (a / b if b else 0.0) for k, (a, b) in hits.items()}
    best = max((k for k in hits if k), key=lambda k: share[k])
    if hits[best][1] >= 8 and share[best] >= 0.9 and share[0] < 0.5:
        return best, share[best]
    return 0, share[0]


def _realign(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Labels given as ``input_ids[t + k]`` put back at position ``t + k``."""
    out = torch.full_like(labels, IGNORE)
    n = labels.shape[-1]
    if k > 0:
        out[..., k:] = labels[..., : n - k]
    else:
        out[..., : n + k] = labels[..., -k:]
    return out


def _detect_rule(model: nn.Module, batch: Mapping[str, Any], compute_loss_func: Callable | None) -> tuple[CountRule, str, str]:
    """(count rule, how it was found, the head in words) from the model's own loss on a real batch."""
    from ..loss.probe import ProbeError, detect_count_rule

    labels = batch.get("labels")
    if "shift_labels" in batch:
        return CountRule.UNSHIFTED, "the collator provides shift_labels", "token-level loss on shift_labels"
    if not torch.is_tensor(labels):
        raise InvalidArgumentError("the recorded batches have no 'labels' tensor: nothing to verify")
    device = next(model.parameters()).device
    keys = _forward_keys(model)
    enc_dec = _is_encoder_decoder(model)

    def model_loss(b, n):
        kwargs = {k: v.to(device) for k, v in b.items() if torch.is_tensor(v) and (k in keys or k == "labels")}
        out = model(**kwargs)
        loss = out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ProbeError("the model returns no loss")
        return loss

    def func_loss(b, n):
        labels = b["labels"].to(device)
        kwargs = {k: v.to(device) for k, v in b.items() if torch.is_tensor(v) and k in keys and k != "labels"}
        if enc_dec and "decoder_input_ids" not in kwargs:
            kwargs["decoder_input_ids"] = _decoder_input_ids(model, labels)
        return compute_loss_func(model(**kwargs), labels, num_items_in_batch=n)

    how = "the loss's own count rule"
    rule = None
    for fn, what in ((model_loss, "the model's loss"), (func_loss if compute_loss_func else None, "compute_loss_func")):
        if fn is None:
            continue
        try:
            with torch.no_grad():
                rule, why = detect_count_rule(fn, dict(batch), honors=False)
            how = f"probed on {what}: {why}"
            break
        except Exception:  # noqa: BLE001 - a loss we cannot probe: try the next, then the default
            continue
    if rule is None:
        if labels.dim() >= 2 and not torch.is_floating_point(labels):
            rule = CountRule.UNSHIFTED if enc_dec else CountRule.SHIFTED
        else:
            rule = CountRule.ELEMENTS
        how = "assumed (the loss could not be probed)"
    if rule is CountRule.ELEMENTS:
        head = "sequence-level loss (one target per label)"
    elif rule is CountRule.SHIFTED:
        head = "causal LM (targets labels[..., 1:])"
    elif enc_dec:
        head = "seq2seq (decoder targets, unshifted)"
    else:
        head = "token-level loss, unshifted (masked LM / token classification)"
    return rule, how, head


def _grads(model: nn.Module, names: Sequence[str], params: Sequence[nn.Parameter], loss: torch.Tensor) -> list[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(p, dtype=torch.float32) for p in params]
    try:
        gs = torch.autograd.grad(loss, params, allow_unused=True)
    except RuntimeError:  # e.g. reentrant activation checkpointing: .backward() instead
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss.backward()
        gs = [p.grad for p in params]
        for p, g in zip(params, saved):
            p.grad = g
    return [torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float() for p, g in zip(params, gs)]


def _axpy(acc: list[torch.Tensor] | None, w: float, g: list[torch.Tensor]) -> list[torch.Tensor]:
    if acc is None:
        return [w * x for x in g]
    for a, x in zip(acc, g):
        a.add_(x, alpha=w)
    return acc


def _lin(parts: Sequence[tuple[float, list[torch.Tensor]]]) -> list[torch.Tensor]:
    acc = None
    for w, g in parts:
        acc = _axpy(acc, w, g) if acc is not None else [w * x for x in g]
    return acc


@dataclass
class _MicroBatch:
    rank: int
    grad: list[torch.Tensor]  # gradient of the summed per-target losses (ground-truth targets)
    loss: float
    count: int
    other_count: int  # counted with the other token rule (shifted <-> unshifted)
    rows: int
    sequences: int


@dataclass
class _Context:
    model: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    keys: set[str]
    rule: CountRule
    encoder_decoder: bool
    config: Any
    position_limit: int | None
    smoothing: float = 0.0
    virtual_shift: bool = False
    #: the precision of every forward: ``torch.autocast`` as the run's (a new context per forward, as accelerate's
    #: forward wrapper enters one per call), or autocast off for the fp32 reference
    amp: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    #: a MoE run's router term (``hf_gradfix.verify.moe.RouterSpec``): its convention is added to the ground truth
    router: Any = None


def _seq_loss(ctx: _Context, seq: Mapping[str, torch.Tensor], labels: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, keep_mask: bool = False) -> tuple[torch.Tensor, int]:
    with ctx.amp():  # the forward only; the loss is taken in fp32 from fp32 logits, backward outside autocast
        logits = _logits(ctx.model, seq, ctx.keys, ctx.encoder_decoder, position_ids, keep_mask)
    if ctx.rule is CountRule.ELEMENTS:
        return _sequence_level_loss(logits, seq["labels"].to(logits.device), ctx.config, ctx.smoothing)
    if labels is None:
        if "shift_labels" in seq:
            return _token_loss(logits, seq["shift_labels"], ctx.rule, preshifted=True, smoothing=ctx.smoothing)
        labels = seq["labels"]
    return _token_loss(logits, labels, ctx.rule, preshifted=False, smoothing=ctx.smoothing, virtual_shift=ctx.virtual_shift)


def references(ctx: _Context, window: list[list[dict]], *, grad_accum: int, notes: list[str]) -> tuple[dict, float, dict]:
    """Every reference gradient at the model's current parameters for one window, the exact window loss and
    facts about the window.  ``window[rank][k]``: micro-batch ``k`` of ``rank`` as recorded (CPU tensors)."""
    world = len(window)
    per_mb: list[_MicroBatch] = []
    given_mb: list[tuple[list[torch.Tensor], int]] = []
    seq_mean_acc: list[torch.Tensor] | None = None  # sum over sequences of (gradient of the sequence's token mean)
    n_seq = 0
    all_seqs = [[sequences_of(b, ctx.encoder_decoder) for b in rank] for rank in window]
    token_level = ctx.rule is not CountRule.ELEMENTS
    offset, share = 0, 1.0
    if ctx.rule is CountRule.SHIFTED:
        offset, share = _label_offset([s for rank in all_seqs for mb in rank for s in mb if "shift_labels" not in s])
    other = CountRule.UNSHIFTED if ctx.rule is CountRule.SHIFTED else CountRule.SHIFTED
    n_given_other = 0
    for r, rank in enumerate(window):
        for batch, seqs in zip(rank, all_seqs[r]):
            acc, total, n, n_other, acc_given, n_given = None, 0.0, 0, 0, None, 0
            for seq in seqs:
                true_labels = _realign(seq["labels"], offset) if offset else None
                loss, c = _seq_loss(ctx, seq, labels=true_labels)
                g = _grads(ctx.model, ctx.names, ctx.params, loss)
                acc = _axpy(acc, 1.0, g)
                total += float(loss.detach())
                n += c
                if c:
                    seq_mean_acc = _axpy(seq_mean_acc, 1.0 / c, g)
                    n_seq += 1
                if token_level and "shift_labels" not in seq:
                    n_other += _count(true_labels if offset else seq["labels"], other)
                if offset:
                    loss_g, c_g = _seq_loss(ctx, seq)
                    acc_given = _axpy(acc_given, 1.0, _grads(ctx.model, ctx.names, ctx.params, loss_g))
                    n_given += c_g
                    n_given_other += _count(seq["labels"], other)
            if acc is None:
                acc = [torch.zeros_like(p, dtype=torch.float32) for p in ctx.params]
            rows = int(batch["input_ids"].shape[0]) if torch.is_tensor(batch.get("input_ids")) else len(seqs)
            per_mb.append(_MicroBatch(r, acc, total, n, n_other, rows, len(seqs)))
            if offset:
                given_mb.append((acc_given if acc_given is not None else [torch.zeros_like(a) for a in acc], n_given))
    counted = sum(m.count for m in per_mb)  # reported as is: 0 targets is "nothing checked", not a pass
    N = max(counted, 1)
    M = len(per_mb)
    ga = max(1, max(sum(1 for m in per_mb if m.rank == r) for r in range(world)))
    exact = _lin([(1.0 / N, m.grad) for m in per_mb])
    refs: dict[str, list[torch.Tensor]] = {"exact": exact}
    packed = any(s > r for r, s in ((m.rows, m.sequences) for m in per_mb))
    facts = {"targets": counted, "micro_batches": M, "sequences": sum(m.sequences for m in per_mb), "packed": packed,
             "offset": offset}
    nz = [m for m in per_mb if m.count > 0]
    refs["mean_of_means"] = _lin([(1.0 / (len(nz) * m.count), m.grad) for m in nz]) if nz else exact
    refs["mean_of_means_summed"] = _lin([(1.0 / (world * m.count), m.grad) for m in nz]) if nz else exact
    if ga > 1:
        refs["ga_scaled"] = [ga * x for x in exact]
    if world > 1:
        refs["world_scaled"] = [world * x for x in exact]
        if ga > 1:
            refs["ga_world_scaled"] = [ga * world * x for x in exact]
        per_rank = {r: sum(m.count for m in per_mb if m.rank == r) for r in range(world)}
        refs["rank_weighted"] = _lin([(1.0 / (world * max(per_rank[m.rank], 1)), m.grad) for m in per_mb])
    if token_level:
        n_other = sum(m.other_count for m in per_mb)
        if n_other and n_other != N:
            refs["count_unshifted" if ctx.rule is CountRule.SHIFTED else "count_shifted"] = [x * (N / n_other) for x in exact]
            facts["loss_factors"] = {"count_unshifted" if ctx.rule is CountRule.SHIFTED else "count_shifted": N / n_other}
    rows_total = max(sum(m.rows for m in per_mb), 1)
    refs["per_row"] = _lin([(1.0 / (world * m.rows), m.grad) for m in per_mb if m.rows])
    refs["per_row_averaged"] = _lin([(1.0 / (M * m.rows), m.grad) for m in per_mb if m.rows])
    refs["per_row_window"] = [x / rows_total for x in _lin([(1.0, m.grad) for m in per_mb])]
    if n_seq and token_level and seq_mean_acc is not None:
        refs["sequence_mean"] = [x / n_seq for x in seq_mean_acc]
    if world > 1:  # Trainer paths that multiply the loss by the ranks on top of another mistake
        for name in [k for k in refs if k not in ("exact", "world_scaled", "ga_world_scaled", "ga_scaled")]:
            refs[f"{name}+world_scaled"] = [world * x for x in refs[name]]
    if offset:
        n_given = max(sum(c for _, c in given_mb), 1)
        refs["labels_offset"] = _lin([(1.0 / n_given, g) for g, _ in given_mb])
        if n_given_other and n_given_other != n_given:  # transformers 4.57 counts causal labels unshifted
            refs["labels_offset+count_unshifted"] = [x * (n_given / n_given_other) for x in refs["labels_offset"]]
        notes.append(f"labels[t] == input_ids[t{offset:+d}] on {share:.0%} of the targets: the labels are shifted "
                     "before the model's own shift; the ground truth uses labels aligned with input_ids")
    _padding_targets(ctx, window, refs, notes)
    if packed and token_level:
        _cross_attention(ctx, window, N, refs, notes)
    if token_level:
        _documents_merged(ctx, window, all_seqs, refs, notes)
    loss = sum(m.loss for m in per_mb) / N
    if ctx.router is not None:  # a MoE run: the router term of its declared convention, the others as candidates
        from .moe import router_references

        router = router_references(ctx, window, world, ga)
        if router is None:
            notes.append("the model returned no router logits: the router term is not in the ground truth")
        else:
            declared, value = router[ctx.router.convention]
            token_refs = dict(refs)
            for name, g in token_refs.items():
                refs[name] = [a + b for a, b in zip(g, declared)]
            for name, (g, _v) in router.items():
                if name != ctx.router.convention:
                    refs[f"router_{name}"] = [a + b for a, b in zip(token_refs["exact"], g)]
                    # a stock run can get both wrong (transformers 4.57 also counts causal targets unshifted)
                    for token in ("count_unshifted", "count_shifted", "mean_of_means"):
                        if token in token_refs:
                            refs[f"router_{name}+{token}"] = [a + b for a, b in zip(token_refs[token], g)]
            loss += value
            facts["router"] = ctx.router.convention
            if ctx.router.note:
                notes.append(ctx.router.note)
    return refs, loss, facts


def summed_like_a_trainer(ctx: _Context, window: list[list[dict]], *, offset: int, N: int) -> tuple[list[torch.Tensor], float]:
    """The ground truth once more, summed the way a trainer sums it: per micro-batch one autocast region for the
    forwards of its sequences (the weights cast once, their gradients summed in the low precision), the
    micro-batch's summed loss divided by the window's count ``N`` before its backward, the micro-batches'
    gradients accumulated in the parameters' own dtype (as ``.grad`` is).  In exact arithmetic this is the ground
    truth; its distance from :func:`references`' ``exact`` is what the precision's rounding alone does to the same
    sum (the rounding floor).  Sequences stay unpadded and unpacked, so no model behaviour (masks, boundaries)
    enters the floor: only the order of the arithmetic changes."""
    acc = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in ctx.params]
    total = 0.0
    for rank in window:
        for batch in rank:
            loss = None
            with ctx.amp():
                for seq in sequences_of(batch, ctx.encoder_decoder):
                    part, _ = _seq_loss(ctx, seq, labels=_realign(seq["labels"], offset) if offset else None)
                    loss = part if loss is None else loss + part
            if loss is None:
                continue
            total += float(loss.detach())
            for a, g in zip(acc, _grads(ctx.model, ctx.names, ctx.params, loss / N)):
                a.add_(g.to(a.dtype))
    return [a.float() for a in acc], total / N


def loss_in_the_run_layout(ctx: _Context, window: list[list[dict]], *, offset: int, N: int) -> float | None:
    """The ground-truth loss once more, forward only, in the layout the trainer fed the model: each recorded
    micro-batch whole (padded rows with their attention mask, packed rows with their ``position_ids``), with the
    ground truth's targets only (padding, and under the causal shift each sequence's first token, dropped), summed
    over the window and divided by ``N``.  Equal to the ground truth in exact arithmetic; its distance from it is
    the rounding of the run's own shapes (what a GPU's shape-dependent kernels add).  None where the layout cannot
    be compared (encoder-decoder, collator-made ``shift_labels``, another target count)."""
    if ctx.encoder_decoder:
        return None
    device = next(ctx.model.parameters()).device
    total, count = 0.0, 0
    for rank in window:
        for b in rank:
            ids, lab = b.get("input_ids"), b.get("labels")
            if not torch.is_tensor(ids) or not torch.is_tensor(lab) or "shift_labels" in b:
                return None
            if ctx.rule is not CountRule.ELEMENTS:
                if lab.shape != ids.shape:
                    return None
                lab = (_realign(lab, offset) if offset else lab).clone()
                mask, pos = b.get("attention_mask"), b.get("position_ids")
                if torch.is_tensor(mask) and mask.shape == lab.shape:
                    lab[mask == 0] = IGNORE
                if ctx.rule is CountRule.SHIFTED:  # a sequence's first token has no token before it
                    if torch.is_tensor(pos) and pos.shape == lab.shape:
                        lab[pos == 0] = IGNORE
                    if torch.is_tensor(mask) and mask.shape == lab.shape:
                        lab[torch.arange(lab.shape[0]), mask.long().argmax(dim=1)] = IGNORE
            # the model gets what the trainer gave it (flash-attention's cu_seq_lens too), labels left out; with
            # autograd on, as in training (kernels may be chosen by it), the graph dropped at once
            kwargs = {k: v.to(device) for k, v in b.items()
                      if torch.is_tensor(v) and (k in ctx.keys or k in _PACKED_KWARGS) and k not in _NOT_MODEL_INPUTS}
            if "use_cache" in ctx.keys:
                kwargs["use_cache"] = False
            try:
                with ctx.amp():
                    out = ctx.model(**kwargs)
                logits = out["logits"] if isinstance(out, Mapping) else getattr(out, "logits", out[0])
                if ctx.rule is CountRule.ELEMENTS:
                    loss, c = _sequence_level_loss(logits.float(), lab.to(device), ctx.config, ctx.smoothing)
                else:
                    loss, c = _token_loss(logits.float(), lab, ctx.rule, preshifted=False, smoothing=ctx.smoothing,
                                          virtual_shift=ctx.virtual_shift)
            except (IndexError, KeyError, RuntimeError, TypeError, ValueError, InvalidArgumentError):
                return None
            total += float(loss.detach())
            count += c
            del loss, out, logits
    return total / N if count == N else None


_NOT_MODEL_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _cross_attention(ctx: _Context, window: list[list[dict]], N: int, refs: dict, notes: list[str]) -> None:
    """Packed rows run as one sequence each: with the rows' restarting ``position_ids`` and with positions
    0..width-1 (what a model that ignores the boundaries computes).  Skipped when a row is longer than the
    model's position table."""
    for name, continuous in (("cross_attention", True), ("cross_attention_restart", False)):
        if not continuous and "position_ids" not in ctx.keys:
            continue
        acc = None
        try:
            for rank in window:
                for batch in rank:
                    width = batch["input_ids"].shape[-1]
                    if continuous and ctx.position_limit is not None and width > ctx.position_limit:
                        raise _Skip(f"reference {name} skipped: a packed row of {width} tokens run as one sequence "
                                    f"overflows the model's position table ({ctx.position_limit} positions)")
                    for r in range(batch["input_ids"].shape[0]):
                        row = {k: v[r:r + 1] for k, v in batch.items()
                               if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == batch["input_ids"].shape[0]}
                        if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
                            keep = batch["attention_mask"][r].bool()
                            row = {k: (v[:, keep] if v.dim() >= 2 and v.shape[1] == width else v) for k, v in row.items()}
                        pos = torch.arange(row["input_ids"].shape[-1]).unsqueeze(0) if continuous else None
                        if not continuous and "position_ids" not in row:
                            continue
                        loss, _ = _seq_loss(ctx, row, position_ids=pos)
                        acc = _axpy(acc, 1.0 / N, _grads(ctx.model, ctx.names, ctx.params, loss))
        except _Skip as skip:
            notes.append(str(skip))
            continue
        except (IndexError, RuntimeError, ValueError) as err:
            notes.append(f"reference {name} skipped: the model cannot run a packed row as one sequence ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120]})")
            continue
        if acc is not None:
            refs[name] = acc


def _documents_merged(ctx: _Context, window: list[list[dict]], all_seqs: list, refs: dict, notes: list[str]) -> None:
    """Where the samples declared more documents than the batches kept apart (:mod:`hf_gradfix.verify.documents`):
    the reference of the sequences as the batches cut them, normalized by their own count (what such a run trains)."""
    merged = [[sequences_of(b, ctx.encoder_decoder, declared=False) for b in rank] for rank in window]
    kept = sum(len(mb) for rank in merged for mb in rank)
    declared = sum(len(mb) for rank in all_seqs for mb in rank)
    if kept == declared:
        return
    notes.append(f"the samples of this window declare {declared} documents (TRL's seq_lengths, restarted position_ids) "
                 f"where its batches keep {kept} sequences apart: documents were trained as one sequence")
    acc, n = None, 0
    for rank in merged:
        for seqs in rank:
            for seq in seqs:
                loss, c = _seq_loss(ctx, seq)
                acc = _axpy(acc, 1.0, _grads(ctx.model, ctx.names, ctx.params, loss))
                n += c
    if acc is not None and n:
        refs["documents_merged"] = [x / n for x in acc]


def _padding_targets(ctx: _Context, window: list[list[dict]], refs: dict, notes: list[str]) -> None:
    """Labels that are not -100 where ``attention_mask`` is 0 (a collator padding labels with the pad id): the
    ground truth drops padding, the run trains on it.  Reference: each micro-batch as recorded, padding included."""
    pads = 0
    for rank in window:
        for b in rank:
            lab, mask = b.get("labels"), b.get("attention_mask")
            if torch.is_tensor(lab) and torch.is_tensor(mask) and lab.shape == mask.shape and not ctx.encoder_decoder:
                pads += int(((mask == 0) & (lab != IGNORE)).sum())
    if not pads:
        return
    notes.append(f"{pads} label(s) are not -100 at padding positions (attention_mask 0): the run trains on padding; "
                 "the ground truth does not (pad labels with -100)")
    acc, n = None, 0
    for rank in window:
        for b in rank:
            loss, c = _seq_loss(ctx, b, keep_mask=True)
            acc = _axpy(acc, 1.0, _grads(ctx.model, ctx.names, ctx.params, loss))
            n += c
    if acc is not None and n:
        refs["padding_targets"] = [x / n for x in acc]


class _Skip(Exception):
    pass


def _position_limit(model: nn.Module) -> int | None:
    cfg = getattr(_base_model(model), "config", None)
    if cfg is None:
        return None
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    if getattr(text, "position_embedding_type", None) == "absolute" or hasattr(text, "n_positions") or any(
        isinstance(m, nn.Embedding) and "pos" in n.lower() for n, m in model.named_modules()
    ):
        for key in ("n_positions", "max_position_embeddings"):
            v = getattr(text, key, None)
            if isinstance(v, int):
                return v
    return None


def _rel(g: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], idx: Sequence[int] | None = None) -> float:
    idx = range(len(ref)) if idx is None else idx
    num = sum(float((g[i].double() - ref[i].double().to(g[i].device)).pow(2).sum()) for i in idx)
    den = sum(float(ref[i].double().pow(2).sum()) for i in idx)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def _group_of(name: str) -> str:
    low = name.lower()
    for key, group in (("lora_", "adapters"), ("embed", "embeddings"), ("wte", "embeddings"), ("wpe", "embeddings"),
                       ("lm_head", "head"), ("classifier", "head"), ("score", "head"), ("cls.", "head"), ("norm", "norms"),
                       ("ln_", "norms"), ("attn", "attention"), ("attention", "attention"), ("mlp", "mlp"),
                       ("feed_forward", "mlp"), ("ffn", "mlp"), ("dense", "mlp")):
        if key in low:
            return group
    return "other"


def _scale_fit(g: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    dot = sum(float((a.double().cpu() * b.double().cpu()).sum()) for a, b in zip(g, ref))
    den = sum(float(b.double().pow(2).sum()) for b in ref)
    c = dot / den if den else 1.0
    return c, [c * x for x in ref]


_DTYPE_WORDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


_LOW = (torch.bfloat16, torch.float16)


@dataclass
class Precision:
    """How the run computed: ``autocast`` = (device type, dtype) of the Trainer's ``torch.autocast``, or None;
    ``param_dtype``: the dtype of most of the model's floating parameters (by elements).  ``mixed``: below fp32
    somewhere, so the ground truth is computed the same way and judged against the rounding floor.

    >>> Precision(("cpu", torch.bfloat16), torch.float32).words(), Precision(None, torch.float32).mixed
    ('bf16 autocast (cpu)', False)
    """

    autocast: tuple[str, torch.dtype] | None
    param_dtype: torch.dtype
    notes: list[str] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        return self.autocast is not None or self.param_dtype in _LOW

    def words(self) -> str:
        parts = []
        if self.autocast is not None:
            parts.append(f"{_DTYPE_WORDS.get(self.autocast[1], str(self.autocast[1]))} autocast ({self.autocast[0]})")
        if self.param_dtype != torch.float32:
            parts.append(f"{_DTYPE_WORDS.get(self.param_dtype, str(self.param_dtype))} parameters")
        return ", ".join(parts) or "fp32"

    def amp(self) -> contextlib.AbstractContextManager:
        """The run's autocast (a new context each call), or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1])


def run_precision(trainer: Any, model: nn.Module) -> Precision:
    """How ``trainer`` runs ``model``: the autocast its accelerator wraps the forward in (``native_amp`` with
    ``mixed_precision`` fp16 / bf16, on the accelerator's device; transformers 4.57's CPU AMP too) and the
    parameters' dtype.  ``bf16`` / ``fp16`` asked for but not applied (fp16 on a CPU, DeepSpeed's own casting) is
    said in a note: the run computed as its parameters are."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    param_dtype = max(sizes, key=sizes.get) if sizes else torch.float32
    args, acc = trainer.args, getattr(trainer, "accelerator", None)
    autocast = None
    mp = str(getattr(acc, "mixed_precision", None) or "no")
    handler = getattr(acc, "autocast_handler", None)
    if getattr(acc, "native_amp", False) and mp in ("bf16", "fp16", "fp8") and getattr(handler, "enabled", True) is not False:
        device = getattr(getattr(acc, "device", None), "type", None) or next(model.parameters()).device.type
        autocast = (device, torch.float16 if mp == "fp16" else torch.bfloat16)  # fp8: accelerate's bf16 autocast
    elif getattr(trainer, "use_cpu_amp", False):  # transformers 4.57: autocast around compute_loss on the CPU
        autocast = ("cpu", getattr(trainer, "amp_dtype", torch.bfloat16))
    notes = []
    asked = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if asked and autocast is None:
        device = next(model.parameters()).device.type
        notes.append(f"{asked}=True, but the Trainer runs no autocast here ({device}"
                     f"{', DeepSpeed casts the model itself' if getattr(trainer, 'is_deepspeed_enabled', False) else ''}"
                     f"; accelerate mixed_precision {mp}): the run computed in "
                     f"{_DTYPE_WORDS.get(param_dtype, str(param_dtype))}, as its parameters are")
    if mp == "fp8" and autocast is not None:
        notes.append("fp8: the reference runs accelerate's bf16 autocast, not the fp8 layers themselves")
    return Precision(autocast, param_dtype, notes)


@contextlib.contextmanager
def _plain_forward(model: nn.Module):
    """accelerate's mixed-precision wrapper taken off the forwards it wrapped (``_original_forward`` kept beside
    them), put back after: within the block, the references choose the precision themselves."""
    saved = []
    for m in model.modules():
        forward = vars(m).get("forward")
        original = vars(m).get("_original_forward")
        if forward is not None and original is not None and "convert_outputs_to_fp32" in getattr(
                getattr(forward, "__func__", forward), "__qualname__", ""):
            saved.append((m, forward))
            m.forward = original
    try:
        yield
    finally:
        for m, forward in reversed(saved):
            m.forward = forward


def _world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _gather(obj: Any) -> list:
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    torch.distributed.all_gather_object(out, obj)
    return out


def _data_ranks(trainer) -> list[bool] | None:
    """Per rank: whether it holds its own data (ranks of one tp x cp group, and the stages of one pipeline, train on
    the same batches: keep the one at tp = cp = pp = 0), or None when every rank does."""
    from hf_gradfix.integration.state import state_of

    state = state_of(trainer)
    dims = state.nd.dims if state is not None and state.nd is not None else None
    if dims is None or dims.non_data_parallel == 1:
        return None
    return [all(dims.coords(r).get(job, 0) == 0 for job in ("tp", "cp", "pp")) for r in range(_world())]
