"""Old home of the Trainer class layers (exact loss normalization inside ``transformers.Trainer``), kept as a
documented import path: ``from hf_gradfix.integration.trainer_fix import install, state_of, GradFixError`` works
as before.

The layers moved to the package :mod:`hf_gradfix.integration.trainer` (issue 51): the top layer ``_GradFixTop`` in
``trainer/top.py``, each of its concerns in a module beside it, ``_GradFixDefaultLoss`` in
``trainer/default_loss.py``, ``install`` / ``uninstall`` / ``fixed_class_for`` in ``trainer/class_swap.py``, the
probes in ``trainer/probe.py``. This module only re-exports the names used from here: a name patched on this
module does not reach the code that calls it; patch it in the module that defines it.
"""

from __future__ import annotations

from ..errors import GradFixError
from .state import (
    _STATE_ATTR,
    GradFixState,
    _dp_world,
    _EvalTotals,
    _nd_dims,
    _replicated_divisor,
    _Step,
    _tp_size,
    _Window,
    state_of,
)
from .trainer.class_swap import fixed_class_for, install, uninstall
from .trainer.default_loss import _GradFixDefaultLoss
from .trainer.ga_flag import _keep_instance_ga_flag
from .trainer.probe import _prepare, _probe
from .trainer.top import _TOP_OVERRIDES, _GradFixTop

__all__ = [
    "GradFixError",
    "GradFixState",
    "state_of",
    "install",
    "uninstall",
    "fixed_class_for",
    "_GradFixTop",
    "_GradFixDefaultLoss",
    "_TOP_OVERRIDES",
    "_keep_instance_ga_flag",
    "_prepare",
    "_probe",
    "_STATE_ATTR",
    "_dp_world",
    "_EvalTotals",
    "_nd_dims",
    "_replicated_divisor",
    "_Step",
    "_tp_size",
    "_Window",
]
