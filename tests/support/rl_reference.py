"""The ground truth for policy-gradient trainers (TRL's GRPO family, RLOO): one optimizer window's objective, from the
tensors the trainer trained on, in float64, one process, one backward. Written from the loss types' definitions (the
papers and TRL's documentation), not from hf_gradfix's code.

A recorded micro-batch is what the trainer's loss function was given: ``prompt_ids``, ``prompt_mask``,
``completion_ids``, ``completion_mask`` (``tool_mask``), ``advantages``, and ``old_per_token_logps`` when the trainer
computed them. The reference recomputes each completion token's log-probability (temperature-scaled softmax, the
forward the trainer makes: ``model(input_ids, attention_mask)``) and entropy, builds each loss type's per-token value,
and aggregates over **every micro-batch of the window on every rank** by the loss type's objective:

* token mean (``dapo``, ``cispo``, ``vespo``, ``bnpo``): the sum over every completion token / the window's token count;
* sequence mean (``grpo``, ``sapo``: each sequence's token mean; ``luspo``: its token sum; ``dr_grpo``: its token sum
  / ``max_completion_length``; RLOO: its summed log-ratio surrogate): the sum over sequences / the window's sequences;
* the entropy bonus: ``- coef x`` the window's token mean of the entropy;
* a MoE aux loss: the mean over the window's micro-batches.

The controls the tests use: :func:`expected_count_dapo` (TRL's dapo divisor, the *expected* window count from the
generation batch) and ``mean_of_micro_means`` (each micro-batch normalized alone, averaged).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch

TOKEN_TYPES = ("dapo", "cispo", "vespo", "bnpo")
SEQUENCE_TYPES = ("grpo", "sapo", "luspo", "dr_grpo")


def _mask(mb: Mapping) -> torch.Tensor:
    mask = mb["completion_mask"].double()
    return mask * mb["tool_mask"].double() if torch.is_tensor(mb.get("tool_mask")) else mask


def token_logps(model, mb: Mapping, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, entropy) of every completion token under ``softmax(logits / temperature)``, float64.

    Each sequence alone, without its padding: its real prompt tokens, then its completion up to the end of its
    completion mask (the trainer's padded forward gives the same logits: rotary positions are relative, and causal
    attention never looks at the padding behind). Positions past a completion's end are 0 (masked out of every loss).
    """
    rows_logp, rows_entropy = [], []
    width = mb["completion_ids"].shape[1]
    for i in range(mb["completion_ids"].shape[0]):
        prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
        n = int(mb["completion_mask"][i].sum())
        completion = mb["completion_ids"][i][:n]
        logp = torch.zeros(width, dtype=torch.float64)
        entropy = torch.zeros(width, dtype=torch.float64)
        if n:
            ids = torch.cat([prompt, completion]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0].double()[prompt.shape[0] - 1 : -1] / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = torch.cat([logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1), logp[n:]])
            entropy = torch.cat([-(logp_all.exp() * logp_all).sum(-1), entropy[n:]])
        rows_logp.append(logp)
        rows_entropy.append(entropy)
    return torch.stack(rows_logp), torch.stack(rows_entropy)


def _gamma_weight(advantages, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's detached sequence weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1), w the sequence's ratio."""
    log_w = torch.clamp(torch.clamp(log_ratio, -20.0, 20.0).mul(mask).sum(-1, keepdim=True), math.log(1e-8), 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg))
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0).detach()


def per_token_loss(loss_type: str, logp, old, advantages, mask, cfg: Mapping) -> torch.Tensor:
    """Each completion token's loss (token-level importance ratio r = pi / pi_old)."""
    adv = advantages.double().unsqueeze(1) if advantages.dim() == 1 else advantages.double()
    ratio = torch.exp(logp - old)
    eps_low, eps_high = cfg["epsilon_low"], cfg["epsilon_high"]
    if loss_type == "cispo":
        return -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    if loss_type == "sapo":
        temp = torch.where(adv > 0, torch.full_like(adv, cfg["sapo_temperature_pos"]),
                           torch.full_like(adv, cfg["sapo_temperature_neg"]))
        return -torch.sigmoid(temp * (ratio - 1)) * 4 / temp * adv
    if loss_type == "vespo":
        phi = _gamma_weight(adv, logp - old, mask, cfg["vespo_k_pos"], cfg["vespo_lambda_pos"], cfg["vespo_k_neg"],
                            cfg["vespo_lambda_neg"])
        return -phi * adv * logp
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)  # grpo, bnpo, dr_grpo, dapo, luspo: the clipped surrogate
    return -torch.min(ratio * adv, clipped * adv)


def window_objective(model, window: Sequence[Mapping], loss_type: str, cfg: Mapping, *, aggregation: str = "window",
                     entropy_coef: float = 0.0) -> torch.Tensor:
    """The window's loss (a float64 scalar with a graph to ``model``'s parameters).

    ``window``: every micro-batch of one optimizer step on every rank. ``aggregation``: "window" (the objective), or
    the controls "mean_of_micro_means" (each micro-batch's own mean, averaged) and "expected_count" (dapo's sum over
    the generation batch's expected window count, TRL's divisor; needs ``cfg["expected_count"]``)."""
    sums, tokens, seqs, entropy_sum = [], [], [], []
    for mb in window:
        mask = _mask(mb)
        logp, entropy = token_logps(model, mb, cfg["temperature"])
        old = mb["old_per_token_logps"].double() if torch.is_tensor(mb.get("old_per_token_logps")) else logp.detach()
        if loss_type == "rloo":
            seq_logp = (logp * mb["completion_mask"].double()).sum(1)
            seq_old = mb["old_logps"].double() if torch.is_tensor(mb.get("old_logps")) else seq_logp.detach()
            ratio = torch.exp(seq_logp - seq_old)
            adv = mb["advantages"].double()
            clipped = torch.clamp(ratio, 1 - cfg["epsilon_low"], 1 + cfg["epsilon_high"])
            unit = -torch.min(ratio * adv, clipped * adv)  # one value per sequence
        else:
            loss = per_token_loss(loss_type, logp, old, mb["advantages"], mask, cfg) * mask
            if loss_type in TOKEN_TYPES:
                unit = loss  # per token
            elif loss_type in ("grpo", "sapo"):
                unit = loss.sum(-1) / mask.sum(-1).clamp(min=1.0)
            elif loss_type == "luspo":
                unit = loss.sum(-1)
            elif loss_type == "dr_grpo":
                unit = loss.sum(-1) / cfg["max_completion_length"]
            else:
                raise KeyError(loss_type)
        sums.append(unit.sum())
        tokens.append(mask.sum())
        seqs.append(float(mask.shape[0]))
        entropy_sum.append((entropy * mask).sum())
    by_tokens = loss_type in TOKEN_TYPES
    if aggregation == "window":
        total = torch.stack(sums).sum() / (torch.stack(tokens).sum() if by_tokens else sum(seqs))
        bonus = torch.stack(entropy_sum).sum() / torch.stack(tokens).sum()
    elif aggregation == "mean_of_micro_means":
        per = [s / (t if by_tokens else n) for s, t, n in zip(sums, tokens, seqs)]
        total = torch.stack(per).mean()
        bonus = torch.stack([e / t for e, t in zip(entropy_sum, tokens)]).mean()
    elif aggregation == "expected_count":
        total = torch.stack(sums).sum() / cfg["expected_count"]
        bonus = torch.stack(entropy_sum).sum() / torch.stack(tokens).sum()
    else:
        raise KeyError(aggregation)
    return total - entropy_coef * bonus if entropy_coef else total


def window_gradient(model, window, loss_type, cfg, **kw) -> tuple[float, dict[str, torch.Tensor]]:
    """(objective value, gradient) at ``model``'s weights, in float64 on a copy."""
    ref = copy.deepcopy(model).double()
    ref.train()
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref.zero_grad(set_to_none=True)
    loss = window_objective(ref, window, loss_type, cfg, **kw)
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in ref.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def trl_config(trainer) -> dict:
    """The loss hyper-parameters a trainer holds (what the reference needs besides the tensors)."""
    args = trainer.args
    return dict(
        temperature=float(getattr(trainer, "temperature", getattr(args, "temperature", 1.0))),
        epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(trainer.epsilon_high),
        max_completion_length=float(args.max_completion_length),
        sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
        sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
        vespo_k_pos=float(getattr(args, "vespo_k_pos", 2.0)), vespo_lambda_pos=float(getattr(args, "vespo_lambda_pos", 3.0)),
        vespo_k_neg=float(getattr(args, "vespo_k_neg", 3.0)), vespo_lambda_neg=float(getattr(args, "vespo_lambda_neg", 2.0)),
    )
