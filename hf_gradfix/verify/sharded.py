"""``hf-gradfix verify`` on sharded runs: the unsharded reference model and the full tensors of every rank.

A launched run may hold no whole model on any rank: expert, tensor and context parallelism and FSDP2 (hf_gradfix's
``parallel`` section, or a model loaded with ``from_pretrained(distributed_config=...)``) hold DTensor shards;
pipeline parallelism (``parallel.pp``) holds each rank's stages only; DeepSpeed ZeRO-3 holds partitions (from
accelerate's ``prepare``, or at load time under ``zero3_init_flag``); accelerate's FSDP2 shards at ``prepare``. The
ground truth needs the whole model at the step's weights, in one process. :class:`RunShards` says how the run holds
its weights and gives verify:

- :meth:`RunShards.reference`: an unsharded copy of the model at its current (initial) weights, built before the first
  checked step: a model whole on this rank until accelerate prepares it is deep-copied; otherwise the full state (every
  DTensor gathered, every pipeline stage's weights from its rank, ZeRO-3 partitions gathered) is loaded into a fresh
  instance of the model's own class built from its configuration (``distributed_config`` dropped), on this rank's
  device, in the run's parameter dtypes;
- :meth:`RunShards.full`: the full value of each named parameter (or its gradient) on every rank: DTensors gathered,
  ZeRO-3 partitions gathered, pipeline stages' tensors merged over the ranks (each rank contributes its own stages);
- :meth:`RunShards.deepspeed_grads`: under DeepSpeed the engine steps inside ``backward`` at the window's end, before
  the Trainer's ``on_pre_optimizer_step``: verify reads the full gradient there (``deepspeed.utils.safe_get_full_grad``).

Every method that gathers is a collective: every rank calls it at the same point (verify runs on every rank).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["RunShards", "quiet_gathers", "deepspeed_clipping_off"]

#: torch's logger for DTensor redistributions: gathering a 2-D-mesh DTensor shard by shard warns "N sequential
#: all_gather operations will be performed"; verify's own gathers are not the run's, and are said nowhere
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def quiet_gathers():
    """torch's notes on verify's own DTensor gathers (sequential all-gathers over a 2-D mesh) held back."""
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    drop = _DropAll()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def deepspeed_clipping_off(trainer: Any):
    """Under DeepSpeed the engine clips (at its config's ``gradient_clipping``, which the Trainer filled from
    ``max_grad_norm`` when it was built), not the Trainer: for the checked steps the config accelerate hands DeepSpeed
    at ``prepare`` says 0, as verify's ``max_grad_norm`` does (clipping acts after the gradient is formed); put back
    after. Nothing outside DeepSpeed."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) if getattr(trainer, "is_deepspeed_enabled", False) else None
    if not isinstance(config, dict):
        yield
        return
    absent = object()
    saved = config.get("gradient_clipping", absent)
    config["gradient_clipping"] = 0.0
    try:
        yield
    finally:
        if saved is absent:
            config.pop("gradient_clipping", None)
        else:
            config["gradient_clipping"] = saved


def _is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "full_tensor", None))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of the whole tensor, in its own dtype (a DTensor is gathered: a collective)."""
    return (t.full_tensor() if _is_dtensor(t) else t).detach().cpu().clone()


def _world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _merge_over_ranks(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's tensors by name, on every rank (pipeline stages: each rank holds its own names)."""
    if _world() == 1:
        return local
    every: list = [None] * _world()
    torch.distributed.all_gather_object(every, local)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def _plain_class(cls: type) -> type:
    """The model's own class under FSDP2's generated ``FSDP<Name>`` subclass."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return cls
    while issubclass(cls, FSDPModule):
        cls = next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
    return cls


class RunShards:
    """How ``trainer`` holds ``model``'s weights across the ranks, and the full tensors for the ground truth.

    ``kind``: None (whole on every rank: DDP, one process), ``"dtensor"`` (ep / tp / cp / FSDP2 shards),
    ``"pipeline"`` (each rank its stages), ``"zero3"`` (DeepSpeed partitions, from load time), ``"prepare"``
    (whole now; accelerate shards or partitions it when ``train()`` prepares it: FSDP2, DeepSpeed).
    """

    def __init__(self, trainer: Any, model: nn.Module):
        self.trainer, self.model = trainer, model
        self.kind = self._kind()

    def _kind(self) -> str | None:
        from ..integration.state import state_of

        state = state_of(self.trainer)
        params = list(self.model.parameters())
        if state is not None and getattr(state, "pp", None) is not None:
            return "pipeline"
        if any(_is_dtensor(p) for p in params):
            return "dtensor"
        if any(hasattr(p, "ds_id") for p in params):
            return "zero3"
        if getattr(self.trainer, "is_deepspeed_enabled", False) or getattr(self.trainer, "is_fsdp_enabled", False):
            return "prepare"
        return None

    @property
    def words(self) -> str:
        return {"dtensor": "DTensor shards (expert / tensor / context parallel, FSDP2)",
                "pipeline": "pipeline stages (each rank its own)",
                "zero3": "DeepSpeed ZeRO-3 partitions",
                "prepare": "sharded by accelerate when train() prepares it (FSDP2 / DeepSpeed)"}.get(self.kind, "whole")

    # ---------------------------------------------------------------------------------------------- the reference
    def reference(self) -> nn.Module | None:
        """An unsharded copy of the model at its current weights (None when the run's own model is whole on every
        rank). A collective for the gathered kinds."""
        if self.kind is None:
            return None
        if self.kind == "prepare":  # whole until accelerate prepares it, which train() does after this
            ref = copy.deepcopy(self.model)
        else:
            ref = self._rebuild(self.full_state())
        return ref.train(self.model.training)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state (parameters and persistent buffers, in their dtypes, on the CPU), on every rank."""
        if self.kind == "zero3":
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                return {k: _whole(v) for k, v in self.model.state_dict().items()}
        with quiet_gathers():
            local = {k: _whole(v) for k, v in self.model.state_dict().items()}
        return _merge_over_ranks(local) if self.kind == "pipeline" else local

    def _rebuild(self, state: dict[str, torch.Tensor]) -> nn.Module:
        model = self.model
        peft_config = getattr(model, "peft_config", None)
        base = model.get_base_model() if peft_config is not None and callable(getattr(model, "get_base_model", None)) else model
        cls = _plain_class(type(base))
        config = getattr(base, "config", None)
        what = f"{cls.__name__} ({self.words})"
        if config is None:
            raise InvalidArgumentError(
                f"the model {what} has no config to rebuild it unsharded from; pass verify_trainer(..., "
                "reference_model=) an unsharded copy made before the trainer was built")
        config = copy.deepcopy(config)
        if getattr(config, "distributed_config", None) is not None:
            config.distributed_config = None  # the reference is one process: no mesh
        try:
            ref = cls(config)
            if peft_config is not None:
                import peft

                name = getattr(model, "active_adapter", "default")
                name = name if isinstance(name, str) else next(iter(peft_config))
                ref = peft.get_peft_model(ref, copy.deepcopy(peft_config[name]))
        except Exception as err:  # noqa: BLE001 - any failure to build: one line, the way out named
            raise InvalidArgumentError(
                f"cannot rebuild {what} unsharded from its config for the ground truth ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:160] if str(err) else ''}); pass verify_trainer(..., reference_model=) an "
                "unsharded copy made before the trainer was built") from None
        dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
        if len(dtypes) == 1:
            ref.to(dtype=dtypes.pop())
        own = ref.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        wrong = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
        if missing or unexpected or wrong:
            first = (missing or unexpected or wrong)[0]
            raise InvalidArgumentError(
                f"the gathered weights of {what} do not fit a fresh {cls.__name__} built from its config "
                f"({len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} of another shape, e.g. {first!r}); "
                "pass verify_trainer(..., reference_model=) an unsharded copy made before the trainer was built")
        ref.load_state_dict(state, strict=True)
        device = getattr(getattr(self.trainer, "args", None), "device", None)
        if device is not None:
            ref.to(device)
        return ref

    # ---------------------------------------------------------------------------------------------- full tensors
    def full(self, named: Sequence[tuple[str, nn.Parameter]], grad: bool = False, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """``{name: full fp32 CPU tensor}`` of the parameters (``grad``: their gradients, divided by ``scale``; a
        parameter without one: zeros) over every rank; a collective."""
        if not grad and any(hasattr(p, "ds_id") for _, p in named):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
                local = {n: p.detach().float().cpu().clone() for n, p in named}
        else:
            with quiet_gathers():
                if grad:
                    local = {n: (_whole(p.grad).float() / scale if p.grad is not None
                                 else torch.zeros(tuple(p.shape), dtype=torch.float32)) for n, p in named}
                else:
                    local = {n: _whole(p).float() for n, p in named}
        return _merge_over_ranks(local) if self.kind == "pipeline" else local

    @staticmethod
    def deepspeed_grads(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        """The full gradient of each parameter the DeepSpeed engine is about to step with (ZeRO 1-3: its
        partitions gathered; a collective), fp32 on the CPU."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for n, p in named:
            g = safe_get_full_grad(p)
            out[n] = torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), dtype=torch.float32) if g is None else \
                g.detach().float().cpu().clone()
        return out
