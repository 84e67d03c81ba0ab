"""Which Trainer is calling a callback: transformers gives callbacks the model, optimizer, ... but not the Trainer.

Apart from :mod:`.callback` (the entry point, which imports the patching) so that the callbacks of the wings
(:mod:`.moe`, :mod:`.diagnostics.gns`, :mod:`.diagnostics.memory_timeline`) find their trainer without importing
the entry point.
"""

from __future__ import annotations

import sys

from transformers import Trainer, TrainerCallback

__all__ = ["_find_trainer"]


def _find_trainer(callback: TrainerCallback) -> Trainer | None:
    # Callbacks are not given the trainer (transformers passes model, optimizer, ... but not `self`), so we
    # find the Trainer whose callback handler is calling us on the stack. The frame walk is bounded and only
    # reads `self` of each frame.
    frame = sys._getframe(2)
    depth = 0
    while frame is not None and depth < 50:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and callback in getattr(handler, "callbacks", ()):
                return candidate
        frame = frame.f_back
        depth += 1
    return None
