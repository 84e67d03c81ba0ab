"""Moved to :mod:`hf_gradfix.integration.trainer.windows` (the optimizer window and the step, as the fixed trainer
sees them; issue 51). This module re-exports the name the plugin's other modules import from here."""

from __future__ import annotations

from .trainer.windows import _IdleMicroBatch

__all__ = ["_IdleMicroBatch"]
