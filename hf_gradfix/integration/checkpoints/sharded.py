"""Resumable Trainer checkpoints of a model hf_gradfix trains sharded: pipeline stages (``parallel.pp``) and expert
parallelism (``DistributedConfig(ep_size > 1)``, either route).

Why not the Trainer's own files: its ``optimizer.pt`` is one process's ``state_dict``, which for a sharded model is
this rank's shards under positional keys (and transformers refuses to checkpoint a model sharded at load time at all).
Here the weights and the optimizer state are one torch distributed checkpoint (DCP) keyed by parameter name:
FSDP2 / tensor-parallel / expert shards are DTensors that DCP writes shard by shard, replicas once; rank 0 adds a
small mesh file naming the degrees that wrote it. Resuming loads both in place and refuses, in one line, a
checkpoint another mesh wrote (its data order, shards and schedule would differ, so the run would not continue bit
for bit). The scheduler, RNG, trainer state and data position stay the Trainer's own machinery.

Wired through the fixed trainer class (:mod:`hf_gradfix.integration.trainer.saving`: ``_save_optimizer_and_scheduler``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``); nothing of transformers is patched here.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ...errors import HfGradfixError
from ...parallel.pipeline import PipelineError
from ..parallel.errors import NDParallelError

__all__ = ["CheckpointError", "Kind", "PIPELINE", "EXPERT_PARALLEL", "Sharded", "sharded", "save", "load",
           "refuse_foreign", "ep_mesh", "checkpoint_mesh", "init_allows_ep_checkpoints"]


class CheckpointError(HfGradfixError, RuntimeError):
    """A checkpoint this run cannot resume exactly (written by another mesh); the message says which and the fix."""


@dataclass(frozen=True)
class Kind:
    """Where one parallelism writes its checkpoint inside ``checkpoint-N/`` and how it is named in messages."""

    run: str  # "pipelined", "expert-parallel": the run that writes it
    directory: str  # the DCP folder (model and optimizer)
    mesh_file: str  # the degrees that wrote it (JSON)
    fix: str  # what to do when the mesh differs


PIPELINE = Kind("pipelined", "pipeline", "pipeline_mesh.json", "resume with the same mesh and schedule")
EXPERT_PARALLEL = Kind("expert-parallel", "expert_parallel", "expert_parallel_mesh.json",
                       "resume with the same world size and parallel degrees (dp_replicate, dp_shard, tp, ep)")
KINDS = (PIPELINE, EXPERT_PARALLEL)


def _torch_optimizer(trainer):
    """The torch optimizer under accelerate's wrapper (its ``step`` is skipped while accumulating, and torch's
    state-dict helpers may step it once with zero gradients to allocate the state they load into)."""
    optimizer = trainer.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _flat():
    """Optimizer state keyed per parameter name, hyper-parameters included (``param_groups.<name>.lr``): pipeline
    stages hold different parameters, and a nested ``param_groups`` list would be one rank's, deduplicated by DCP
    (the other stages then load a group without its ``lr`` and ``betas``). torchtitan saves this way; so do we, for
    every kind."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _line(mesh: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in mesh.items())


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _written(checkpoint: str) -> tuple[Kind, dict] | None:
    """The kind and mesh of a checkpoint one of our kinds wrote, else None."""
    for kind in KINDS:
        path = os.path.join(checkpoint, kind.mesh_file)
        if os.path.isfile(path) and os.path.isdir(os.path.join(checkpoint, kind.directory)):
            with open(path) as f:
                return kind, json.load(f)
    return None


def save(trainer, output_dir: str, kind: Kind, mesh: dict) -> None:
    """Write the weights and the optimizer state as one torch distributed checkpoint (a collective), and on rank 0
    the mesh that wrote it. Keys are the model's own parameter names (pipeline stages keep the global names), so the
    checkpoint is one model's, whatever the split."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    os.makedirs(output_dir, exist_ok=True)
    state = {"model": get_model_state_dict(trainer.model)}
    if trainer.optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(trainer.model, _torch_optimizer(trainer), options=_flat())
    dcp.save(state, checkpoint_id=os.path.join(output_dir, kind.directory))
    if dist.get_rank() == 0:
        with open(os.path.join(output_dir, kind.mesh_file), "w") as f:
            json.dump(mesh, f)


def load(trainer, checkpoint: str, kind: Kind, mesh: dict, *, optimizer: bool, error: type = CheckpointError) -> None:
    """Load this rank's part of the checkpoint (weights, or with ``optimizer`` the optimizer state), in place, after
    checking that this mesh wrote it (before anything loads: every rank reads the same file and raises alike)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    found = _written(checkpoint)
    if found is None:
        raise error(
            f"hf_gradfix parallel: resume_from_checkpoint={checkpoint!r} has no {kind.mesh_file} and {kind.directory}/ "
            f"(it was not written by {_a(kind.run)} run); resume from a checkpoint this mesh wrote"
        )
    if found != (kind, mesh):
        theirs, written = found
        raise error(
            f"hf_gradfix parallel: resume_from_checkpoint={checkpoint!r} was written by {_a(theirs.run)} run "
            f"({_line(written)}), this run is {kind.run} ({_line(mesh)}); {kind.fix}"
        )
    checkpoint_id = os.path.join(checkpoint, kind.directory)
    if optimizer:
        if trainer.optimizer is None:
            return
        torch_optimizer = _torch_optimizer(trainer)
        state = {"optimizer": get_optimizer_state_dict(trainer.model, torch_optimizer, options=_flat())}
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_optimizer_state_dict(trainer.model, torch_optimizer, state["optimizer"], options=_flat())
    else:
        state = {"model": get_model_state_dict(trainer.model)}
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_model_state_dict(trainer.model, state["model"])


def refuse_foreign(checkpoint: str, this_run: str) -> None:
    """A run that writes no sharded checkpoint (neither pp nor ep) refuses one that a sharded run wrote: the
    Trainer's own loader would find no ``optimizer.pt`` and silently start the optimizer afresh."""
    found = _written(checkpoint)
    if found is not None:
        kind, written = found
        raise CheckpointError(
            f"hf_gradfix parallel: resume_from_checkpoint={checkpoint!r} was written by {_a(kind.run)} run "
            f"({_line(written)}), this run is {this_run}; {kind.fix}"
        )


def ep_mesh(nd) -> dict:
    """The degrees an expert-parallel checkpoint is tied to (``nd``: the trainer's NDPlan with its EPLayout)."""
    d = nd.dims
    return dict(world=d.world_size, dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, ep=nd.ep.ep,
                efsdp=nd.ep.efsdp)


def checkpoint_mesh(plan) -> dict:
    """The degrees and schedule a pipeline checkpoint is tied to (``plan``: the trainer's PipelinePlan; another would
    reorder data and stages)."""
    d = plan.dims
    return dict(world=d.world_size, pp=d.pp, pp_virtual_stages=d.pp_virtual_stages, dp_replicate=d.dp_replicate,
                dp_shard=d.dp_shard, tp=d.tp, schedule=plan.schedule)


@dataclass(frozen=True)
class Sharded:
    """How one trainer's checkpoints are written: the kind, its mesh, the error class its refusals raise."""

    kind: Kind
    mesh: dict
    error: type

    def save(self, trainer, output_dir: str) -> None:
        save(trainer, output_dir, self.kind, self.mesh)

    def load(self, trainer, checkpoint: str, *, optimizer: bool) -> None:
        load(trainer, checkpoint, self.kind, self.mesh, optimizer=optimizer, error=self.error)


def sharded(state) -> Sharded | None:
    """The sharded checkpoint a fixed trainer writes (pipeline, expert parallelism), None for the Trainer's own."""
    if state is None:
        return None
    if state.pp is not None:
        return Sharded(PIPELINE, checkpoint_mesh(state.pp), PipelineError)
    nd = state.nd
    if nd is not None and nd.ep is not None:
        return Sharded(EXPERT_PARALLEL, ep_mesh(nd), NDParallelError)
    return None


def _expert_parallel_at_load(model: Any) -> bool:
    dc = getattr(getattr(model, "config", None), "distributed_config", None)
    return bool(getattr(model, "is_distributed_loading_by_transformers", False)) and int(
        getattr(dc, "ep_size", 1) or 1) > 1


@contextlib.contextmanager
def init_allows_ep_checkpoints(model: Any, args: Any):
    """Around ``Trainer.__init__`` (hf_gradfix's wrapper): transformers refuses there to checkpoint a model sharded
    at load time unless ``save_only_model``; an expert-parallel one is checkpointed by this module instead, so that
    check alone sees ``save_only_model=True``, restored as soon as ``__init__`` returns (or raises)."""
    saves = args is not None and str(getattr(args, "save_strategy", "no")).split(".")[-1].lower() != "no"
    if not (saves and not getattr(args, "save_only_model", False) and _expert_parallel_at_load(model)):
        yield
        return
    args.save_only_model = True
    try:
        yield
    finally:
        args.save_only_model = False
