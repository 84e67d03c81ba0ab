"""``hf-gradfix verify``: prove that a run is exact, on the user's own trainer, model, data and loss code.

:func:`verify_trainer` takes any ``transformers.Trainer`` (stock, a subclass, TRL's ``SFTTrainer``; with or
without hf_gradfix) and runs a few optimizer steps with everything it was built with.  It records every
micro-batch ``training_step`` consumed, the loss it returned and, just before the optimizer, the accumulated
(and all-reduced) gradient.  The ground truth is then computed at the same parameters in one process, in plain
PyTorch: every sequence on its own (no padding, packed rows split), the per-target losses summed over the whole
optimizer window on every rank, divided by the number of targets counted with the loss's own rule (causal
shift, unshifted, one per sequence-level label).

The verdict follows the numbers: EXACT exactly when every step's gradient and loss are within ``tolerance``
(relative).  Otherwise NOT EXACT, and a step's diagnosis names a reference below only when that reference
reproduces the run's gradient within ``tolerance``; else it is ``unexplained``.  References that cannot run on
a model (e.g. a packed row longer than its position table) are skipped with a note.

=============================  ==================================================================================
``mean_of_means``              each micro-batch normalized by its own target count, the means averaged
``mean_of_means_summed``       the same means summed over the window (a micro-batch mean not divided by GA)
``ga_scaled`` / ...            the exact gradient times GA, the ranks, or both
``rank_weighted``              each rank normalized by its own count (ranks weighted equally)
``count_unshifted``            normalized by a count that includes each row's first label (or ``count_shifted``)
``per_row`` / ``per_row_...``  a micro-batch's summed loss divided by its number of rows (sequences)
``sequence_mean``              every sequence's own token mean, averaged over the sequences
``labels_offset``              labels misaligned with ``input_ids`` (a collator or dataset that shifts them itself)
``padding_targets``            labels that are not -100 at padding positions (the loss trains on padding)
``cross_attention``            packed sequences attending to each other (a row run as one sequence)
``documents_merged``           documents the data declares apart (TRL's ``seq_lengths``) trained as one sequence
``router_micro`` / ...         a MoE run: another router-loss convention than the run declares (``verify_moe``)
``scaled``                     the exact gradient times an unexplained constant (the factor is reported)
=============================  ==================================================================================

Dropout is switched off and gradient clipping disabled for the checked steps (both change gradients by
design); the model, optimizer, trainer state and random-number generators are put back afterwards.

Mixed precision (:func:`run_precision`): when the Trainer runs the forward under autocast (``bf16`` / ``fp16``,
accelerate's ``mixed_precision``) or the parameters are bf16 / fp16, every reference is computed the same way
(the same autocast device type and dtype, the same weights) and the fp32 ground truth beside it.  Rounding then
moves even a correct gradient by ~1e-3, so a step is judged against its rounding floor: the ground truth against
itself summed micro-batch by micro-batch as a trainer sums it (:func:`summed_like_a_trainer`); the step's
tolerance is ``max(tolerance, FLOOR_FACTOR * floor)``, for the verdict and the naming alike.  fp16's loss scale
(a ``GradScaler``) is divided out of the recorded gradient.

>>> from hf_gradfix.verify import verdict_of
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-8}, loss_rel_err=None, tolerance=1e-5)
'ga_scaled'
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-8, "scaled": 2e-8}, loss_rel_err=None, tolerance=1e-5)
'ga_scaled'
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-3}, loss_rel_err=None, tolerance=1e-5)
'unexplained'
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .loss.counting import IGNORE_INDEX as IGNORE
from .loss.counting import CountRule
from .errors import InvalidArgumentError, InvalidTypeError

_log = logging.getLogger("hf_gradfix")


def _progress(message: str, since: float | None = None, phase: bool = False) -> None:
    """A progress line on the plugin's log (stderr; rank 0 only unless HF_GRADFIX_ALL_RANKS=1), stamped with the
    seconds since verify started; ``phase``: the heartbeat repeats it while it runs (hf_gradfix.progress)."""
    from .progress import report

    took = f" (took {time.perf_counter() - since:.1f} s)" if since is not None else ""
    report("verify", f"{message}{took}", phase=phase)


def _progress_session(fn: Callable) -> Callable:
    """Runs ``fn`` inside verify's progress session (the CLI's when it opened one): phase lines with the seconds since
    start, and a heartbeat line after 15 s of silence (hf_gradfix.progress)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from .progress import Progress

        with Progress("verify"):
            return fn(*args, **kwargs)

    return run

__all__ = ["verify", "verify_trainer", "verdict_of", "VerifyReport", "StepResult", "HYPOTHESES", "tiny_model",
           "synthetic_samples", "BUGS", "plot_report", "Precision", "run_precision", "FLOOR_FACTOR"]

HYPOTHESES = {
    "exact": "exact: the global token mean over every micro-batch and rank",
    "mean_of_means": "token count: each micro-batch normalized by its own target count, the means averaged "
    "(not one count for the whole window)",
    "mean_of_means_summed": "token count and scaling by GA: per-micro-batch means summed over the window (a "
    "compute_loss override or compute_loss_func returning a micro-batch mean)",
    "ga_scaled": "scaling by GA: the loss is not divided by the gradient-accumulation steps",
    "world_scaled": "scaling by world size: the gradient is the data-parallel ranks' sum, not their mean",
    "ga_world_scaled": "scaling by GA and world size: the loss is multiplied by both",
    "rank_weighted": "token count: each rank normalized by its own target count (ranks weighted equally, e.g. "
    "average_tokens_across_devices=False)",
    "count_unshifted": "shift: the target count includes each row's first label (off by one per row)",
    "count_shifted": "shift: the target count drops each row's first label, but the loss counts it",
    "per_row": "sequence count: each micro-batch's summed loss divided by its number of rows, summed over the "
    "window (a loss divided by the number of sequences, not tokens)",
    "per_row_averaged": "sequence count: each micro-batch's summed loss divided by its number of rows, averaged "
    "over the window",
    "per_row_window": "sequence count: the window's summed loss divided by its number of rows",
    "sequence_mean": "sequence weighting: every sequence's own token mean, averaged over the sequences",
    "labels_offset": "label alignment: the labels are shifted against input_ids before the loss shifts them "
    "again (a collator or dataset that shifts labels itself)",
    "padding_targets": "padding: labels at padding positions are not -100, so the loss trains on padding tokens",
    "cross_attention": "cross-sequence attention: each packed row run as one sequence (attention and positions "
    "cross the boundaries)",
    "cross_attention_restart": "cross-sequence attention: packed sequences attend to each other (positions restart)",
    "documents_merged": "documents merged: samples that declare several documents (TRL's seq_lengths, restarted "
    "position_ids) were trained as one sequence each; the ground truth keeps the documents apart",
    "scaled": "scale: the exact gradient times a constant no known bug explains",
    "reported_loss": "reported loss: the gradient is exact but the loss the Trainer reports is not the window's "
    "token mean",
    # policy-gradient runs (hf_gradfix.verify_rl): the loss type's objective over the window is the ground truth
    "expected_window_count": "token count: expected window count: each micro-batch divided by the generation batch's "
    "completion tokens x GA / steps_per_generation (TRL's dapo / cispo / vespo divisor), not the window's own token "
    "count (exact only when steps_per_generation == GA)",
    "mean_of_micro_means": "token count: mean of micro-batch means: each micro-batch normalized by its own completion "
    "tokens (or completions), the means averaged over the window (TRL's bnpo), not one count for the whole window",
    "entropy_mean_of_micro_means": "entropy bonus: mean of micro-batch means: each micro-batch's entropy averaged over "
    "its own tokens (TRL's), not the window's token mean",
    "unexplained": "unexplained: no reference reproduces the run within the tolerance",
}
#: References with a constant fitted to the run (named only when no fixed-formula reference fits).
FITTED = frozenset({"scaled"})
#: Bugs ``verify(inject=...)`` can plant in the built-in run, to show they are caught.
BUGS = ("mean_of_means", "ga_scaled", "world_scaled", "count_unshifted", "cross_attention")


def tiny_model(seed: int = 0) -> nn.Module:
    """The embedded default: a random-init Llama (vocab 128, hidden 64, 2 layers), fp32, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).float()


def synthetic_samples(n: int, vocab: int, lo: int = 4, hi: int = 48, seed: int = 0) -> list[dict]:
    """``n`` causal-LM samples of very different lengths (ids in [3, vocab)), labels = input_ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


# ------------------------------------------------------------------------------------------ the verdict


def verdict_of(candidates: Mapping[str, float], loss_rel_err: float | None, tolerance: float,
               loss_tolerance: float | None = None) -> str:
    """One step's verdict from the numbers: ``exact`` only when the gradient (``candidates['exact']``) is within
    ``tolerance`` and the reported loss within ``loss_tolerance`` (default: ``tolerance``); else the reference
    that reproduces the gradient within ``tolerance`` (the closest one), else ``unexplained``."""
    grad_ok = candidates["exact"] <= tolerance
    loss_ok = loss_rel_err is None or loss_rel_err <= (tolerance if loss_tolerance is None else loss_tolerance)
    if grad_ok and loss_ok:
        return "exact"
    if grad_ok:
        return "reported_loss"
    for pool in ([k for k in candidates if k not in FITTED], [k for k in candidates if k in FITTED]):
        named = {k: candidates[k] for k in pool if k != "exact" and candidates[k] <= tolerance}
        if named:  # a fixed-formula reference first; a fitted one (one free constant) only when none fits
            return min(named, key=named.get)
    return "unexplained"


# ------------------------------------------------------------------------------------------ report


@dataclass
class StepResult:
    step: int
    loss_exact: float
    loss_logged: float | None
    loss_rel_err: float | None
    grad_rel_err: float
    groups: dict[str, float]
    verdict: str
    candidates: dict[str, float]
    targets: int = 0
    micro_batches: int = 0
    sequences: int = 0
    detail: str = ""
    #: the tolerance this step was judged with: ``--tolerance``, or under mixed precision FLOOR_FACTOR x the floor
    tolerance: float | None = None
    #: mixed precision: the ground truth against itself summed as a trainer sums it (relative), at the run's precision
    rounding_floor: float | None = None
    #: mixed precision: the ground-truth loss in the run's own layout against the ground truth (None: not comparable),
    #: and the tolerance the reported loss was judged with (FLOOR_FACTOR x that floor; else the gradient's)
    loss_floor: float | None = None
    loss_tolerance: float | None = None
    #: mixed precision: the run's errors against the fp32 ground truth beside it
    fp32_grad_rel_err: float | None = None
    fp32_loss_rel_err: float | None = None
    #: the gradient norm the Trainer measured (for max_grad_norm, on every rank) against the norm of the gradient it held
    grad_norm_rel_err: float | None = None


@dataclass
class VerifyReport:
    exact: bool
    tolerance: float
    world_size: int
    grad_accum: int
    packing: bool
    steps: list[StepResult] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    trainer: str = ""
    head: str = ""
    count_rule: str = ""
    notes: list[str] = field(default_factory=list)
    #: how the run computed ("fp32", "bf16 autocast (cpu)", "bf16 parameters") and what the reference computed in
    precision: str = "fp32"
    reference: str = "fp32"
    #: the ground truth in words where it is not the token mean of a labels loss (a policy-gradient loss type's objective)
    objective: str = ""
    #: ranks that trained on batches of their own (tp / cp ranks and a pipeline's stages share theirs); 0: every rank
    data_ranks: int = 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "nothing_checked": self.nothing_checked()}, indent=2)

    def describe(self, name: str, step: StepResult | None = None) -> str:
        if name == "exact" and self.objective:
            return f"exact: {self.objective}"
        text = "; and ".join(HYPOTHESES.get(part, part) for part in name.split("+"))
        if step is not None and step.detail and name == step.verdict:
            text += f" ({step.detail})"
        return text

    def nothing_checked(self) -> str | None:
        """Why this report checked nothing (no step compared, or no target in any compared step: every label
        ``-100``), else None. Such a report is never EXACT: the CLI exits 2.

        >>> VerifyReport(exact=True, tolerance=1e-5, world_size=1, grad_accum=1, packing=False).nothing_checked()
        'no training step was compared'
        """
        if not self.steps:
            return "no training step was compared"
        if not any(s.targets > 0 for s in self.steps):
            return (f"{len(self.steps)} step(s) compared but they hold 0 targets (every label is -100, or no token is "
                    "a target under the count rule): a gradient of zero equals a ground truth of zero")
        return None

    def lines(self) -> list[str]:
        out = [
            f"hf-gradfix verify: {self.trainer + ', ' if self.trainer else ''}{len(self.steps)} step(s), "
            f"GA {self.grad_accum}, {self.world_size} rank(s)"
            f"{f' ({self.data_ranks} with data of their own)' if 0 < self.data_ranks < self.world_size else ''}, "
            f"packing {'on' if self.packing else 'off'}, "
            f"tolerance {self.tolerance:g}",
        ]
        if self.head:
            out.append(f"  loss: {self.head}; count rule {self.count_rule}")
        if self.reference != "fp32":
            out.append(f"  precision: the run computed in {self.precision}; reference: {self.reference}")
        for s in self.steps:
            loss = f", loss rel err {s.loss_rel_err:.1e}" if s.loss_rel_err is not None else ""
            out.append(f"  step {s.step}: gradient rel err {s.grad_rel_err:.1e}{loss} ({s.targets} targets, "
                       f"{s.sequences} sequences, {s.micro_batches} micro-batches) -> {self.describe(s.verdict, s)}")
            if s.rounding_floor is not None:
                beside = (f"; fp32 beside it: gradient rel err {s.fp32_grad_rel_err:.1e}, loss rel err "
                          f"{s.fp32_loss_rel_err:.1e}" if s.fp32_grad_rel_err is not None else "")
                loss_floor = (f", loss floor {s.loss_floor:.1e} -> {s.loss_tolerance:.1e}" if s.loss_floor is not None
                              else "")
                out.append(f"    rounding floor {s.rounding_floor:.1e} -> tolerance {s.tolerance:.1e} (max of "
                           f"{self.tolerance:g} and {FLOOR_FACTOR:g} x floor){loss_floor}{beside}")
            out.append("    per group: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(s.groups.items())))
            if s.grad_norm_rel_err is not None and self.world_size > 1:  # a norm reduced over ranks (and meshes)
                out.append(f"    gradient norm the Trainer measured (what max_grad_norm clips with), on every rank: "
                           f"rel err {s.grad_norm_rel_err:.1e} against the norm of the gradient it held")
            if s.verdict != "exact":
                near = sorted((v, k) for k, v in s.candidates.items() if k != "exact")[:3]
                out.append("    nearest references: " + ", ".join(f"{k} {v:.1e}" for v, k in near))
        for note in self.notes:
            out.append(f"  note: {note}")
        nothing = self.nothing_checked()
        if nothing is not None:
            out.append(f"NOTHING CHECKED: {nothing}")
        elif self.exact and any(s.rounding_floor is not None for s in self.steps):
            worst = max((s.grad_rel_err for s in self.steps), default=0.0)
            if self.reference.startswith("float64"):  # a policy-gradient run: the truth in float64, the floor measured
                out.append(f"EXACT (the run at {self.precision}: gradient within {worst:.1e} of the float64 ground "
                           "truth, within its rounding)")
            else:
                out.append(f"EXACT (at {self.precision}, as the run: gradient within {worst:.1e} of the ground truth "
                           "computed the same way, within its rounding)")
        elif self.exact:
            out.append("EXACT")
        else:
            by_name = {s.verdict: s for s in self.steps if s.verdict != "exact"}
            out.append("NOT EXACT: " + "; ".join(self.describe(b, by_name.get(b)) for b in self.broken))
        return out


# ------------------------------------------------------------------------------------------ sequences


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
    :mod:`hf_gradfix.verify_documents` during the run), whether or not the batch restarted its positions there.

    >>> b = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
    >>> [s["input_ids"].tolist() for s in sequences_of(b)]
    [[[5, 6]], [[7, 8, 9]]]
    """
    from .verify_documents import KEY, declared_cuts

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


# ------------------------------------------------------------------------------------------ the loss's own rule


def _detect_rule(model: nn.Module, batch: Mapping[str, Any], compute_loss_func: Callable | None) -> tuple[CountRule, str, str]:
    """(count rule, how it was found, the head in words) from the model's own loss on a real batch."""
    from .loss.probe import ProbeError, detect_count_rule

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


# ------------------------------------------------------------------------------------------ the references


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
    #: a MoE run's router term (``hf_gradfix.verify_moe.RouterSpec``): its convention is added to the ground truth
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
        from .verify_moe import router_references

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
    """Where the samples declared more documents than the batches kept apart (:mod:`hf_gradfix.verify_documents`):
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


# ------------------------------------------------------------------------------------------ the user's trainer


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


def _loss_scale(trainer: Any, optimizer: Any = None) -> float:
    """The factor a ``GradScaler`` (fp16 mixed precision) still holds in the gradients just before the optimizer
    step: its scale, or 1 when there is none or the gradients were unscaled already (for clipping)."""
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    if scaler is None or not callable(getattr(scaler, "get_scale", None)) or not scaler.is_enabled():
        return 1.0
    inner = optimizer if optimizer is not None else getattr(trainer, "optimizer", None)
    for _ in range(4):  # accelerate's AcceleratedOptimizer (and other wrappers) around the torch optimizer
        if getattr(inner, "optimizer", None) is None:
            break
        inner = inner.optimizer
    try:
        from torch.amp.grad_scaler import OptState

        stage = scaler._per_optimizer_states[id(inner)]["stage"] if id(inner) in scaler._per_optimizer_states else None
        if stage is OptState.UNSCALED:
            return 1.0
    except (ImportError, AttributeError, KeyError, TypeError):  # another scaler: take its scale
        pass
    return float(scaler.get_scale())


def _to_cpu(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in batch.items()}


@contextlib.contextmanager
def _no_dropout(model: nn.Module):
    """Dropout off (``nn.Dropout`` modules and float ``*dropout*`` attributes read by attention code), put back after."""
    saved: list[tuple[Any, str, Any]] = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p:
            saved.append((m, "p", m.p))
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if "dropout" in key.lower() and isinstance(value, float) and value > 0:
                saved.append((m, key, value))
                setattr(m, key, 0.0)
    for cfg in {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}.values():
        for key, value in list(vars(cfg).items()):
            if ("dropout" in key.lower() or key.endswith("_pdrop")) and isinstance(value, float) and value > 0:
                saved.append((cfg, key, value))
                setattr(cfg, key, 0.0)
    try:
        yield
    finally:
        for obj, key, value in reversed(saved):
            setattr(obj, key, value)


@contextlib.contextmanager
def _saved_rng():
    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


def _reporting_callbacks(trainer) -> list:
    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    except ImportError:  # pragma: no cover
        return []
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    # reporting integrations (files, services) and the console printers: the checked steps are not the user's run
    kinds = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type)) + (PrinterCallback, ProgressCallback)
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, kinds)]


@_progress_session
def verify_trainer(trainer: Any, steps: int = 2, *, tolerance: float = 1e-5, train_kwargs: dict | None = None,
                   run_train: Callable[[], Any] | None = None, reference_model: nn.Module | None = None) -> VerifyReport:
    """Run ``steps`` optimizer steps of ``trainer`` as configured and compare each step's gradient and reported
    loss with the one-process ground truth on the batches it actually drew, at the same parameters.

    Works with any ``transformers.Trainer`` (a subclass, TRL's ``SFTTrainer``, with or without hf_gradfix).
    Afterwards the model's parameters, the optimizer (if one was passed in), the trainer's state, its
    arguments and callbacks and the random-number generators are as before, so ``trainer.train()`` can follow.
    Under ``torchrun`` / ``hf-gradfix launch`` every rank calls it; the report is the same on every rank.
    A model no rank holds whole (ep / tp / cp / FSDP2 DTensor shards, pipeline stages, DeepSpeed ZeRO partitions, or
    one accelerate will shard when ``train()`` prepares it) is checked against an unsharded copy at its initial weights
    that verify builds (:mod:`hf_gradfix.verify_sharded`; a collective: every rank calls ``verify_trainer``);
    ``reference_model``: such a copy of your own instead (made before the trainer was built), for a model verify cannot
    rebuild from its config. A model accelerate prepared keeps the checked steps' updates in its engine / optimizer.
    Under mixed precision (``bf16=True``, bf16 parameters) the references compute as the run does and each step is
    judged within ``FLOOR_FACTOR`` times its rounding floor (``report.steps[i].tolerance``); the fp32 ground truth
    is reported beside it (``fp32_grad_rel_err``).

    >>> import contextlib, io, transformers, hf_gradfix
    >>> from hf_gradfix.verify import tiny_model, synthetic_samples, _PadCollator, _ListDataset
    >>> args = transformers.TrainingArguments("/tmp/hf_gradfix_doctest", per_device_train_batch_size=2,
    ...     gradient_accumulation_steps=2, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    >>> with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's notice on its first import, where installed
    ...     trainer = transformers.Trainer(model=tiny_model(), args=args, data_collator=_PadCollator(0),
    ...                                    train_dataset=_ListDataset(synthetic_samples(16, 128)))
    >>> report = hf_gradfix.verify_trainer(trainer, steps=1)
    >>> report.exact, report.steps[0].grad_rel_err < 1e-5
    (True, True)
    """
    import transformers

    if not isinstance(trainer, transformers.Trainer):
        raise InvalidTypeError(f"verify_trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    if steps < 1:
        raise InvalidArgumentError(f"verify_trainer: steps={steps} must be >= 1")
    model = trainer.model
    recorded: list[dict] = []
    returned: list[float] = []
    marks: list[int] = []
    grads: list[dict[str, torch.Tensor]] = []
    params_at: list[dict[str, torch.Tensor]] = []
    # policy-gradient runs (TRL's GRPO family, RLOO): what the loss function was given (generated completions,
    # advantages, old / reference log-probs), and per optimizer step how many of those had been recorded
    rl_recorded: list[dict] = []
    rl_marks: list[int] = []
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in trainable}
    initial_params = list(trainable)
    # a sharded run (ep / tp / cp / FSDP2 DTensors, pipeline stages, DeepSpeed ZeRO): the full tensors gathered over
    # the ranks, and the ground truth on an unsharded copy at the initial weights, built here (hf_gradfix.verify_sharded)
    from .verify_sharded import RunShards, deepspeed_clipping_off

    shards = RunShards(trainer, model)
    if reference_model is None and shards.kind is not None:
        _progress(f"the model is held as {shards.words}: building an unsharded copy for the ground truth ...", phase=True)
        reference_model = shards.reference()
    ds_grads: list[dict[str, torch.Tensor]] = []  # DeepSpeed: read inside the engine's step (see _prepared)
    hooked_engines: list = []

    def _prepared(trainer) -> None:
        """At the first micro-batch accelerate has prepared the model: FSDP2 put DTensor parameters in place of the
        model's own (read from now on), and DeepSpeed's engine steps inside ``backward`` at the window's end, before
        ``on_pre_optimizer_step``: its step is hooked to read the gradient it steps with (put back afterwards)."""
        if shards.kind != "prepare":
            return
        trainable[:] = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        engine = getattr(trainer, "model_wrapped", None)
        if not getattr(trainer, "is_deepspeed_enabled", False) or not callable(
                getattr(engine, "is_gradient_accumulation_boundary", None)):
            return
        own_step = engine.step

        def step(*a, **kw):
            if engine.is_gradient_accumulation_boundary():
                ds_grads.append(RunShards.deepspeed_grads(trainable))
            return own_step(*a, **kw)

        engine.step = step
        hooked_engines.append(engine)

    lowrank_notes: list[str] = []

    class _Recorder(transformers.TrainerCallback):
        target = steps

        def on_train_begin(self, args, state, control, **kw):
            self.target = state.global_step + steps
            # A lowrank_grads optimizer keeps the projected weights' window gradient only as rank-r accumulators:
            # for the checked steps it takes full gradients (like clipping, the accumulation acts after the
            # gradient is formed); its train() puts the hooks back next time
            opt = kw.get("optimizer")
            for _ in range(4):
                if opt is None or hasattr(opt, "detach_lowrank_hooks"):
                    break
                opt = getattr(opt, "optimizer", None)
            if opt is not None and getattr(opt, "lowrank_hooks_attached", False):
                opt.detach_lowrank_hooks()
                lowrank_notes.append(
                    f"{type(opt).__name__}(lowrank_grads=True) took full gradients for the checked steps (its low-rank "
                    "accumulation acts after the gradient is formed; the next train() turns it back on)")

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if ds_grads:  # DeepSpeed stepped inside backward; its gradient was read just before (training_step)
                grads.append(ds_grads.pop())
            else:
                scale = _loss_scale(trainer, kw.get("optimizer"))  # fp16's GradScaler: the gradients are still scaled
                grads.append(shards.full(trainable, grad=True, scale=scale))
            marks.append(len(recorded))
            rl_marks.append(len(rl_recorded))

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= self.target:
                control.should_training_stop = True
            control.should_save = False
            control.should_evaluate = False
            return control

        def on_epoch_end(self, args, state, control, **kw):
            control.should_save = False
            control.should_evaluate = False
            return control

    previous_step = trainer.__dict__.get("training_step")  # an instance-level wrapper (e.g. loss.on_nonfinite's)
    inner_step = trainer.training_step  # bound: that wrapper, else the class's own

    def training_step(model_arg, inputs, *a, **kw):
        if not recorded:
            _prepared(trainer)
        if len(recorded) == (marks[-1] if marks else 0):  # first micro-batch of a window: the parameters it sees
            params_at.append(shards.full(trainable))
        # a policy-gradient trainer draws prompts (a list); its micro-batch is what its loss function is given
        recorded.append(_to_cpu(inputs) if isinstance(inputs, Mapping) else {})
        pop_declared(inputs)  # the documents the samples declared: for the ground truth, never for the model
        out = inner_step(model_arg, inputs, *a, **kw)
        returned.append(float(out.detach().float().mean()) if torch.is_tensor(out) else float(out))
        return out

    from .verify_rl import ENTROPY_COEF_KEY, entropy_coefficient, is_policy_gradient_batch
    from .verify_documents import declare_documents, pop_declared

    previous_loss = trainer.__dict__.get("compute_loss")
    inner_loss = trainer.compute_loss
    # the gradient norm the Trainer measures each step (what max_grad_norm clips with, logged as grad_norm; over
    # several ranks and meshes a reduction of its own), checked against the norm of the gradient it held
    norms: list[float | None] = []
    previous_norm = trainer.__dict__.get("_get_grad_norm")
    inner_norm = getattr(trainer, "_get_grad_norm", None)

    def get_grad_norm(*a, **kw):
        out = inner_norm(*a, **kw)
        norms.append(None if out is None else float(out))
        return out

    def compute_loss(model_arg, inputs, *a, **kw):
        if getattr(model_arg, "training", False) and is_policy_gradient_batch(inputs):
            rl_recorded.append({**_to_cpu(inputs), ENTROPY_COEF_KEY: entropy_coefficient(trainer)})
        return inner_loss(model_arg, inputs, *a, **kw)

    args = trainer.args
    saved_args = {k: getattr(args, k) for k in ("max_grad_norm", "output_dir", "logging_dir") if hasattr(args, k)}
    saved_trainer = {k: trainer.__dict__.get(k) for k in ("state", "control", "optimizer", "lr_scheduler")}
    # a policy-gradient trainer's own state: its micro-step, buffered generations, entropy controller, metrics
    saved_trainer.update({k: copy.deepcopy(trainer.__dict__[k]) if k == "_metrics" else trainer.__dict__[k]
                          for k in ("_step", "_buffered_inputs", "entropy_coef", "_last_world_entropy",
                                    "_entropy_window_stats", "_metrics") if k in trainer.__dict__})
    opt_state = copy.deepcopy(trainer.optimizer.state_dict()) if getattr(trainer, "optimizer", None) is not None else None
    reporting = _reporting_callbacks(trainer)
    saved_callbacks = list(trainer.callback_handler.callbacks)
    recorder = _Recorder()
    tmp = tempfile.mkdtemp(prefix="hf_gradfix_verify_")
    t0 = time.perf_counter()
    _progress(f"1/2 the run under test: {type(trainer).__name__}.train() for {steps} step(s), gradients recorded ...",
              phase=True)
    with _saved_rng(), _no_dropout(model), deepspeed_clipping_off(trainer):
        try:
            args.max_grad_norm = 0.0  # clipping acts after the gradient is formed
            args.output_dir = tmp
            if "logging_dir" in saved_args:
                args.logging_dir = tmp
            for cb in reporting:
                trainer.callback_handler.remove_callback(cb)
            trainer.add_callback(recorder)
            trainer.training_step = training_step
            trainer.compute_loss = compute_loss
            if callable(inner_norm):
                trainer._get_grad_norm = get_grad_norm
            with declare_documents(trainer):
                if run_train is not None:
                    run_train()
                else:
                    trainer.train(**(train_kwargs or {}))
        finally:
            if previous_step is None:
                trainer.__dict__.pop("training_step", None)
            else:
                trainer.training_step = previous_step
            if previous_loss is None:
                trainer.__dict__.pop("compute_loss", None)
            else:
                trainer.compute_loss = previous_loss
            if previous_norm is None:
                trainer.__dict__.pop("_get_grad_norm", None)
            else:
                trainer._get_grad_norm = previous_norm
            trainer.callback_handler.callbacks[:] = saved_callbacks  # the same objects, in the same order
            for engine in hooked_engines:
                engine.__dict__.pop("step", None)
            for k, v in saved_args.items():
                setattr(args, k, v)
            shutil.rmtree(tmp, ignore_errors=True)
        if reference_model is not None:  # the ground truth runs on the unsharded copy, in one process
            ref_params = dict(reference_model.named_parameters())
            # the names recorded on every rank (pipeline stages: their union; a tied copy appears once in the copy)
            names = list(grads[0]) if grads else [n for n, _ in trainable]
            aliases = {n for n, _ in reference_model.named_parameters(remove_duplicate=False)}
            unknown = [n for n in names if n not in aliases]
            if unknown:  # e.g. a wrapper's prefixes: never a comparison of what does not correspond
                raise InvalidArgumentError(
                    f"the run's parameters have no counterpart in the unsharded copy of the model ({len(unknown)} of "
                    f"{len(names)}, e.g. {unknown[0]!r}); pass verify_trainer(..., reference_model=) a copy whose "
                    "parameter names are the run's")
            model, trainable_ref = reference_model, [(n, ref_params[n]) for n in names if n in ref_params]
        else:
            trainable_ref = trainable
        _progress(f"2/2 the reference: each step's exact gradient recomputed in plain PyTorch on the batches the "
                  f"trainer drew (run under test took {time.perf_counter() - t0:.1f} s) ...", phase=True)
        t1 = time.perf_counter()
        with _no_dropout(model) if model is reference_model else contextlib.nullcontext():
            if rl_recorded:  # generated completions: the loss type's objective over the window (hf_gradfix.verify_rl)
                from .verify_rl import compare as compare_policy_gradient

                report = compare_policy_gradient(trainer, model, rl_recorded, rl_marks, returned, marks, grads,
                                                 params_at, trainable_ref, tolerance)
            else:
                report = _compare(trainer, model, recorded, returned, marks, grads, params_at, trainable_ref, tolerance)
        report.notes.extend(lowrank_notes)
        _check_grad_norms(report, grads, norms, [n for n, _ in trainable_ref])
        holds_data = _data_ranks(trainer)
        report.data_ranks = sum(holds_data) if holds_data is not None else report.world_size
        _progress("done", since=t1)
        model = trainer.model
        if len(report.steps) < steps:
            report.notes.append(f"the trainer took {len(report.steps)} of the {steps} steps asked for (its data ran out)")
        with torch.no_grad():
            for n, p in initial_params:  # (a model accelerate prepared holds other, sharded parameters now: docs)
                if p.shape == initial[n].shape and not hasattr(p, "ds_id"):
                    p.copy_(initial[n])
                    p.grad = None
        for k, v in saved_trainer.items():
            setattr(trainer, k, v)
        if opt_state is not None and saved_trainer["optimizer"] is not None:
            saved_trainer["optimizer"].load_state_dict(opt_state)
    return report


def _check_grad_norms(report: VerifyReport, grads: list[dict[str, torch.Tensor]], norms: list[float | None],
                      names: Sequence[str]) -> None:
    """Per step, the gradient norm the Trainer measured on every rank (``_get_grad_norm``: what ``max_grad_norm`` clips
    with, even while verify keeps clipping off) against the norm of the full gradient it held (each parameter once): a
    reduction over ranks and meshes of its own (expert parallelism: two sequential all-reduces over efsdp and ep)."""
    every = _gather(list(norms))  # a collective: every rank gives its list, possibly empty
    for i, step in enumerate(report.steps):
        got = [r[i] for r in every if i < len(r) and r[i] is not None and math.isfinite(r[i])]
        if not got or i >= len(grads):
            continue
        exact = math.sqrt(sum(float(grads[i][n].double().pow(2).sum()) for n in names if n in grads[i]))
        step.grad_norm_rel_err = max(abs(v - exact) for v in got) / max(exact, 1e-30)
        if step.grad_norm_rel_err > (step.tolerance or report.tolerance):
            report.notes.append(f"step {step.step}: the gradient norm the Trainer measured (what max_grad_norm clips "
                                f"with) is {step.grad_norm_rel_err:.1e} off the norm of the gradient it held: clipping "
                                "would not be the exact gradient's")


#: Under mixed precision a step counts as exact when its gradient is within FLOOR_FACTOR times its rounding floor (the
#: ground truth against itself summed micro-batch by micro-batch at the run's precision, summed_like_a_trainer) and
#: its reported loss within FLOOR_FACTOR times the loss floor (loss_in_the_run_layout), never below ``tolerance``.
#: Measured (docs/verify.md, "What EXACT means under bf16"; bf16 autocast on a CPU): correct runs of every head came
#: to at most 2.07 x their floor (T5, first step; most 0.8-1.0), the smallest bug the gradient resolves (the count
#: off by one per row, 4-48-token rows) to 7.4 x; 4 leaves about a factor 2 on either side.
FLOOR_FACTOR = 4.0


def _fp32_context(ctx: _Context, precision: Precision, notes: list[str]) -> _Context | None:
    """The ground truth in fp32 beside the run's precision: the same model with autocast off, or, for low-precision
    parameters, an fp32 copy of the model (None, with a note, when it cannot be made)."""
    if precision.param_dtype not in _LOW:
        device = precision.autocast[0] if precision.autocast else next(ctx.model.parameters()).device.type
        return replace(ctx, amp=lambda: torch.autocast(device, enabled=False))
    try:
        model32 = copy.deepcopy(ctx.model).float()
    except (RuntimeError, MemoryError, TypeError) as err:  # out of memory, or a model that cannot be copied
        notes.append(f"the fp32 reference beside the run's precision was skipped: no fp32 copy of the model "
                     f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
        return None
    named = dict(model32.named_parameters())
    return replace(ctx, model=model32, params=[named[n] for n in ctx.names], amp=contextlib.nullcontext)


def _compare(trainer, model, recorded, returned, marks, grads, params_at, trainable, tolerance) -> VerifyReport:
    names = [n for n, _ in trainable]
    params = [p for _, p in trainable]
    world = _world()
    ga = int(trainer.args.gradient_accumulation_steps)
    first = next((b for b in recorded if "labels" in b or "shift_labels" in b), None)
    if first is None:
        raise InvalidArgumentError("verify_trainer: the trainer's batches carry no 'labels': nothing to compare with")
    rule, how, head = _detect_rule(model, first, getattr(trainer, "compute_loss_func", None))
    enc_dec = _is_encoder_decoder(model)
    ctx = _Context(model=model, names=names, params=params, keys=_forward_keys(model), rule=rule, encoder_decoder=enc_dec,
                   config=getattr(_base_model(model), "config", None), position_limit=_position_limit(model),
                   smoothing=float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0))
    from .verify_moe import router_spec

    ctx.router = router_spec(trainer, model)
    if _base_model(model) is not model and rule is CountRule.UNSHIFTED and not enc_dec:
        # PEFT prompt learning makes labels[..., 0] a target; whether the loss shifts is the base model's rule
        try:
            ctx.virtual_shift = _detect_rule(_base_model(model), first, None)[0] is CountRule.SHIFTED
        except Exception:  # noqa: BLE001 - the base model cannot be probed alone: no virtual-token shift
            ctx.virtual_shift = False
    notes: list[str] = []
    precision = run_precision(trainer, model)
    notes.extend(precision.notes)
    ctx.amp = precision.amp
    report = VerifyReport(exact=True, tolerance=tolerance, world_size=world, grad_accum=ga, packing=False,
                          trainer=type(trainer).__name__, head=head, count_rule=f"{rule.value} ({how})",
                          precision=precision.words(),
                          reference=f"{precision.words()}, as the run; fp32 beside it" if precision.mixed else precision.words())
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(_group_of(n), []).append(i)
    holds_data = _data_ranks(trainer)
    with _plain_forward(model):  # the precision of each reference is chosen here, not by accelerate's wrapper
        ctx32 = _fp32_context(ctx, precision, notes) if precision.mixed else None
        for step in range(len(grads)):
            lo = marks[step - 1] if step else 0
            window = _gather(recorded[lo:marks[step]])
            if holds_data is not None:  # one copy of each tp x cp group's batches
                window = [w for w, keep in zip(window, holds_data) if keep]
            logged_local = sum(returned[lo:marks[step]])
            logged = sum(_gather(logged_local)) / world
            with torch.no_grad():
                for n, p in trainable:
                    p.copy_(params_at[step][n].to(p.device, p.dtype))
                if ctx32 is not None and ctx32.model is not model:
                    for n, p in zip(ctx32.names, ctx32.params):
                        p.copy_(params_at[step][n].to(p.device, p.dtype))
            step_notes: list[str] = []
            refs, loss_exact, facts = references(ctx, window, grad_accum=ga, notes=step_notes)
            g = [grads[step][n] for n in names]
            step_tol, floor, fp32_errs = tolerance, None, (None, None)
            loss_tol, loss_floor = tolerance, None
            if precision.mixed:
                # The rounding floor: the ground truth against itself, summed as a trainer sums it, at the run's
                # precision (summed_like_a_trainer).  A correct run differs from the ground truth by rounding of the
                # same kind, so its error is judged against FLOOR_FACTOR x the floor (never below --tolerance).
                # The reported loss: against its own floor, the ground-truth loss in the run's layout (forward
                # rounding only: far below the gradient's); where that layout cannot be compared, the gradient's.
                summed, summed_loss = summed_like_a_trainer(ctx, window, offset=facts["offset"], N=max(facts["targets"], 1))
                rel_loss = lambda x: abs(x - loss_exact) / max(abs(loss_exact), 1e-30)  # noqa: E731
                floor = max(_rel(summed, refs["exact"]), rel_loss(summed_loss))
                step_tol = loss_tol = max(tolerance, FLOOR_FACTOR * floor)
                layout = loss_in_the_run_layout(ctx, window, offset=facts["offset"], N=max(facts["targets"], 1))
                if layout is not None:
                    loss_floor = max(rel_loss(layout), rel_loss(summed_loss))
                    loss_tol = max(tolerance, FLOOR_FACTOR * loss_floor)
                if ctx32 is not None:
                    refs32, loss32, _ = references(ctx32, window, grad_accum=ga, notes=[])
                    fp32_errs = (_rel(g, [x.cpu() for x in refs32["exact"]]),
                                 abs(logged - loss32) / max(abs(loss32), 1e-30))
                    # the bugs this precision cannot resolve: apart from the ground truth in fp32 (a real difference,
                    # not rounding), yet within the tolerance of the run's precision
                    for name, ref in refs32.items():
                        d = _rel(ref, refs32["exact"]) if name != "exact" else 0.0
                        if tolerance < d <= step_tol:
                            step_notes.append(
                                f"step {step + 1}: at {precision.words()} the gradient cannot tell the reference {name} "
                                f"from exact: they differ by {d:.1e} in fp32, within this precision's tolerance "
                                f"{step_tol:.1e} (the reported loss is judged on its own; run in fp32 to resolve the "
                                "gradient)")
                    del refs32
            _progress(f"   reference step {step + 1}/{len(grads)} computed")
            for note in step_notes:
                if note not in notes:
                    notes.append(note)
            report.packing = report.packing or facts["packed"]
            candidates = {name: _rel(g, [x.cpu() for x in ref]) for name, ref in refs.items()}
            c, scaled = _scale_fit(g, refs["exact"])
            if abs(c - 1.0) > step_tol:  # a factor indistinguishable from 1 is rounding, not a diagnosis
                candidates["scaled"] = _rel(g, [x.cpu() for x in scaled])
            loss_err = abs(logged - loss_exact) / max(abs(loss_exact), 1e-30)
            verdict = verdict_of(candidates, loss_err, step_tol, loss_tol)
            detail = ""
            if verdict == "reported_loss" and precision.mixed:
                # the gradient is within this precision's rounding of exact; a count bug too small for it to
                # resolve still shows in the loss, by its own factor
                for name, factor in facts.get("loss_factors", {}).items():
                    err = abs(logged - factor * loss_exact) / max(abs(factor * loss_exact), 1e-30)
                    if err <= loss_tol:
                        verdict = name
                        detail = (f"named by the reported loss, x{factor:.6g} the exact one to {err:.1e}; the gradient "
                                  f"is within {precision.words()}'s tolerance {step_tol:.1e} either way")
            if verdict == "scaled":
                detail = f"x{c:.6g}"
            elif verdict == "reported_loss":
                detail = f"reported {logged:.6g}, exact {loss_exact:.6g}, x{logged / loss_exact if loss_exact else math.nan:.4g}"
            elif verdict not in ("exact", "unexplained") and not detail:
                detail = f"reproduces the run to {candidates[verdict]:.1e}"
            report.steps.append(StepResult(
                step=step + 1, loss_exact=loss_exact, loss_logged=logged, loss_rel_err=loss_err,
                grad_rel_err=candidates["exact"], verdict=verdict, candidates=candidates, detail=detail,
                groups={k: _rel(g, [x.cpu() for x in refs["exact"]], idx) for k, idx in groups.items()},
                targets=facts["targets"], micro_batches=facts["micro_batches"], sequences=facts["sequences"],
                tolerance=step_tol, rounding_floor=floor, fp32_grad_rel_err=fp32_errs[0], fp32_loss_rel_err=fp32_errs[1],
                loss_floor=loss_floor, loss_tolerance=loss_tol,
            ))
            if verdict != "exact":
                report.exact = False
                if verdict not in report.broken:
                    report.broken.append(verdict)
    report.notes = notes
    if report.nothing_checked() is not None:  # never EXACT on nothing: the CLI exits 2 with the reason
        report.exact = False
    return report


# ------------------------------------------------------------------------------------------ the built-in run


def _inject_trainer(base: type, bug: str | None, grad_accum: int) -> type:
    """A Trainer subclass that plants ``bug`` in the built-in run (for proving the detector works)."""
    if bug is None:
        return base

    class Injected(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kw):
            if bug == "mean_of_means":  # the classic override: returns the model's per-micro-batch mean
                outputs = model(**inputs)
                return (outputs.loss, outputs) if return_outputs else outputs.loss
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch, **kw)
            loss, outs = (result if return_outputs else (result, None))
            if bug == "ga_scaled":
                loss = loss * grad_accum
            elif bug == "world_scaled":
                loss = loss * _world()
            return (loss, outs) if return_outputs else loss

    Injected.__name__ = f"{base.__name__}_{bug}"
    return Injected


@_progress_session
def verify(
    model: nn.Module | Callable[[], nn.Module] | None = None,
    samples: Sequence[dict] | None = None,
    *,
    config: Any = None,
    grad_accum: int = 4,
    batch_size: int = 2,
    steps: int = 2,
    packing: bool | None = None,
    inject: str | None = None,
    tolerance: float = 1e-5,
    output_dir: str | None = None,
    learning_rate: float = 1e-3,
    bf16: bool = False,
) -> VerifyReport:
    """The built-in run: a plain ``Trainer`` with the hf_gradfix configuration on a causal LM, checked by
    :func:`verify_trainer`.

    ``model``: a causal LM (or a zero-argument builder; default :func:`tiny_model`); ``samples``: dicts with
    ``input_ids`` and ``labels`` (default :func:`synthetic_samples`); ``config``: the hf_gradfix configuration
    (path, dict, or None for ``$HF_GRADFIX_CONFIG`` / defaults); ``bf16``: the Trainer's bf16 autocast (checked
    against the ground truth computed under the same autocast, and fp32 beside it).  Under ``torchrun`` / ``hf-gradfix launch``
    every rank runs it (the report is the same on every rank).
    """
    import transformers

    import hf_gradfix
    from hf_gradfix.config import load_config

    cfg = load_config(config)
    if packing is not None:
        cfg.packing.enabled = bool(packing)
    if inject is not None and inject not in BUGS:
        raise InvalidArgumentError(f"--inject {inject!r}: unknown bug; known bugs: {', '.join(BUGS)}")
    if inject == "cross_attention":
        cfg.packing.enabled = True
        cfg.packing.guard = False
        cfg.packing.attention = "keep"
    if inject == "mean_of_means":
        cfg.loss.enabled = False
    model = model() if callable(model) and not isinstance(model, nn.Module) else (model or tiny_model())
    vocab = int(getattr(model.config, "vocab_size", 128))
    launched = max(1, int(os.environ.get("WORLD_SIZE", "1")))  # the process group starts with the Trainer
    if inject == "world_scaled" and launched == 1:
        raise InvalidArgumentError("--inject world_scaled needs several ranks (run it under hf-gradfix launch)")
    samples = list(samples) if samples is not None else synthetic_samples(batch_size * grad_accum * launched * steps * 2, vocab)
    if inject == "cross_attention":
        # a model that ignores the boundaries: position_ids restarts are dropped before the forward
        model = _BoundaryBlind(model)
    out = output_dir or tempfile.mkdtemp(prefix="hf_gradfix_verify_")
    try:
        args = transformers.TrainingArguments(
            output_dir=out, report_to="none", per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=grad_accum, max_steps=steps, learning_rate=learning_rate,
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
            remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), seed=0, bf16=bf16,
        )
        base = _inject_trainer(transformers.Trainer, inject, grad_accum)
        collator = _PadCollator(int(getattr(model.config, "pad_token_id", None) or 0))
        from hf_gradfix.integration.parallel.nd import requested

        # an ND mesh (tp / FSDP2 / cp) shards the model in place when the trainer is built: keep an unsharded copy
        unsharded = copy.deepcopy(model) if requested(cfg.parallel) else None
        _progress(f"building the Trainer ({launched} rank(s), GA {grad_accum}, packing {'on' if cfg.packing.enabled else 'off'}) ...",
                  phase=True)
        trainer = base(model=model, args=args, train_dataset=_ListDataset(samples), data_collator=collator,
                       callbacks=[hf_gradfix.GradFixCallback(cfg)])
        if inject == "count_unshifted":  # a causal LM counted with the token-classification rule, planted in this
            # trainer's state (loss.count_rule: unshifted is refused: the probe contradicts it)
            from hf_gradfix.integration.state import state_of

            state_of(trainer).planted_count_rule = CountRule.UNSHIFTED
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # keep stdout for the report
        trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
        report = verify_trainer(trainer, steps=steps, tolerance=tolerance, reference_model=unsharded)
    finally:
        if output_dir is None:
            shutil.rmtree(out, ignore_errors=True)
    report.grad_accum = grad_accum
    report.packing = report.packing or cfg.packing.enabled
    return report


class _BoundaryBlind(nn.Module):
    """Wraps a model so that it ignores packed boundaries (drops position_ids / cu_seq_lens): the injected bug."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids=None, labels=None, **kw):
        for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kw.pop(key, None)
        return self.inner(input_ids=input_ids, labels=labels, **kw)


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = list(samples)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return dict(self.samples[i])


class _PadCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (-100) and builds the attention mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, feats):
        width = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(feats), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(feats), width), dtype=torch.long)
        for i, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = torch.as_tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def plot_report(report: VerifyReport, path: str) -> str:
    """Per step: the run's gradient error against the exact gradient and every reference (log scale), with the
    tolerance; the verdict in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k for s in report.steps for k in s.candidates}, key=lambda k: (k != "exact", k))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(names) + 4), 4.2))
    width = 0.8 / max(len(report.steps), 1)
    for i, s in enumerate(report.steps):
        ys = [max(s.candidates.get(k, math.nan), 1e-12) for k in names]
        ax.bar([j + i * width for j in range(len(names))], ys, width=width, label=f"step {s.step} ({s.verdict})")
    tol = max([s.tolerance for s in report.steps if s.tolerance is not None] or [report.tolerance])
    floor = f" (max over steps of {FLOOR_FACTOR:g} x the rounding floor)" if tol > report.tolerance else ""
    ax.axhline(tol, color="red", linestyle="--", label=f"tolerance {tol:.2g}{floor}")
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(report.steps) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("run's relative gradient error")
    verdict = "EXACT" if report.exact else "NOT EXACT: " + ", ".join(report.broken)
    ax.set_title(f"hf-gradfix verify ({report.trainer or 'Trainer'}): {verdict}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_loss_curves(path: str, model: Any = None, samples: Sequence[dict] | None = None, *, steps: int = 20,
                     grad_accum: int = 4, batch_size: int = 2, config: Any = None) -> str:
    """Train the same model twice on the same windows, stock (a ``compute_loss`` override returning
    ``outputs.loss``, as in transformers' docs) and with hf_gradfix, and plot each run's logged loss next to the
    exact token-mean loss at its own parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builder = model if (model is None or callable(model) and not isinstance(model, nn.Module)) else (lambda m=model: copy.deepcopy(m))
    curves = {}
    for k, (label, bug) in enumerate((("stock Trainer, compute_loss override", "mean_of_means"), ("hf_gradfix", None))):
        _progress(f"loss curves {k + 1}/2: {label}, {steps} step(s) ...")
        rep = verify(builder, samples, config=config, steps=steps, grad_accum=grad_accum, batch_size=batch_size, inject=bug,
                     learning_rate=3e-3)
        curves[label] = ([s.step for s in rep.steps], [s.loss_logged for s in rep.steps], [s.loss_exact for s in rep.steps])
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (x, logged, exact) in curves.items():
        line = ax.plot(x, logged, marker="o", label=f"{label}: logged loss")[0]
        ax.plot(x, exact, linestyle="--", color=line.get_color(), label=f"{label}: exact token-mean loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"Logged vs exact loss, GA {grad_accum}: stock Trainer and hf_gradfix")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_model(spec: str) -> nn.Module:
    """``tiny`` (the embedded default), a local directory or a hub id (a causal LM, loaded in fp32)."""
    if spec == "tiny":
        return tiny_model()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32, trust_remote_code=False)


def load_samples(path: str | None, model: nn.Module, model_spec: str, n: int, max_len: int = 256) -> list[dict]:
    """Samples from a ``.jsonl`` of ``input_ids`` (and optional ``labels``), or a text file (one sample per
    paragraph; the model's tokenizer, or bytes for the tiny default), or synthetic ones."""
    vocab = int(getattr(model.config, "vocab_size", 128))
    if path is None:
        return synthetic_samples(n, vocab)
    if path.endswith(".jsonl"):
        out = []
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    d = json.loads(line)
                    ids = list(d["input_ids"])[:max_len]
                    out.append({"input_ids": ids, "labels": list(d.get("labels", ids))[:max_len]})
        return out
    text = open(path, encoding="utf-8").read()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if model_spec == "tiny":
        encode = lambda t: [3 + b % (vocab - 3) for b in t.encode("utf-8")]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_spec, trust_remote_code=False)
        encode = lambda t: tok(t)["input_ids"]  # noqa: E731
    out = []
    for p in paragraphs:
        ids = encode(p)[:max_len]
        if len(ids) >= 2:
            out.append({"input_ids": ids, "labels": list(ids)})
    return out
