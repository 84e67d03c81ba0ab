"""The optimizer concern of the top layer: the low-rank optimizers (GaLore / APOLLO) built from the optimizer section
with the Trainer's own hyperparameters, the lifetime of their backward hooks (exactly one ``train()`` call, which
also resumes from the newest complete checkpoint), and gradient clipping of a pipelined model over its stages.
"""

from __future__ import annotations

from ..state import state_of
from .windows import _never_opened


def create_optimizer(trainer, parent, /, *args, **kwargs):
    # GaLore / APOLLO from the optimizer section or optimizer_cls_and_kwargs, with the Trainer's own
    # lr, weight_decay (and no-decay names), betas and eps (transformers' galore handler drops them).
    state = state_of(trainer)
    if state is not None and trainer.optimizer is None:
        from ..optim_trainer import begin_lowrank_training, build_low_rank_optimizer, describe, optimizer_requested

        requested = optimizer_requested(trainer, state.config.optimizer)
        if requested is not None:
            model = kwargs.get("model", args[0] if args else None)
            model = trainer.model if model is None else model
            trainer.optimizer = build_low_rank_optimizer(trainer, model, *requested)
            state.optimizer_line = describe(trainer.optimizer, trainer)
            begin_lowrank_training(trainer)
            return trainer.optimizer
    optimizer = parent(*args, **kwargs)
    if state is not None:  # optimizer_cls_and_kwargs / Trainer(optimizers=...) with a lowrank_grads optimizer
        from ..optim_trainer import begin_lowrank_training

        begin_lowrank_training(trainer)
    return optimizer


def train(trainer, parent, /, *args, **kwargs):
    # A lowrank_grads optimizer's backward hooks live exactly as long as a train() call: on at its start (again
    # for a second train()), off at its end and on an exception, so the model never keeps hooks that clear
    # its gradients for an optimizer that no longer steps (a second, plain trainer trains every weight).
    from ..optim_trainer import begin_lowrank_training, end_lowrank_training

    from ..checkpoints.complete import resolve

    state = state_of(trainer)
    if args:  # resume_from_checkpoint=True: the newest COMPLETE checkpoint (a save a crash tore is skipped)
        args = (resolve(trainer, args[0]),) + tuple(args[1:])
    elif "resume_from_checkpoint" in kwargs:
        kwargs["resume_from_checkpoint"] = resolve(trainer, kwargs["resume_from_checkpoint"])
    if state is not None:
        begin_lowrank_training(trainer)
    try:
        result = parent(*args, **kwargs)
        if state is not None:
            _never_opened(trainer, state)  # the last window too: a trainer whose steps never call compute_loss
        return result
    finally:
        end_lowrank_training(trainer)
        if state is not None:  # a training_step called after train() is the caller's own, never the last window's
            state.window = None


def clip_grad_norm(trainer, parent, /, model):
    state = state_of(trainer)
    if state is not None and state.pp is not None:
        from ..parallel.pipeline import clip_grad_norm as clip_stages

        return clip_stages(trainer, state.pp, trainer.args.max_grad_norm)
    return parent(model)


def get_grad_norm(trainer, parent, /, model, grad_norm=None):
    state = state_of(trainer)
    if grad_norm is None and state is not None and state.pp is not None:
        from ..parallel.pipeline import clip_grad_norm as clip_stages

        grad_norm = clip_stages(trainer, state.pp, float("inf"))
    return parent(model, grad_norm=grad_norm)
