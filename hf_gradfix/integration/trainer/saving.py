"""The checkpoint concern of the top layer: a save writes its start file first and each process's marker last (a
torn save is known and never resumed from: :mod:`hf_gradfix.integration.complete_checkpoints`), a packed stream's
position and the MoE router counts go with the RNG state, pipeline and expert parallelism write and resume their
sharded checkpoints (:mod:`hf_gradfix.integration.checkpoint`), and a pipelined model is saved as one model.
"""

from __future__ import annotations

import os

import torch

from ..state import state_of


def save_rng_state(trainer, parent, /, output_dir, *args, **kwargs):
    # per process, into the checkpoint folder: a packed stream's position and buffer go with it
    parent(output_dir, *args, **kwargs)
    state = state_of(trainer)
    if state is not None and state.config.packing.enabled:
        from ..packing.trainer import save_stream_state

        save_stream_state(trainer, output_dir)
    if state is not None and getattr(state, "moe", None) is not None:
        from ..moe import save_state

        save_state(trainer, state, output_dir)
    from ..checkpoints.complete import finish

    # this process's files of the checkpoint are all written: its marker; every process's marker is on disk
    # before rank 0 lists the folder's files and goes on to trainer_state.json and rotate_checkpoints, so
    # rotation never deletes an older checkpoint while the new one can still be torn (complete_checkpoints.py)
    finish(trainer, output_dir)


def save_checkpoint(trainer, parent, /, model, trial, *args, **kwargs):
    # the start file before anything is written (a torn folder is known as the plugin's); a full disk is reported
    # as such, naming the folder it tore (complete_checkpoints.py)
    from ..checkpoints.complete import saving

    with saving(trainer, trial):
        return parent(model, trial, *args, **kwargs)


def save_model(trainer, parent, /, output_dir=None, _internal_call=False):
    state = state_of(trainer)
    if state is None or state.pp is None:
        return parent(output_dir, _internal_call=_internal_call)
    # pipeline: every stage's weights gathered on rank 0, saved as one model (from_pretrained loads it)
    from ..parallel.pipeline import full_state_dict

    merged = full_state_dict(trainer, state.pp)
    if trainer.args.should_save:
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        trainer.model.save_pretrained(output_dir, state_dict=merged)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


def save_optimizer_and_scheduler(trainer, parent, /, output_dir):
    from ..checkpoints.sharded import sharded

    writer = sharded(state_of(trainer))
    if writer is None:
        return parent(output_dir)
    # pipeline / expert parallelism: every rank's weights and optimizer shards as one distributed checkpoint
    writer.save(trainer, output_dir)
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))


def load_from_checkpoint(trainer, parent, /, resume_from_checkpoint, model=None):
    from ..checkpoints.sharded import refuse_foreign, sharded

    state = state_of(trainer)
    writer = sharded(state)
    if writer is None:
        nd = state.nd if state is not None else None
        this_run = f"{nd.dims.describe()}, no expert parallelism" if nd is not None else "without pp or ep"
        refuse_foreign(resume_from_checkpoint, this_run)  # a sharded run's checkpoint has no optimizer.pt
        return parent(resume_from_checkpoint, model)
    writer.load(trainer, resume_from_checkpoint, optimizer=False)


def load_optimizer_and_scheduler(trainer, parent, /, checkpoint, *args, **kwargs):
    from ..checkpoints.sharded import sharded

    state = state_of(trainer)
    writer = sharded(state)
    if writer is not None:
        if checkpoint is None:
            return None
        writer.load(trainer, checkpoint, optimizer=True)
        path = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(path) and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
    else:
        parent(checkpoint, *args, **kwargs)
    # per process, on resume, before the dataloader is iterated: the packed stream continues from its state,
    # the previous window's router counts too (both saved with the RNG state, whatever writes the optimizer)
    if state is not None and state.config.packing.enabled:
        from ..packing.trainer import load_stream_state

        load_stream_state(trainer, checkpoint)
    if state is not None and state.config.loss.aux_loss == "previous":
        from ..moe import load_state

        load_state(trainer, state, checkpoint)
