"""One RL trainer's normalization plan (``state.rl``), apart so that the asynchronous route (:mod:`.asynchronous`)
builds it without importing the policy-gradient module (:mod:`.policy_gradient`) that routes to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...loss.objective import PolicyLoss

__all__ = ["RLPlan"]


@dataclass
class RLPlan:
    """One RL trainer's normalization: its loss type's objective and TRL's own normalizers."""

    # "grpo": TRL scales for accumulation itself (loss_is_scaled_for_ga); "rloo": the Trainer does; "async_grpo":
    # trl.experimental.async_grpo (hf_gradfix.integration.rl.asynchronous)
    trainer_kind: str
    loss_type: str
    policy: PolicyLoss
    line: str
    window_tokens: float = 0.0  # completion tokens of the window, every rank (the loss mask's)
    window_sequences: float = 0.0  # sequences of the window, every rank
    data_ranks: int = 1
    counted: bool = False
    captured: dict = field(default_factory=dict)
    warned: bool = False  # a window left to TRL was named once
