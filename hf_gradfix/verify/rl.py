"""The ground truth of ``hf-gradfix verify`` for policy-gradient runs (TRL's ``GRPOTrainer`` family, ``RLOOTrainer``).

A run is one when what its loss function (``compute_loss``) is given is a batch of generated completions: the
tensors ``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask`` and ``advantages``
(:func:`is_policy_gradient_batch`; decided by the batch, not by the trainer's class).
:func:`hf_gradfix.verify.verify_trainer` then records every training micro-batch's loss inputs (the completions, their
masks, the advantages, the old / reference / sampling log-probs TRL computed at generation) and the gradient just
before the optimizer step, and :func:`compare` recomputes each optimizer step's objective from those tensors:

* each completion token's log-probability and entropy under ``softmax(logits / temperature)``, every completion on its
  own (its real prompt tokens, then its completion; no padding), in **float64** on a copy of the model, one process;
* each loss type's per-token value from its definition: the clipped surrogate (``grpo``, ``bnpo``, ``dr_grpo``,
  ``dapo``, ``luspo``; ``delta``'s two-sided clip), CISPO's clipped detached weight, SAPO's soft gate, VESPO's detached
  sequence weight; token or sequence importance sampling; the KL term ``beta x (e^(ref - logp) - (ref - logp) - 1)``
  from the recorded reference log-probs; the off-policy mask; vLLM's importance-sampling ratio (recorded);
* aggregated over **every micro-batch of the optimizer window on every rank** by the loss type's objective: the token
  mean for ``dapo``, ``cispo``, ``vespo``, ``bnpo``; the sequence mean for ``grpo``, ``sapo`` (each completion's token
  mean), ``luspo`` (its token sum), ``dr_grpo`` (its token sum / ``max_completion_length``) and RLOO (its
  sequence-level clipped surrogate); the entropy bonus as ``- coef x`` the window's token mean of the entropy.

Written from the loss types' definitions, independently of :mod:`hf_gradfix.integration.rl` (which changes TRL's
divisions) and of TRL's ``_compute_loss`` (which computes them on padded micro-batches).

The references a NOT EXACT run is compared with (each named only when it reproduces the run's gradient within the
step's tolerance, as for every other run):

===================================  =========================================================================
``expected_window_count``            each micro-batch divided by the *expected* window count: the generation batch's
                                     completion tokens x GA / ``steps_per_generation`` (TRL's ``dapo`` / ``cispo`` /
                                     ``vespo`` divisor; exact only when ``steps_per_generation`` == GA)
``mean_of_micro_means``              each micro-batch normalized by its own tokens (sequences), the micro-batch means
                                     averaged over the window (TRL's ``bnpo``)
``entropy_mean_of_micro_means``      the entropy bonus as the mean of micro-batch token means (TRL's, every loss type)
``ga_scaled`` / ``world_scaled``     the exact gradient times GA / the ranks
===================================  =========================================================================

and their combinations (``expected_window_count+entropy_mean_of_micro_means``: stock TRL's dapo with an entropy bonus).

>>> import torch
>>> keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
>>> batch = {k: torch.zeros(2, 3, dtype=torch.long) for k in keys}
>>> is_policy_gradient_batch(batch), is_policy_gradient_batch({**batch, "advantages": torch.zeros(2)})
(False, True)
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .reference import (_data_ranks, _gather, _grads, _group_of, _plain_forward, _rel, _scale_fit, _world,
                        run_precision)
from .report import StepResult, VerifyReport, _progress, verdict_of

__all__ = ["is_policy_gradient_batch", "PolicySettings", "settings_of", "window_terms", "compare", "TOKEN_MEAN_TYPES",
           "SEQUENCE_MEAN_TYPES", "ENTROPY_COEF_KEY"]

#: The tensors a policy-gradient trainer's loss function is given (TRL's GRPO family and RLOO).
RL_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
#: Loss types whose objective is the token mean over the window's completion tokens.
TOKEN_MEAN_TYPES = ("dapo", "cispo", "vespo", "bnpo")
#: Loss types whose objective is the mean over the window's completions (RLOO too).
SEQUENCE_MEAN_TYPES = ("grpo", "sapo", "luspo", "dr_grpo", "rloo")
#: Key under which verify stores, with each recorded micro-batch, the entropy coefficient TRL applies to it.
ENTROPY_COEF_KEY = "_hf_gradfix_verify_entropy_coef"
#: Inputs of a multimodal policy forward: the reference runs text-only forwards.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                    "mm_token_type_ids", "image_position_ids", "spatial_shapes", "num_tiles")


def is_policy_gradient_batch(inputs: Any) -> bool:
    """Whether a loss function's inputs are a policy-gradient micro-batch: generated completions with advantages."""
    return isinstance(inputs, Mapping) and all(torch.is_tensor(inputs.get(k)) for k in RL_KEYS)


# ------------------------------------------------------------------------------------------ the run's settings


@dataclass
class PolicySettings:
    """What the objective needs besides the recorded tensors: the loss type and its hyper-parameters."""

    loss_type: str  # a GRPO loss_type, or "rloo"
    temperature: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    bias_correction_kl: bool = False
    max_completion_length: float = 1.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg
    off_policy_mask_threshold: float | None = None
    vllm_is_correction: bool = False
    entropy_bonus: bool = False
    grad_accum: int = 1
    steps_per_generation: int = 1

    @property
    def token_mean(self) -> bool:
        return self.loss_type in TOKEN_MEAN_TYPES

    def exact_words(self) -> str:
        """The objective, short: what an exact step equals."""
        if self.token_mean:
            return "the token mean over every completion token of the window on every rank"
        return "the mean over every completion of the window on every rank"

    def objective_words(self) -> str:
        if self.loss_type == "rloo":
            what = "RLOO: the mean over the window's completions of their clipped sequence-level surrogate"
        elif self.token_mean:
            what = f"loss_type={self.loss_type}: the token mean over the window's completion tokens"
        else:
            value = {"grpo": "token mean", "sapo": "token mean", "luspo": "token sum",
                     "dr_grpo": "token sum / max_completion_length"}[self.loss_type]
            what = f"loss_type={self.loss_type}: the mean over the window's completions of each one's {value}"
        extra = []
        if self.beta:
            extra.append(f"KL term beta {self.beta:g} from the recorded reference log-probs")
        if self.entropy_bonus:
            extra.append("entropy bonus as the window's token mean")
        return "policy gradient, " + what + (f" (+ {', '.join(extra)})" if extra else "")


def settings_of(trainer: Any, batch: Mapping) -> PolicySettings:
    """The settings of ``trainer`` for a recorded policy-gradient ``batch``; :class:`InvalidArgumentError` for what the
    ground truth does not compute (it would be compared with another objective than the run's)."""
    args = trainer.args
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type is None and torch.is_tensor(batch.get("old_logps")):
        loss_type = "rloo"  # sequence-level old log-probs and no loss_type: TRL's RLOO loss
    if loss_type not in TOKEN_MEAN_TYPES + SEQUENCE_MEAN_TYPES:
        raise InvalidArgumentError(
            f"hf-gradfix verify: {type(trainer).__name__} trains on generated completions (a policy-gradient loss), "
            f"but its loss_type {loss_type!r} is not one verify's ground truth computes (GRPO: "
            f"{', '.join(TOKEN_MEAN_TYPES + SEQUENCE_MEAN_TYPES[:-1])}; RLOO)")
    unsupported = []
    if float(getattr(trainer, "top_entropy_quantile", 1.0) or 1.0) < 1.0:
        unsupported.append(f"top_entropy_quantile={trainer.top_entropy_quantile} (a token subset chosen inside each "
                           "forward)")
    if getattr(trainer, "aux_loss_enabled", False):
        unsupported.append("a MoE router's aux loss")
    multimodal = [k for k in _MULTIMODAL_KEYS if batch.get(k) is not None]
    if multimodal:
        unsupported.append(f"multimodal inputs ({', '.join(multimodal)})")
    if unsupported:
        raise InvalidArgumentError(
            f"hf-gradfix verify: {type(trainer).__name__} (loss_type={loss_type}) uses {'; '.join(unsupported)}, which "
            "verify's policy-gradient ground truth does not compute; nothing was checked")
    ga = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    return PolicySettings(
        loss_type=loss_type,
        temperature=float(getattr(trainer, "temperature", getattr(args, "temperature", 1.0)) or 1.0),
        epsilon_low=float(getattr(trainer, "epsilon_low", getattr(args, "epsilon", 0.2))),
        epsilon_high=float(getattr(trainer, "epsilon_high", getattr(args, "epsilon", 0.2))),
        delta=getattr(args, "delta", None) if loss_type != "rloo" else None,
        importance_sampling_level=str(getattr(trainer, "importance_sampling_level", "token") or "token"),
        beta=float(getattr(trainer, "beta", 0.0) or 0.0) if loss_type != "rloo" else 0.0,  # RLOO: KL in the reward
        bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        max_completion_length=float(getattr(trainer, "max_completion_length",
                                            getattr(args, "max_completion_length", 1))),
        sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
        sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
        vespo=tuple(float(getattr(args, k, d)) for k, d in (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0),
                                                             ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0))),
        off_policy_mask_threshold=getattr(trainer, "off_policy_mask_threshold", None),
        vllm_is_correction=bool(getattr(trainer, "use_vllm", False)
                                and getattr(trainer, "vllm_importance_sampling_correction", False)),
        entropy_bonus=bool(getattr(trainer, "_entropy_bonus_enabled", False)) and loss_type != "rloo",
        grad_accum=ga,
        steps_per_generation=int(getattr(args, "steps_per_generation", None) or ga),
    )


def entropy_coefficient(trainer: Any) -> float:
    """The entropy-bonus coefficient the trainer applies to the micro-batch it is about to train on (read before its
    loss: TRL's adaptive controller moves it after the window's last micro-batch); 0 without a bonus."""
    if not getattr(trainer, "_entropy_bonus_enabled", False):
        return 0.0
    coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if getattr(trainer, "use_adaptive_entropy", False):
        last = float(getattr(trainer, "_last_world_entropy", float("inf")))
        if last > float(getattr(trainer.args, "entropy_target", float("inf"))):
            coef = 0.0
    return coef


# ------------------------------------------------------------------------------------------ the objective


@dataclass
class MicroBatchTerms:
    """One micro-batch's parts of the window objective: ``policy`` = the sum of its units' values (tokens or
    completions), ``entropy`` = the sum of its completion tokens' entropies (graphs to the model), and its counts."""

    policy: torch.Tensor
    entropy: torch.Tensor
    tokens: float
    sequences: int
    units: float  # tokens (token-mean types) or sequences
    magnitude: float  # the sum of |unit value|: the scale of the loss, for its relative error
    coef: float  # the entropy coefficient applied to this micro-batch
    expected_count: float | None  # TRL's num_items_in_batch (the generation batch's tokens, every rank)


def _row_logps(model: nn.Module, prompt: torch.Tensor, completion: torch.Tensor, temperature: float,
               amp: Callable[[], contextlib.AbstractContextManager],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, entropy) of each completion token, one completion alone: its prompt then its completion."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt, completion]).unsqueeze(0).to(device)
    with amp():
        out = model(input_ids=ids, use_cache=False)
    logits = out["logits"] if isinstance(out, Mapping) else out.logits
    logits = logits[0, prompt.shape[0] - 1:-1].to(dtype) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, completion.to(device).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _gamma_weight(adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, s: PolicySettings,
                  is_ratio: torch.Tensor | None) -> torch.Tensor:
    """VESPO's sequence weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1), w the completion's importance ratio,
    computed in log space with the paper's clamps, detached (it scales the gradient only)."""
    k_pos, lam_pos, k_neg, lam_neg = s.vespo
    lower = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lam_pos), torch.full_like(log_w, lam_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0).detach()


def _padded_logps(model: nn.Module, mb: Mapping, temperature: float, amp: Callable[[], contextlib.AbstractContextManager],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, entropy) of every completion position from one forward of the whole micro-batch as the trainer
    fed it (prompts and completions side by side with their masks): the run's own layout, for the loss floor."""
    device = next(model.parameters()).device
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1).to(device)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1).to(device)
    width = mb["completion_ids"].shape[1]
    with amp():
        out = model(input_ids=ids, attention_mask=attention, use_cache=False)
    logits = out["logits"] if isinstance(out, Mapping) else out.logits
    logp_all = torch.log_softmax(logits[:, -width - 1:-1].to(dtype) / temperature, dim=-1)
    logp = logp_all.gather(-1, mb["completion_ids"].to(device).unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def micro_batch_terms(model: nn.Module, mb: Mapping, s: PolicySettings, *,
                      amp: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      dtype: torch.dtype = torch.float64, padded: bool = False) -> MicroBatchTerms:
    """One recorded micro-batch's terms at ``model``'s weights, computed in ``dtype`` from each completion's own
    forward (under ``amp``: the run's autocast, for the rounding floor; ``padded``: one forward of the micro-batch as
    the trainer fed it, for the loss floor)."""
    device = next(model.parameters()).device
    cmask = mb["completion_mask"]
    mask = cmask.to(device, dtype)
    if torch.is_tensor(mb.get("tool_mask")):
        mask = mask * mb["tool_mask"].to(device, dtype)
    rows, width = cmask.shape
    ends = [int(torch.nonzero(cmask[i]).max()) + 1 if bool(cmask[i].any()) else 0 for i in range(rows)]
    if padded:  # positions past a completion's end are 0, as below
        logp, entropy = _padded_logps(model, mb, s.temperature, amp, dtype)
        live = (torch.arange(width, device=device).unsqueeze(0) < torch.tensor(ends, device=device).unsqueeze(1))
        logp, entropy = logp * live, entropy * live
    else:
        logps, entropies = [], []
        for i, n in enumerate(ends):
            logp = torch.zeros(width, dtype=dtype, device=device)
            entropy = torch.zeros(width, dtype=dtype, device=device)
            if n:
                prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
                lp, en = _row_logps(model, prompt, mb["completion_ids"][i][:n], s.temperature, amp, dtype)
                logp = torch.cat([lp, logp[n:]])
                entropy = torch.cat([en, entropy[n:]])
            logps.append(logp)
            entropies.append(entropy)
        logp, entropy = torch.stack(logps), torch.stack(entropies)
    on = mask > 0
    adv = mb["advantages"].to(device, dtype)
    if s.loss_type == "rloo":
        cm = cmask.to(device, dtype)
        seq_logp = (logp * cm).sum(1)
        old = mb["old_logps"].to(device, dtype) if torch.is_tensor(mb.get("old_logps")) else seq_logp.detach()
        ratio = torch.exp(seq_logp - old)
        clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
        unit = -torch.min(ratio * adv, clipped * adv)  # one value per completion
    else:
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        old = mb.get("old_per_token_logps")
        # off the loss mask the ratio is 1 and the KL 0 (those positions never enter the loss; this keeps them finite)
        old = torch.where(on, old.to(device, dtype), logp.detach()) if torch.is_tensor(old) else logp.detach()
        log_ratio = logp - old
        if s.importance_sampling_level == "sequence":
            log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            log_w = log_ratio
        ratio = torch.exp(log_w)
        is_ratio = mb.get("importance_sampling_ratio")
        is_ratio = is_ratio.to(device, dtype) if torch.is_tensor(is_ratio) and s.vllm_is_correction else None
        if s.loss_type == "cispo":
            loss = -torch.clamp(ratio, max=s.epsilon_high).detach() * adv * logp
        elif s.loss_type == "sapo":
            temp = torch.where(adv > 0, torch.full_like(adv, s.sapo_temperature_pos),
                               torch.full_like(adv, s.sapo_temperature_neg))
            loss = -torch.sigmoid(temp * (ratio - 1)) * 4 / temp * adv
        elif s.loss_type == "vespo":
            loss = -_gamma_weight(adv, log_ratio, mask, s, is_ratio) * adv * logp
        else:  # grpo, bnpo, dr_grpo, dapo, luspo: the clipped surrogate (delta: the two-sided clip of the ratio)
            clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
            upper = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
            loss = -torch.min(upper * adv, clipped * adv)
        if s.off_policy_mask_threshold is not None:
            sampled = mb.get("sampling_per_token_logps")
            sampled = sampled.to(device, dtype) if torch.is_tensor(sampled) else old
            kl = torch.nan_to_num(sampled - logp.detach(), nan=0.0)
            seq_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
            loss = loss * ((adv >= 0) | (seq_kl <= s.off_policy_mask_threshold)).to(dtype)
        if is_ratio is not None and s.loss_type != "vespo":
            loss = loss * is_ratio
        if s.beta:
            ref = mb.get("ref_per_token_logps")
            if not torch.is_tensor(ref):
                raise InvalidArgumentError("hf-gradfix verify: beta != 0 but the recorded micro-batch has no "
                                           "ref_per_token_logps: the KL term cannot be computed")
            ref = torch.where(on, ref.to(device, dtype), logp.detach())
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if s.bias_correction_kl:
                kl = kl * ratio
            loss = loss + s.beta * kl
        loss = loss * mask
        if s.token_mean:
            unit = loss
        elif s.loss_type in ("grpo", "sapo"):
            unit = loss.sum(-1) / mask.sum(-1).clamp(min=1.0)
        elif s.loss_type == "luspo":
            unit = loss.sum(-1)
        else:  # dr_grpo
            unit = loss.sum(-1) / s.max_completion_length
    tokens = float(mask.sum())
    expected = mb.get("num_items_in_batch")
    return MicroBatchTerms(
        policy=unit.sum(), entropy=(entropy * mask).sum(), tokens=tokens, sequences=rows,
        units=tokens if s.token_mean else float(rows), magnitude=float(unit.detach().abs().sum()),
        coef=float(mb.get(ENTROPY_COEF_KEY, 0.0) or 0.0) if s.entropy_bonus else 0.0,
        expected_count=float(expected) if torch.is_tensor(expected) or isinstance(expected, (int, float)) else None)


def _grad(out: torch.Tensor, params: Sequence[nn.Parameter], retain: bool) -> list[torch.Tensor]:
    if not out.requires_grad:
        return [torch.zeros_like(p) for p in params]
    gs = torch.autograd.grad(out, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, gs)]


def _lin(parts: Sequence[tuple[float, list[torch.Tensor]]], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    acc = [torch.zeros_like(x) for x in like]
    for w, g in parts:
        if w:
            for a, x in zip(acc, g):
                a.add_(x, alpha=w)
    return acc


@dataclass
class WindowTerms:
    """Every micro-batch's terms and gradients (of its policy sum and entropy sum) for one optimizer window."""

    terms: list[MicroBatchTerms]
    policy_grads: list[list[torch.Tensor]]
    entropy_grads: list[list[torch.Tensor] | None]

    @property
    def tokens(self) -> float:
        return sum(t.tokens for t in self.terms)

    @property
    def units(self) -> float:
        return sum(t.units for t in self.terms)


def window_terms(model: nn.Module, params: Sequence[nn.Parameter], window: Sequence[Mapping],
                 s: PolicySettings) -> WindowTerms:
    """Each micro-batch's terms (float64 on ``model``, a float64 copy) and the gradients of its two sums."""
    terms, pg, eg = [], [], []
    for mb in window:
        t = micro_batch_terms(model, mb, s)
        with_entropy = s.entropy_bonus and t.coef != 0.0
        pg.append(_grad(t.policy, params, retain=with_entropy))
        eg.append(_grad(t.entropy, params, retain=False) if with_entropy else None)
        t.policy, t.entropy = t.policy.detach(), t.entropy.detach()
        terms.append(t)
    return WindowTerms(terms, pg, eg)


def references(w: WindowTerms, s: PolicySettings, *, world: int,
               micro_batches_per_rank: int) -> tuple[dict, dict, float]:
    """(reference gradients by name, the window loss of each reference by name, the loss's magnitude) for one window.

    ``exact``: the policy sums over the window's units (tokens / completions) on every rank, minus each micro-batch's
    entropy coefficient x its entropy sum over the window's tokens. The references change one aggregation each (their
    names joined by ``+`` when both change)."""
    like = w.policy_grads[0]
    terms = w.terms
    U = max(w.units, 1.0)
    T = max(w.tokens, 1.0)
    M = len(terms)
    policy = {"": [(1.0 / U, g) for g in w.policy_grads]}
    policy_loss = {"": sum(float(t.policy) for t in terms) / U}
    if all(t.units > 0 for t in terms):
        policy["mean_of_micro_means"] = [(1.0 / (M * t.units), g) for t, g in zip(terms, w.policy_grads)]
        policy_loss["mean_of_micro_means"] = sum(float(t.policy) / t.units for t in terms) / M
    if s.token_mean and s.loss_type != "bnpo" and all(t.expected_count for t in terms):
        # TRL: per rank, num_items_in_batch / ranks x GA / steps_per_generation; the ranks' gradients averaged
        scale = s.grad_accum / s.steps_per_generation
        policy["expected_window_count"] = [(1.0 / (t.expected_count * scale), g) for t, g in zip(terms, w.policy_grads)]
        policy_loss["expected_window_count"] = sum(float(t.policy) / (t.expected_count * scale) for t in terms)
    bonus = s.entropy_bonus and any(t.coef for t in terms)
    entropy = {"": [(-t.coef / T, g) for t, g in zip(terms, w.entropy_grads) if g is not None]}
    entropy_loss = {"": -sum(t.coef * float(t.entropy) for t in terms) / T}
    if bonus and all(t.tokens > 0 for t in terms):
        entropy["entropy_mean_of_micro_means"] = [(-t.coef / (M * t.tokens), g) for t, g in zip(terms, w.entropy_grads)
                                                  if g is not None]
        entropy_loss["entropy_mean_of_micro_means"] = -sum(t.coef * float(t.entropy) / t.tokens for t in terms) / M
    refs: dict[str, list[torch.Tensor]] = {}
    losses: dict[str, float] = {}
    for p_name, p_parts in policy.items():
        for e_name, e_parts in entropy.items():
            name = "+".join(n for n in (p_name, e_name) if n) or "exact"
            refs[name] = _lin(list(p_parts) + list(e_parts), like)
            losses[name] = policy_loss[p_name] + entropy_loss[e_name]
    exact = refs["exact"]
    ga = max(1, micro_batches_per_rank)
    if ga > 1:
        refs["ga_scaled"] = [ga * x for x in exact]
        losses["ga_scaled"] = ga * losses["exact"]
    if world > 1:
        refs["world_scaled"] = [world * x for x in exact]
        losses["world_scaled"] = world * losses["exact"]
    magnitude = sum(t.magnitude for t in terms) / U + sum(abs(t.coef) * float(t.entropy) for t in terms) / T
    return refs, losses, magnitude


# ------------------------------------------------------------------------------------------ the comparison


def _float64_copy(model: nn.Module, notes: list[str]) -> nn.Module | None:
    """A float64 copy of the model with every instance-level forward wrapper dropped (TRL's fused log-prob head,
    accelerate's autocast wrapper: the class's own forward computes the logits), in eval mode (no dropout, no
    activation checkpointing). None, with a note, where it cannot be made (memory)."""
    try:
        ref = copy.deepcopy(model)
        for m in ref.modules():
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_original_forward", None)
        ref = ref.double().eval()
    except (RuntimeError, MemoryError, TypeError) as err:
        first = str(err).splitlines()[0][:120] if str(err) else ""
        notes.append(f"no float64 copy of the model ({type(err).__name__}: {first}); the ground truth is computed in "
                     "the model's own precision")
        return None
    for p in ref.parameters():
        p.requires_grad_(True)
    return ref


def _run_precision_floor(model: nn.Module, params: Sequence[nn.Parameter], window: Sequence[Mapping], s: PolicySettings,
                         amp: Callable[[], contextlib.AbstractContextManager], w: WindowTerms,
                         exact: Sequence[torch.Tensor], loss_exact: float, magnitude: float) -> tuple[float, float]:
    """The rounding floors of the run's precision on this window, against the float64 ground truth (relative):

    * gradient: the same objective computed at the run's precision (its autocast, its parameters), each completion
      alone, summed as a trainer sums it (each micro-batch's part backpropagated alone, the gradients accumulated in
      the parameters' dtype);
    * loss: the larger of that objective's value and the value from forwards in the run's own layout (each micro-batch
      padded, as the trainer fed it; forward only)."""
    acc = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in params]
    U, T = max(w.units, 1.0), max(w.tokens, 1.0)
    total = layout = 0.0
    for mb in window:
        t = micro_batch_terms(model, mb, s, amp=amp, dtype=torch.float32)
        part = t.policy / U - (t.coef * t.entropy / T if t.coef else 0.0)
        total += float(part.detach())
        for a, g in zip(acc, _grads(model, [], list(params), part)):
            a.add_(g.to(a.device, a.dtype))
        with torch.no_grad():
            t = micro_batch_terms(model, mb, s, amp=amp, dtype=torch.float32, padded=True)
            layout += float(t.policy) / U - t.coef * float(t.entropy) / T
    scale = max(abs(loss_exact), magnitude, 1e-30)
    return (_rel([a.float().cpu() for a in acc], exact),
            max(abs(total - loss_exact), abs(layout - loss_exact)) / scale)


def compare(trainer: Any, model: nn.Module, batches: list[dict], rl_marks: list[int], returned: list[float],
            marks: list[int], grads: list[dict[str, torch.Tensor]], params_at: list[dict[str, torch.Tensor]],
            trainable: list[tuple[str, nn.Parameter]], tolerance: float):
    """The report of a policy-gradient run: each optimizer step's recorded gradient and reported loss against the
    window objective recomputed in float64 from the recorded micro-batches (every rank's, gathered), at the
    parameters of that step."""
    from .report import FLOOR_FACTOR  # read at each call: widening it on hf_gradfix.verify.report reaches the RL run

    names = [n for n, _ in trainable]
    params = [p for _, p in trainable]
    world = _world()
    s = settings_of(trainer, batches[0])
    notes: list[str] = []
    holes = sum(int(((mb["completion_mask"][:, 1:] > mb["completion_mask"][:, :-1])).any(1).sum()) for mb in batches)
    if holes:
        notes.append(f"{holes} completion(s) have a completion_mask with holes: the reference attends to the masked "
                     "tokens inside a completion (the run's forward masks them in attention)")
    precision = run_precision(trainer, model)
    notes.extend(precision.notes)
    report = VerifyReport(exact=True, tolerance=tolerance, world_size=world, grad_accum=s.grad_accum, packing=False,
                          trainer=type(trainer).__name__, head=s.objective_words(),
                          count_rule=("completion tokens (completion_mask x tool_mask)" if s.token_mean
                                      else "completions") + " over every micro-batch of the window on every rank",
                          precision=precision.words(), objective=s.exact_words(),
                          reference="float64 (each completion alone, one process)" +
                          (f"; {precision.words()} beside it for the rounding floor" if precision.mixed else ""))
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(_group_of(n), []).append(i)
    holds_data = _data_ranks(trainer)
    with _plain_forward(model):
        ref_model = _float64_copy(model, notes)
        if ref_model is None:
            ref_model, ref_params = model, params
        else:
            named = dict(ref_model.named_parameters())
            ref_params = [named[n] for n in names]
        for step in range(len(grads)):
            lo, rl_lo = (marks[step - 1], rl_marks[step - 1]) if step else (0, 0)
            local = batches[rl_lo:rl_marks[step]]
            per_rank = _gather(local)
            if holds_data is not None:
                per_rank = [w for w, keep in zip(per_rank, holds_data) if keep]
            window = [mb for rank in per_rank for mb in rank]
            logged = sum(_gather(sum(returned[lo:marks[step]]))) / world
            with torch.no_grad():
                for n, p in trainable:
                    p.copy_(params_at[step][n].to(p.device, p.dtype))
                if ref_model is not model:
                    for n, p in zip(names, ref_params):
                        p.copy_(params_at[step][n].to(p.device, p.dtype))
            if not window:
                notes.append(f"step {step + 1}: no micro-batch was recorded")
                continue
            w = window_terms(ref_model, ref_params, window, s)
            per_rank_mbs = max(len(r) for r in per_rank)
            refs, ref_losses, magnitude = references(w, s, world=len(per_rank), micro_batches_per_rank=per_rank_mbs)
            loss_exact = ref_losses["exact"]
            refs = {k: [x.float().cpu() for x in v] for k, v in refs.items()}
            g = [grads[step][n] for n in names]
            step_tol = loss_tol = tolerance
            floor = loss_floor = None
            if precision.mixed:
                floor, loss_floor = _run_precision_floor(model, params, window, s, precision.amp, w, refs["exact"],
                                                         loss_exact, magnitude)
                step_tol = max(tolerance, FLOOR_FACTOR * floor)
                loss_tol = max(tolerance, FLOOR_FACTOR * loss_floor)
            del w
            candidates = {name: _rel(g, ref) for name, ref in refs.items()}
            c, scaled = _scale_fit(g, refs["exact"])
            if abs(c - 1.0) > step_tol:
                candidates["scaled"] = _rel(g, scaled)
            # the loss's scale: |loss| or, where the terms cancel (advantages sum to 0 in a group), the mean |term|
            scale = max(abs(loss_exact), magnitude, 1e-30)
            loss_err = abs(logged - loss_exact) / scale
            verdict = verdict_of(candidates, loss_err, step_tol, loss_tol)
            detail = ""
            if verdict == "reported_loss" and precision.mixed:
                # a bug the gradient cannot resolve at this precision (it is within the floor of exact) can still show
                # in the reported loss: the reference whose window loss the run reported, its gradient within tolerance
                fits = {k: abs(logged - v) / scale for k, v in ref_losses.items()
                        if k != "exact" and candidates.get(k, math.inf) <= step_tol}
                fits = {k: v for k, v in fits.items() if v <= loss_tol}
                if fits:
                    verdict = min(fits, key=fits.get)
                    detail = (f"named by the reported loss: {logged:.6g} against {ref_losses[verdict]:.6g} for this "
                              f"reference ({fits[verdict]:.1e}), exact {loss_exact:.6g}; the gradient is within "
                              f"{precision.words()}'s tolerance {step_tol:.1e} of both")
            if not detail and verdict == "scaled":
                detail = f"x{c:.6g}"
            elif not detail and verdict == "reported_loss":
                detail = f"reported {logged:.6g}, exact {loss_exact:.6g}"
            elif not detail and verdict not in ("exact", "unexplained"):
                detail = f"reproduces the run to {candidates[verdict]:.1e}"
            report.steps.append(StepResult(
                step=step + 1, loss_exact=loss_exact, loss_logged=logged, loss_rel_err=loss_err,
                grad_rel_err=candidates["exact"], verdict=verdict, candidates=candidates, detail=detail,
                groups={k: _rel(g, refs["exact"], idx) for k, idx in groups.items()},
                targets=int(round(sum(float(_mask_sum(mb)) for mb in window))), micro_batches=len(window),
                sequences=sum(int(mb["completion_mask"].shape[0]) for mb in window),
                tolerance=step_tol, rounding_floor=floor, loss_floor=loss_floor if precision.mixed else None,
                loss_tolerance=loss_tol,
            ))
            _progress(f"   reference step {step + 1}/{len(grads)} computed")
            if verdict != "exact":
                report.exact = False
                if verdict not in report.broken:
                    report.broken.append(verdict)
        if ref_model is not model:
            del ref_model
    report.notes = notes
    if report.nothing_checked() is not None:  # never EXACT on nothing: the CLI exits 2 with the reason
        report.exact = False
    return report


def _mask_sum(mb: Mapping) -> torch.Tensor:
    mask = mb["completion_mask"].float()
    return (mask * mb["tool_mask"].float()).sum() if torch.is_tensor(mb.get("tool_mask")) else mask.sum()
