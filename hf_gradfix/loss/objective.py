"""One contract for every objective: what it sums, what it counts, over which window.

Every loss hf_gradfix normalizes is an instance of one rule (the shape of verl's ``core_algos.agg_loss``): a
micro-batch contributes the **sum** of its units' values, and the optimizer window's loss is the sum over every
micro-batch and every data-parallel rank divided by the window's **count** of units. What differs is the unit:

================  ==========================================================  =========================================
objective         a unit's value                                              who declares it
================  ==========================================================  =========================================
``token_mean``    one target's loss                                           SFT / causal-LM cross-entropy; RL
                                                                              ``dapo``, ``cispo``, ``vespo``, ``bnpo``;
                                                                              the entropy bonus; AsyncGRPO
``sequence_mean`` one sequence's value (its token mean, token sum, or token   RL ``grpo``, ``sapo`` (token mean),
                  sum over a constant length)                                 ``luspo`` (token sum), ``dr_grpo`` (sum /
                                                                              max length), RLOO
``micro_mean``    one micro-batch's value                                     a MoE router's load-balancing aux loss
                                                                              (``micro``: what transformers and TRL
                                                                              intend)
================  ==========================================================  =========================================

Since data-parallel replicas' gradients are *averaged* (DDP, FSDP), one replica back-propagates
``local_sum * data_ranks / window_count``: the average over ranks is then exactly the window's mean.

>>> import torch
>>> TOKEN_MEAN.loss(torch.tensor(6.0), window_count=12, data_ranks=2)   # 2 ranks: each back-propagates 6 * 2 / 12
tensor(1.)
>>> RL_LOSS_TYPES["grpo"].objective is SEQUENCE_MEAN, RL_LOSS_TYPES["dapo"].objective is TOKEN_MEAN
(True, True)

This module is pure math: it imports neither transformers nor accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MICRO_MEAN", "Objective", "PolicyLoss", "RL_LOSS_TYPES", "SEQUENCE_MEAN", "TOKEN_MEAN"]


@dataclass(frozen=True)
class Objective:
    """What an objective counts (its unit) over the optimizer window; the window is always every micro-batch of one
    optimizer step on every data-parallel rank."""

    name: str
    unit: str  # "target" | "sequence" | "micro-batch"

    def loss(self, local_sum: torch.Tensor, window_count: float, data_ranks: int) -> torch.Tensor:
        """What one replica back-propagates for its micro-batch: ``local_sum * data_ranks / window_count`` (the replicas'
        gradient average is then the window mean). A window without units contributes a connected zero."""
        if window_count <= 0:
            return local_sum * 0.0
        return local_sum * (data_ranks / float(window_count))


TOKEN_MEAN = Objective("token_mean", "target")
SEQUENCE_MEAN = Objective("sequence_mean", "sequence")
MICRO_MEAN = Objective("micro_mean", "micro-batch")


@dataclass(frozen=True)
class PolicyLoss:
    """A policy-gradient loss type's declared aggregation: the objective, and how a sequence's tokens reduce to the
    sequence's value for the sequence-mean types ("token_mean", "token_sum", "token_sum_over_max_length")."""

    objective: Objective
    per_sequence: str | None = None
    doc: str = ""


#: The loss types of the GRPO family (TRL's ``GRPOConfig.loss_type``, verl's ``loss_agg_mode``), each with the
#: objective its paper / documentation defines, evaluated over the real optimizer window.
RL_LOSS_TYPES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(SEQUENCE_MEAN, "token_mean", "GRPO (Shao et al. 2024): mean over sequences of each one's token mean"),
    "sapo": PolicyLoss(SEQUENCE_MEAN, "token_mean", "SAPO: soft-gated GRPO, aggregated as GRPO"),
    "luspo": PolicyLoss(SEQUENCE_MEAN, "token_sum", "LUSPO: mean over sequences of each one's token sum"),
    "dr_grpo": PolicyLoss(SEQUENCE_MEAN, "token_sum_over_max_length",
                          "Dr. GRPO (Liu et al. 2025): token sum over a constant length, averaged over sequences"),
    "bnpo": PolicyLoss(TOKEN_MEAN, None, "BNPO: token mean over the batch (here: the optimizer window)"),
    "dapo": PolicyLoss(TOKEN_MEAN, None, "DAPO (Yu et al. 2025): token mean over every token of the window"),
    "cispo": PolicyLoss(TOKEN_MEAN, None, "CISPO (MiniMax-M1): clipped-IS REINFORCE, token mean"),
    "vespo": PolicyLoss(TOKEN_MEAN, None, "VESPO: variance-reduced sequence weights, token mean"),
}
