"""TRL's policy-gradient trainers (``GRPOTrainer``, ``RLOOTrainer`` and their subclasses), exact over the window.
TRL's experimental ``AsyncGRPOTrainer`` (packed rollouts, no generation buffer) is routed from here to
:mod:`hf_gradfix.integration.rl.asynchronous`.

TRL normalizes each micro-batch of a GRPO-family loss by a local or an *expected* count: ``dapo`` / ``cispo`` /
``vespo`` by the generation batch's token count times ``GA / steps_per_generation`` (exact only when the two are
equal), ``bnpo`` by the micro-batch's own token count, the sequence-mean types by the micro-batch's sequence count,
the entropy bonus by the micro-batch's token count, each then divided by the accumulation steps. hf_gradfix keeps
every per-token value TRL computes (the clipped surrogate, the KL term, importance weights, masks) and changes only
the division: each term becomes its declared objective (:data:`hf_gradfix.loss.objective.RL_LOSS_TYPES`) over the real
optimizer window, i.e. the window's completion tokens or sequences counted over every micro-batch and every data
rank before its first backward.

How, without copying TRL's loss: TRL's micro-batch loss is ``P / a - c * E / b + k * X / g`` (policy, entropy bonus,
MoE aux), with ``a, b, g`` TRL's normalizers (:func:`_trl_policy_normalizer`, one table per TRL release, version-gated
by :data:`SUPPORTED_TRL`). The entropy sum ``E`` and aux ``X`` are read from TRL's own log-prob forward (the same
tensors, so the subtraction is exact); the policy part is what remains. The window's counts come from TRL's buffered
generation batch, which holds every micro-batch of the window once ``steps_per_generation`` is a multiple of the
accumulation steps (TRL's default: equal). Anything else (another TRL release, a window spanning two generation
batches, ``top_entropy_quantile < 1``) trains exactly as TRL computes it, with one warning.

>>> from hf_gradfix.integration.rl.policy_gradient import SUPPORTED_TRL
>>> "1.16.0" in SUPPORTED_TRL
True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from ...loss.objective import MICRO_MEAN, RL_LOSS_TYPES, SEQUENCE_MEAN, TOKEN_MEAN, Objective, PolicyLoss
from .plan import RLPlan

logger = logging.getLogger("hf_gradfix")

#: TRL releases whose GRPO / RLOO normalizers (:func:`_trl_policy_normalizer`) were read and tested.
SUPPORTED_TRL = SpecifierSet(">=1.16,<1.17")

#: The modules whose loss code the normalizers of :func:`_trl_policy_normalizer` were read from.
_TRL_LOSS_MODULES = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")

#: Keys of a micro-batch TRL's policy-gradient trainers give compute_loss (what makes a trainer one of them).
_RL_KEYS = ("prompt_ids", "completion_ids", "completion_mask", "advantages")


def _trl_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - not installed, or metadata missing
        return None


def _loss_mask(inputs: Mapping) -> torch.Tensor:
    """TRL's loss mask: the completion mask, times the tool mask of multi-turn rollouts."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if torch.is_tensor(inputs.get("tool_mask")) else mask


def detect(trainer: Any, inputs: Any, scaled_for_ga: Any) -> RLPlan | str | None:
    """An :class:`RLPlan` for a TRL policy-gradient trainer it can make exact; a reason (str) for one it recognizes but
    leaves to TRL; None for any other trainer. Decided by what compute_loss is given and what the trainer holds, not
    by its class. ``scaled_for_ga``: the trainer's own ``loss_is_scaled_for_ga`` (TRL's GRPO: True, RLOO: False)."""
    from . import asynchronous as rl_async

    if rl_async.is_async_layout(inputs):  # AsyncGRPO's packed rollouts (trl.experimental.async_grpo)
        return rl_async.detect(trainer, inputs, scaled_for_ga, SUPPORTED_TRL, _trl_version())
    if not isinstance(inputs, Mapping) or not all(torch.is_tensor(inputs.get(k)) for k in _RL_KEYS):
        return None
    if not hasattr(trainer, "_buffered_inputs") or not callable(getattr(trainer, "_get_per_token_logps_and_entropies", None)):
        return None
    name = type(trainer).__name__
    # The normalizers below are those of TRL's own GRPO / RLOO loss code: a subclass that computes its loss in code of
    # its own (TRL's experimental GMPO, A2PO, ...) has other ones, which nobody read.
    for method in ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies"):
        owner = next((k for k in type(trainer).__mro__ if method in k.__dict__
                      and not k.__module__.startswith("hf_gradfix.")), None)
        if owner is None or owner.__module__ not in _TRL_LOSS_MODULES:
            where = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else "nowhere"
            return (f"hf_gradfix: {name} is a TRL policy-gradient trainer whose {method} is its own ({where}); "
                    f"hf_gradfix knows the normalizers of TRL's GRPOTrainer and RLOOTrainer code only, so {name} "
                    "trains exactly as it computes its loss.")
    version = _trl_version()
    if version is None or version not in SUPPORTED_TRL:
        return (f"hf_gradfix: {name} is a TRL policy-gradient trainer, but hf_gradfix knows its loss normalizers for "
                f"TRL {SUPPORTED_TRL} only (installed: {version}); it trains exactly as TRL computes it.")
    args = trainer.args
    ga = int(args.gradient_accumulation_steps)
    spg = int(getattr(args, "steps_per_generation", None) or ga)
    if spg % ga != 0:
        return (f"hf_gradfix: {name} with steps_per_generation={spg} and gradient_accumulation_steps={ga}: an optimizer "
                "window spans two generation batches, so its completions cannot be counted before its first step; it "
                "trains exactly as TRL computes it. For an exact loss, make steps_per_generation a multiple of the "
                "accumulation steps (TRL's default: equal).")
    scaled = scaled_for_ga
    loss_type = getattr(trainer, "loss_type", None)
    if scaled is True and loss_type in RL_LOSS_TYPES:
        kind = "grpo"
        policy = RL_LOSS_TYPES[loss_type]
    elif scaled is False and loss_type is None:
        kind, loss_type = "rloo", "rloo"
        policy = PolicyLoss(SEQUENCE_MEAN, "token_sum", "RLOO: mean over sequences")
    else:
        return (f"hf_gradfix: {name}'s loss (loss_type={loss_type!r}, loss_is_scaled_for_ga={scaled!r}) is not one "
                "hf_gradfix knows how TRL normalizes; it trains exactly as TRL computes it.")
    if float(getattr(trainer, "top_entropy_quantile", 1.0)) < 1.0:
        # TRL masks the policy loss (and the entropy bonus) to the tokens above an entropy quantile of each micro-batch
        # (gathered over the ranks): the window's own quantile, what one step on the whole window would select, is not
        # known before its forwards, and the bonus's token count depends on it
        return (f"hf_gradfix: {name} with top_entropy_quantile={trainer.top_entropy_quantile}: TRL trains only the "
                "tokens above that entropy quantile of each micro-batch, a subset chosen inside each forward, not over "
                "the optimizer window, so the window's objective is not known before its first step; it trains exactly "
                "as TRL computes it.")
    unit = "completion tokens" if policy.objective is TOKEN_MEAN else "sequences"
    line = (f"{name} loss_type={loss_type}: the {policy.objective.name.replace('_', ' ')} over the optimizer window's "
            f"{unit} on every rank (TRL divides each micro-batch by "
            f"{_trl_divisor_text(kind, loss_type)})")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        line += "; the entropy bonus as the window's token mean"
    if getattr(trainer, "aux_loss_enabled", False):
        line += "; the MoE aux term as the mean over the window's micro-batches"
    return RLPlan(trainer_kind=kind, loss_type=loss_type, policy=policy, line=line)


def check_aux_convention(trainer: Any, convention: str) -> None:
    """TRL's RL trainers add the MoE router loss inside their own policy loss as the mean over micro-batches, which
    this wing keeps (``micro``); any other ``loss.aux_loss`` would silently train that one: refused in one line."""
    if getattr(trainer, "aux_loss_enabled", False) and convention not in ("micro", "micro_batch_mean", "as_is"):
        from ...errors import GradFixError

        raise GradFixError(
            f"hf_gradfix.loss.aux_loss: invalid value {convention!r}; {type(trainer).__name__} adds the MoE router loss "
            "inside TRL's policy loss as the mean over micro-batches, which hf_gradfix keeps exact on RL trainers but "
            "does not re-weight (global / previous / bias / none are built for Trainer and SFTTrainer): remove "
            "aux_loss ('micro', the default, is what trains)")


def _trl_divisor_text(kind: str, loss_type: str) -> str:
    if kind == "rloo":
        return "its sequence count, the Trainer then by the accumulation steps"
    if loss_type in ("dapo", "cispo", "vespo"):
        return "the generation batch's token count x GA / steps_per_generation"
    if loss_type == "bnpo":
        return "its own token count x GA"
    return "its own sequence count x GA"


def open_window(trainer: Any, plan: RLPlan, micro_batches: int, all_reduce) -> None:
    """Count the window's completion tokens and sequences on every rank, from TRL's buffered generation batch (every
    rank joins, once per window, at the window's first compute_loss)."""
    if plan.trainer_kind == "async_grpo":  # no generation buffer: the window's packed micro-batches themselves
        from .asynchronous import open_window as open_async_window

        return open_async_window(trainer, plan, all_reduce)
    spg = int(getattr(trainer.args, "steps_per_generation", None) or trainer.args.gradient_accumulation_steps)
    first = int(trainer._step) % spg
    slices = trainer._buffered_inputs[first : first + micro_batches]
    # summed on the device and read back with the all-reduce: one host sync per window, not one per micro-batch
    tokens = torch.stack([_loss_mask(b).sum().to(torch.float64) for b in slices]).sum() if slices else 0.0
    sequences = float(sum(int(b["completion_mask"].shape[0]) for b in slices))
    total_tokens, total_sequences = all_reduce([tokens, sequences])
    plan.window_tokens, plan.window_sequences = total_tokens, total_sequences
    plan.counted = True


@contextlib.contextmanager
def _captured_forward(trainer: Any, plan: RLPlan):
    """TRL's log-prob forward inside this compute_loss, wrapped on the instance to keep the entropies and the aux loss
    it returns (the very tensors TRL's loss is built from)."""
    original = trainer._get_per_token_logps_and_entropies
    had_own = "_get_per_token_logps_and_entropies" in trainer.__dict__
    plan.captured = {}

    def forward(*args, **kwargs):
        logps, entropies, aux = original(*args, **kwargs)
        plan.captured.update(entropies=entropies, aux=aux)
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = forward
    try:
        yield
    finally:
        if had_own:
            trainer._get_per_token_logps_and_entropies = original
        else:
            trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)


def _trl_policy_normalizer(trainer: Any, plan: RLPlan, inputs: Mapping, mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's divisor of this micro-batch's policy sum (``grpo_trainer.py`` ``_compute_loss``; RLOO: its mean)."""
    sequences = float(mask.shape[0])
    if plan.trainer_kind == "rloo":
        return torch.tensor(sequences)
    ga = float(trainer.current_gradient_accumulation_steps)
    if plan.loss_type in ("dapo", "cispo", "vespo"):
        spg = float(getattr(trainer.args, "steps_per_generation", None) or trainer.args.gradient_accumulation_steps)
        return inputs["num_items_in_batch"].clamp(min=1.0).float() / trainer.accelerator.num_processes * ga / spg
    if plan.loss_type == "bnpo":
        return mask.sum().clamp(min=1.0).float() * ga
    # grpo, sapo, luspo, dr_grpo: a mean over the micro-batch's sequences (dr_grpo's sequence value is its token sum
    # over max_completion_length, which stays)
    return torch.tensor(sequences * ga)


def window_loss(trainer: Any, plan: RLPlan, inputs: Mapping, compute) -> torch.Tensor:
    """This micro-batch's loss with every term normalized by its objective over the window (``compute``: TRL's own
    compute_loss for these inputs)."""
    if plan.trainer_kind == "async_grpo":
        from .asynchronous import window_loss as async_window_loss

        return async_window_loss(trainer, plan, inputs, compute)
    mask = _loss_mask(inputs).float()
    bonus = plan.trainer_kind == "grpo" and getattr(trainer, "_entropy_bonus_enabled", False)
    coef = 0.0
    if bonus:  # the coefficient TRL applies in this step (read before its adaptive controller moves it)
        coef = float(trainer.entropy_coef)
        if getattr(trainer, "use_adaptive_entropy", False) and trainer._last_world_entropy > trainer.args.entropy_target:
            coef = 0.0
    with _captured_forward(trainer, plan):
        loss = compute()
    ga = float(trainer.current_gradient_accumulation_steps)
    micro_batches = ga  # TRL's GA is the window's micro-batch count (a short last window included)
    entropy_term = None
    if bonus:
        entropy_sum = (plan.captured["entropies"] * mask).sum()
        entropy_term = coef * entropy_sum / mask.sum().clamp(min=1.0) / ga  # as TRL subtracts it
    aux_term = None
    aux = plan.captured.get("aux")
    if getattr(trainer, "aux_loss_enabled", False) and torch.is_tensor(aux):
        aux_divisor = 1.0 if plan.trainer_kind == "rloo" else ga
        aux_term = trainer.router_aux_loss_coef * aux / aux_divisor  # as TRL adds it
    policy_tr = loss
    if entropy_term is not None:
        policy_tr = policy_tr + entropy_term
    if aux_term is not None:
        policy_tr = policy_tr - aux_term
    policy_sum = policy_tr * _trl_policy_normalizer(trainer, plan, inputs, mask).to(policy_tr.device)
    if plan.policy.objective is TOKEN_MEAN:
        ours = TOKEN_MEAN.loss(policy_sum, plan.window_tokens, plan.data_ranks)
    else:
        ours = SEQUENCE_MEAN.loss(policy_sum, plan.window_sequences, plan.data_ranks)
    if entropy_term is not None:
        ours = ours - TOKEN_MEAN.loss(coef * entropy_sum, plan.window_tokens, plan.data_ranks)
    if aux_term is not None:
        ours = ours + MICRO_MEAN.loss(trainer.router_aux_loss_coef * aux, micro_batches, 1)
    return ours


def objective_of(plan: RLPlan) -> Objective:
    return plan.policy.objective
