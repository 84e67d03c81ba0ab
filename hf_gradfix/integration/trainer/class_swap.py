"""Installing on one trainer: the launch checked, the pipeline or ND mesh set up, the trainer's class swapped for the
generated ``[_GradFixTop, cls, ..., _GradFixDefaultLoss, Trainer]`` (cached per class), and given back.

Apart from the layers because it is what ``patch()``, the callback and ``hf_gradfix.install`` call; the layers
themselves never install anything.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from ...config import GradFixConfig
from ...errors import GradFixError
from ..state import _STATE_ATTR, GradFixState, state_of
from .default_loss import _GradFixDefaultLoss
from .ga_flag import _GA_FLAG, _keep_instance_ga_flag
from .reentry import snapshot_methods
from .top import _TOP_OVERRIDES, _GradFixTop


_FIXED_CLASSES: dict[type, type] = {}


def fixed_class_for(cls: type) -> type:
    """The generated class ``[_GradFixTop, cls, ..., _GradFixDefaultLoss, Trainer]`` (cached)."""
    if issubclass(cls, _GradFixTop):
        return cls
    if cls not in _FIXED_CLASSES:
        bases = (_GradFixTop, _GradFixDefaultLoss) if cls is Trainer else (_GradFixTop, cls, _GradFixDefaultLoss)
        _FIXED_CLASSES[cls] = type(
            cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_gradfix_original_class": cls}
        )
    return _FIXED_CLASSES[cls]


def _check_cp_balance(config: GradFixConfig, nd: Any) -> None:
    """``parallel.cp_balance: long_documents`` on a trainer whose mesh has cp 1 (no mesh, or one without cp, from the
    section, the model or accelerate) lays nothing out: refused before any step, as the loader refuses it in a file."""
    cp = nd.dims.cp if nd is not None else 1
    if config.parallel.cp_balance == "long_documents" and cp <= 1:
        from ...config.schema import cp_balance_without_cp

        raise GradFixError("hf_gradfix.parallel.cp_balance: " + cp_balance_without_cp(
            f"this trainer's mesh has cp 1 ({nd.dims.describe() if nd is not None else 'no parallel mesh'})"))


def install(trainer: Trainer, config: GradFixConfig, source: str, settings_from: str = "defaults") -> GradFixState:
    """Make one trainer's loss exact (idempotent). Returns its state."""
    state = state_of(trainer)
    if state is not None:
        return state
    from ..parallel.nd import setup as nd_setup
    from ..optim_trainer import (
        begin_lowrank_training,
        check_optimizer_setup,
        lowrank_optimizer_of,
        optimizer_requested,
        route_clipping,
    )

    from ..environment import check_launched_world

    check_launched_world(trainer)
    check_optimizer_setup(trainer, config.optimizer)
    state = GradFixState(config=config, source=source, settings_from=settings_from)
    # Pipeline parallelism (parallel.pp > 1): the model split into this rank's stages, data by data-parallel rank
    from ..parallel.pipeline import setup as pipeline_setup

    state.pp = pipeline_setup(trainer, config)
    if state.pp is not None:
        from ..parallel.nd import NDPlan

        state.nd = NDPlan(dims=state.pp.dims, route="pipeline", source="config")
        state.fixes.append(state.pp.line)
    # ND-parallel mesh from the `parallel` section (or a model sharded at load time): validated against the world
    # size and the model, the model sharded, data loading sharded by data-parallel rank. Before the class swap, and
    # also when the loss fix is off: the mesh is part of the launch, not of the loss.
    if state.pp is None:
        state.nd = nd_setup(trainer, config.parallel, packing=config.packing.enabled, optimizer=config.optimizer.name)
        if state.nd is not None:
            state.fixes.append(state.nd.line)
    _check_cp_balance(config, state.nd)
    if config.loss.enabled and config.loss.head == "lean":
        from ..internal_callbacks import add_internal_callback
        from ..lean_head import LeanHead, LeanHeadUnusedCheck

        state.lean = LeanHead()
        state.fixes.append(state.lean.line())
        add_internal_callback(trainer, LeanHeadUnusedCheck(state.lean, trainer))
    trainer.__dict__[_STATE_ATTR] = state
    wants_optimizer = optimizer_requested(trainer, config.optimizer) is not None
    # a lowrank_grads optimizer given to the constructor: its hooks' lifetime follows train() (the fixed class's)
    given_lowrank = lowrank_optimizer_of(trainer) is not None
    # pp and ep need the fixed class whatever the loss setting: it writes and resumes their sharded checkpoints
    sharded = state.pp is not None or (state.nd is not None and state.nd.ep is not None)
    if config.loss.enabled or config.packing.enabled or wants_optimizer or given_lowrank or sharded:
        _keep_instance_ga_flag(trainer)
        snapshot_methods(trainer, _TOP_OVERRIDES)
        trainer.__class__ = fixed_class_for(type(trainer))
    route_clipping(trainer)  # max_grad_norm clips a lowrank_grads optimizer's accumulators, however it arrives
    begin_lowrank_training(trainer)
    return state


def uninstall(trainer: Trainer) -> None:
    """Give one trainer back its original class and behaviour."""
    original = getattr(type(trainer), "_gradfix_original_class", None)
    if original is not None:
        trainer.__class__ = original
        if _GA_FLAG in trainer.__dict__:  # the user's value back where the original class reads it
            trainer.__dict__["loss_is_scaled_for_ga"] = trainer.__dict__.pop(_GA_FLAG)
    trainer.__dict__.pop(_STATE_ATTR, None)
