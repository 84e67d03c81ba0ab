"""ND-parallel training (dp_replicate x dp_shard x cp x tp) of a transformers model inside the ``Trainer``.

The degrees come from the ``parallel`` section of the hf_gradfix configuration (or from a model already
sharded by ``from_pretrained(distributed_config=...)``, or from accelerate's ``ParallelismConfig``); they are
validated by :class:`~hf_gradfix.parallel.ParallelDims` against the world size and the model's heads.

Route (why this one): the model is sharded by transformers' own distributed machinery, the path
``from_pretrained(distributed_config=DistributedConfig(...))`` takes, applied to the model the Trainer was
given: a torch ``DeviceMesh`` ``(pp, dp_replicate, fsdp, tp)``, DTensor tensor parallelism from the model's
``base_model_tp_plan`` and FSDP2 ``fully_shard`` from its ``base_model_fsdp_plan`` (HSDP when
``dp_replicate > 1``). Measured on transformers 5.23 / accelerate 1.15 / torch 2.13:

* accelerate's FSDP2 + TP preparation raises ``ImportError: cannot import name 'ReplicateParallel'``, and
  ``from_pretrained(device_mesh=...)`` no longer applies TP: accelerate cannot shard a TP model;
* accelerate refuses any ``ParallelismConfig`` under ``DistributedType.MULTI_CPU`` (CPU/gloo), so an
  accelerate-built ND mesh cannot exist on CPU; transformers' path runs on CPU/gloo and on GPUs alike.

The Trainer then treats the model as "sharded at load time" (``is_distributed_loading_by_transformers``):
accelerate neither wraps it in DDP nor shards it again, FSDP2 averages gradients over the
``dp_replicate x dp_shard`` ranks. Data loading stays accelerate's: the accelerator is given a DeviceMesh in
accelerate's own layout (``dp_replicate, dp_shard, cp, tp``, built by :meth:`ParallelDims.build_mesh`), from
which accelerate's ``prepare_data_loader`` gives every data-parallel rank different samples and every TP rank
the same ones. IterableDatasets are sharded per data-parallel rank (``dispatch_batches=False``): accelerate's
``DataLoaderDispatcher`` sends every rank the same batch under ``dp_shard x tp``.

Context parallelism (``cp > 1``): FSDP2 shards over ``dp_shard x cp`` (``DistributedConfig(fsdp_size=dp_shard*cp)``,
torchtitan's and accelerate's layout; HSDP with ``dp_replicate``); cp ranks get the same batches (the data mesh
has a ``cp`` dim); every train/eval step runs torch's own ``context_parallel`` on the ``cp`` sub-mesh through the
Trainer's own hook ``_prepare_context_parallel_inputs`` (set on the trainer instance): labels shifted and
``position_ids`` built on the full sequence, length padded to a multiple of 2 x cp, SDPA causal ring attention
(:mod:`hf_gradfix.parallel.context`; on CPU the CPU kernel's ring handler, :mod:`hf_gradfix.parallel.cpu_ring_attention`).
The targets are counted on the full batches before the split (``get_batch_samples``), so the count is summed over
the data-parallel ranks once per sequence.

Nothing of transformers or accelerate is patched: this module sets instance attributes that transformers and
accelerate themselves set (``trainer.is_distributed_loading_by_transformers``, ``trainer.place_model_on_device``,
``accelerator.state.device_mesh``, ``accelerator.dataloader_config.dispatch_batches``) and, under CP, the
trainer instance's ``_prepare_context_parallel_inputs`` (transformers' own CP hook in ``training_step`` and
``prediction_step``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config.resolve import parallel_requested as requested  # noqa: F401  (the rule lives with the config)
from ...config.schema import ParallelConfig
from ...parallel.dims import ParallelDims
from ..versions import ALLOW_UNTESTED_ENV
from ...errors import HfGradfixError
from .errors import NDParallelError

logger = logging.getLogger("hf_gradfix")

__all__ = ["NDParallelError", "NDPlan", "setup", "requested", "distributed_config", "check_route", "ND_TESTED"]

#: Versions the transformers route was written and tested against (``HF_GRADFIX_ALLOW_UNTESTED=1`` to try others).
ND_TESTED = {"transformers": ">=5.23,<6"}


@dataclass
class NDPlan:
    """What :func:`setup` did for one trainer (``state.nd``)."""

    dims: ParallelDims
    route: str  # "transformers" (sharded here), "model" (sharded at load time), "accelerate-fsdp", "ddp"
    source: str  # where the degrees came from: "config", "model", "accelerate"
    data_mesh: Any = None  # accelerate-layout DeviceMesh used for data loading (None: accelerate's own / none)
    checked_window: bool = False
    cp_mesh: Any = None  # the cp sub-mesh torch's context_parallel runs on (cp > 1)
    packed_cp_batches: int = 0  # packed batches split over the cp ranks (document-masked attention)
    packed_cp_calls: list = field(default_factory=lambda: [0])  # attention calls those batches made
    cp_balance: str = "per_document"  # parallel.cp_balance: how packed rows are laid over the cp ranks
    cp_balance_threshold: int | None = None  # parallel.cp_balance_threshold (long_documents)
    ep: Any = None  # hf_gradfix.parallel.ep.EPLayout of a model sharded by expert at load time
    # cp > 1, training: [batch, seq/cp] 1 = a real token of this rank's shard, 0 = the original padding or the pad cp
    # added (split with the tokens inside the cp block); the MoE router loss counts rows by it (integration/moe.py)
    cp_row_mask: Any = None
    # modules whose tp gradient all-reduce hf_gradfix made exact under gradient accumulation (patching.py)
    partial_grad_fixed: list = field(default_factory=list)

    @property
    def line(self) -> str:
        how = {
            "transformers": "model sharded with transformers' DistributedConfig (DTensor TP + FSDP2)",
            "model": "model sharded at load time by from_pretrained(distributed_config=...)",
            "accelerate-fsdp": "model sharded by accelerate's FSDP2 plugin",
            "ddp": "plain data parallelism (DDP)",
            "pipeline": "model split into pipeline stages (torch.distributed.pipelining)",
        }[self.route]
        cp = ""
        if self.dims.cp > 1:
            cp = (
                f"; context parallel over {self.dims.cp} ranks (torch ring attention, causal; labels shifted, "
                "position_ids built and targets counted on the full sequence before the split)"
            )
        if self.ep is not None:
            cp += f"; {self.ep.line}"
        return (
            f"ND mesh {self.dims.describe()} from the {self.source}: {how}; data sharded over the "
            f"{self.dims.dp} data-parallel rank(s), tp and cp ranks share batches; token count summed over data "
            f"ranks only{cp}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Degrees
# ----------------------------------------------------------------------------------------------------------------


def _dims_from_section(section: ParallelConfig, world_size: int) -> ParallelDims:
    return ParallelDims(
        world_size, dp_replicate=section.dp_replicate, dp_shard=section.dp_shard, tp=section.tp, cp=section.cp,
        ep=section.ep,
    )


def _model_sizes(model: torch.nn.Module) -> dict[str, int] | None:
    """The degrees of a model sharded at load time (``from_pretrained(distributed_config=...)``), else None."""
    if not getattr(model, "is_distributed_loading_by_transformers", False):
        return None
    dc = getattr(getattr(model, "config", None), "distributed_config", None)
    if dc is None:
        return None
    return {
        "dp_replicate": int(getattr(dc, "dp_replicate_size", 1) or 1),
        "dp_shard": int(getattr(dc, "fsdp_size", 1) or 1),
        "tp": int(getattr(dc, "tp_size", 1) or 1),
        "pp": int(getattr(dc, "pp_size", 1) or 1),
        "ep": int(getattr(dc, "ep_size", 1) or 1),
    }


def _accelerate_sizes(accelerator) -> dict[str, int] | None:
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return None
    return {
        "dp_replicate": int(pc.dp_replicate_size),
        "dp_shard": int(pc.dp_shard_size),
        "tp": int(pc.tp_size),
        "cp": int(pc.cp_size),
        "sp": int(getattr(pc, "sp_size", 1) or 1),
    }


def _mismatch(dims: ParallelDims, sizes: dict[str, int], keys: tuple[str, ...]) -> list[str]:
    return [f"{k}: {getattr(dims, k)} vs {sizes[k]}" for k in keys if k in sizes and sizes[k] != getattr(dims, k)]


def _text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


# ----------------------------------------------------------------------------------------------------------------
# The transformers route
# ----------------------------------------------------------------------------------------------------------------


def check_route(dims: ParallelDims) -> None:
    """Raise :class:`NDParallelError` unless the installed transformers can shard a model for ``dims``.

    Needs ``transformers.distributed.DistributedConfig`` with ``fsdp_size`` / ``dp_replicate_size`` and the
    model's ``prepare_distribute_model`` / ``maybe_distribute_model`` (transformers 5.x, tested on 5.23).
    """
    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = Version(Version(transformers.__version__).base_version)
    spec = ND_TESTED["transformers"]
    what = f"parallel: {dims.describe()}"
    try:
        from transformers import PreTrainedModel
        from transformers.distributed import DistributedConfig

        fields = {f.name for f in dataclasses.fields(DistributedConfig)}
        missing = [n for n in ("tp_size", "fsdp_size", "dp_replicate_size") if n not in fields]
        missing += [m for m in ("prepare_distribute_model", "maybe_distribute_model") if not hasattr(PreTrainedModel, m)]
    except ImportError:
        missing = ["transformers.distributed.DistributedConfig"]
    if missing:
        raise NDParallelError(
            f"hf_gradfix {what}: sharding the model (tensor parallelism / FSDP2) needs transformers' own "
            f"DistributedConfig machinery (transformers {spec}, tested on 5.23); the installed transformers "
            f"{transformers.__version__} lacks {missing}. Fix: install transformers{spec}, or keep the run purely "
            "data-parallel (parallel: {dp_replicate: -1, dp_shard: 1}, i.e. DDP), or shard with accelerate's "
            "fsdp_config (FSDP2, no tensor parallelism)."
        )
    if installed not in SpecifierSet(spec) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise NDParallelError(
            f"hf_gradfix {what}: the ND-parallel route was tested with transformers{spec}, not "
            f"{transformers.__version__}. Install a tested version, or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
        )


def distributed_config(dims: ParallelDims | ParallelConfig, world_size: int | None = None):
    """transformers' ``DistributedConfig`` for these degrees (``fsdp_size`` = dp_shard x cp: FSDP2 shards over the
    cp ranks too, as torchtitan and accelerate do), e.g. for ``from_pretrained(path, distributed_config=...)``."""
    if isinstance(dims, ParallelConfig):
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dims = _dims_from_section(dims, world_size)
    check_route(dims)
    from transformers.distributed import DistributedConfig

    if dims.ep > 1:  # transformers' own expert parallelism: all-to-all token dispatch, experts FSDP2 over efsdp
        return DistributedConfig(tp_size=dims.tp, fsdp_size=dims.dp_shard_cp, dp_replicate_size=dims.dp_replicate,
                                 ep_size=dims.ep, ep_implementation="all_to_all")
    return DistributedConfig(tp_size=dims.tp, fsdp_size=dims.dp_shard_cp, dp_replicate_size=dims.dp_replicate)


def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's weights (accelerate's ``sync_module_states``): TP and FSDP2 slice each
    rank's local copy, so copies that differ (a random init without a common seed) would mix several models."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


def _shard_with_transformers(model: torch.nn.Module, dims: ParallelDims) -> torch.nn.Module:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        name = type(model).__name__
        hint = " (PEFT: shard the base model first, then add adapters)" if "Peft" in name else ""
        raise NDParallelError(
            f"hf_gradfix parallel: {dims.describe()} shards a transformers PreTrainedModel with its tp/fsdp plans; "
            f"got {name}{hint}. Fix: pass the PreTrainedModel itself to the Trainer, or drop the parallel section."
        )
    dc = distributed_config(dims)
    _broadcast_from_rank0(model)
    cls = type(model)
    try:
        dc, _, mesh_manager = cls.prepare_distribute_model(dc)
        distributed = cls.maybe_distribute_model(model, dc, mesh_manager)
    except (ValueError, RuntimeError) as err:
        raise NDParallelError(
            f"hf_gradfix parallel: transformers could not shard {cls.__name__} for {dims.describe()}: {err}"
        ) from err
    if distributed is not model:  # pipeline parallelism would return a new module; pp is never set here
        raise NDParallelError("hf_gradfix parallel: transformers returned a different module while sharding")
    return model


# ----------------------------------------------------------------------------------------------------------------
# Data loading
# ----------------------------------------------------------------------------------------------------------------

_OUR_MESHES: list = []  # meshes this module put on accelerate's (process-wide, shared) state


def _mesh_sizes(mesh) -> dict[str, int]:
    return {name: int(mesh[name].size()) for name in (mesh.mesh_dim_names or ())}


def _set_data_mesh(trainer, dims: ParallelDims):
    """Give accelerate a mesh in its own layout so that its data loaders shard by data-parallel rank."""
    accelerator = trainer.accelerator
    existing = getattr(accelerator, "torch_device_mesh", None)
    if existing is not None and not any(existing is m for m in _OUR_MESHES):
        sizes = _mesh_sizes(existing)
        wrong = [
            f"{n}: {sizes.get(n, 1)} vs {getattr(dims, n)}"
            for n in ("dp_replicate", "dp_shard", "cp", "tp")
            if sizes.get(n, 1) != getattr(dims, n)
        ]
        if wrong:
            raise NDParallelError(
                f"hf_gradfix parallel: accelerate's device mesh {existing} does not match {dims.describe()} "
                f"({'; '.join(wrong)}). Fix: make the parallel section and accelerate's parallelism_config agree."
            )
        return existing
    if dims.non_data_parallel == 1:
        # every rank loads different data: accelerate's default sharding over all processes is already right
        _clear_data_mesh(trainer)
        return None
    mesh = dims.build_mesh(trainer.args.device.type)
    accelerator.state.device_mesh = mesh
    _OUR_MESHES[:] = [mesh]
    return mesh


def _clear_data_mesh(trainer) -> None:
    """Forget a mesh a previous trainer's setup put on accelerate's shared state (that trainer's, not this one's)."""
    state = trainer.accelerator.state
    current = getattr(state, "device_mesh", None)
    if current is not None and any(current is m for m in _OUR_MESHES):
        state.device_mesh = None


def _no_dispatch(trainer, dims: ParallelDims) -> None:
    """IterableDatasets: shard the stream per data-parallel rank instead of dispatching from rank 0."""
    if dims.non_data_parallel == 1:
        return
    config = getattr(trainer.accelerator, "dataloader_config", None)
    if config is None:
        return
    if config.dispatch_batches is True and dims.dp > 1:
        raise NDParallelError(
            f"hf_gradfix parallel: {dims.describe()} with accelerator_config.dispatch_batches=True: accelerate's "
            "DataLoaderDispatcher gives every rank the same batch when tensor parallelism is combined with data "
            "parallelism (data parallelism is lost, tokens are counted several times). Fix: leave dispatch_batches "
            "unset (hf_gradfix shards IterableDatasets per data-parallel rank) or set it to False."
        )
    config.dispatch_batches = False


# ----------------------------------------------------------------------------------------------------------------
# Setup on one trainer
# ----------------------------------------------------------------------------------------------------------------


def _resolve(trainer, section: ParallelConfig) -> tuple[ParallelDims | None, str]:
    world = int(trainer.accelerator.num_processes)
    model = trainer.model
    from_model = _model_sizes(model)
    from_accelerate = _accelerate_sizes(trainer.accelerator)
    if from_model is not None and from_model["pp"] > 1:
        raise NDParallelError(
            f"hf_gradfix parallel: the model was sharded with pp_size={from_model['pp']}, ep_size={from_model['ep']}; "
            "hf_gradfix's exact loss is tested for dp_replicate x dp_shard x tp (x ep over the data ranks) only."
        )
    # a model sharded by expert at load time: its structure is checked once, in setup (ep.check_model); ep borrows its
    # ranks from fsdp, so the data-parallel degrees below stay dp_replicate x fsdp
    if requested(section):
        dims, source = _dims_from_section(section, world), "config"
    elif from_model is not None:
        m = from_model
        dims = ParallelDims(world, dp_replicate=m["dp_replicate"], dp_shard=m["dp_shard"], tp=m["tp"], ep=m["ep"])
        source = "model"
    elif from_accelerate is not None and (from_accelerate["tp"] > 1 or from_accelerate["cp"] > 1):
        if from_accelerate["sp"] > 1:
            return None, "accelerate"  # DeepSpeed Ulysses: refused by the trainer layers (trainer/probe.py) with its own message
        a = from_accelerate
        dims = ParallelDims(world, dp_replicate=a["dp_replicate"], dp_shard=a["dp_shard"], tp=a["tp"], cp=a["cp"])
        source = "accelerate"
    else:
        return None, ""
    if from_model is not None and (wrong := _mismatch(dims, from_model, ("dp_replicate", "dp_shard", "tp", "ep"))):
        raise NDParallelError(
            f"hf_gradfix parallel: {dims.describe()} does not match the model's own sharding "
            f"(DistributedConfig; fsdp_size = dp_shard): {'; '.join(wrong)}. Fix: make them agree, or load the "
            "model without distributed_config and let hf_gradfix shard it."
        )
    if from_accelerate is not None and source != "accelerate" and max(dims.tp, dims.cp, from_accelerate["tp"], from_accelerate["cp"]) > 1:
        wrong = _mismatch(dims, from_accelerate, ("dp_replicate", "dp_shard", "tp", "cp"))
        if wrong:
            raise NDParallelError(
                f"hf_gradfix parallel: {dims.describe()} does not match accelerate's ParallelismConfig "
                f"({'; '.join(wrong)}). Fix: make the parallel section and accelerate's parallelism_config agree."
            )
    return dims, source


def setup(trainer, section: ParallelConfig, *, packing: bool = False, optimizer: str = "none") -> NDPlan | None:
    """Validate the degrees and apply the mesh to one trainer (called by ``install``, after ``Trainer.__init__``).

    Returns None when nothing is asked for (no ``parallel`` section, no sharded model, no accelerate TP/CP):
    the launch is left as it is (DDP, or accelerate's FSDP). ``packing`` / ``optimizer``: the rest of the
    configuration, for the combinations expert parallelism refuses.
    """
    dims, source = _resolve(trainer, section)
    if dims is None:
        _clear_data_mesh(trainer)
        return None
    accelerator = trainer.accelerator
    fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if dims.ep > 1:
        from ...parallel.ep import EPError, check_combination

        try:
            check_combination(ep=dims.ep, pp=dims.pp, cp=dims.cp, tp=dims.tp, packing=packing, optimizer=optimizer,
                              fsdp_plugin=fsdp_plugin is not None)
        except EPError as err:
            raise NDParallelError(f"hf_gradfix {err}") from None
    dims.check_model(_text_config(trainer.model))
    if dims.cp > 1:
        _check_cp(trainer, dims, fsdp_plugin)
    if dims.tp == 1 and dims.dp_shard_cp == 1:
        route = "ddp"
        if _model_sizes(trainer.model) is not None:
            route = "model"
    elif fsdp_plugin is not None:
        if dims.tp > 1:
            raise NDParallelError(
                f"hf_gradfix parallel: {dims.describe()} under accelerate's FSDP plugin: accelerate 1.15's FSDP2 + "
                "TP preparation fails with transformers 5.x (ImportError: cannot import name 'ReplicateParallel' "
                "from transformers.integrations.tensor_parallel). Fix: launch without fsdp_config "
                "(distributed_type MULTI_GPU, or torchrun); hf_gradfix then shards the model with transformers' "
                "DistributedConfig (TP + FSDP2)."
            )
        route = "accelerate-fsdp"
    elif _model_sizes(trainer.model) is not None:
        route = "model"
    else:
        route = "transformers"
    if route == "transformers":
        if getattr(trainer, "optimizer", None) is not None:
            raise NDParallelError(
                f"hf_gradfix parallel: {dims.describe()} shards the model, which replaces its parameters; the "
                "optimizer passed to the Trainer holds the old ones. Fix: let the Trainer build the optimizer "
                "(optimizers=(None, None)) or use optimizer_cls_and_kwargs."
            )
        args = trainer.args
        saves = str(getattr(args, "save_strategy", "no")).split(".")[-1].lower() != "no"
        if saves and not getattr(args, "save_only_model", False) and dims.ep == 1:  # ep: checkpoints/sharded.py writes it
            raise NDParallelError(
                f"hf_gradfix parallel: {dims.describe()}: a model sharded by transformers' DistributedConfig cannot "
                "checkpoint its optimizer state for resuming (transformers' own rule; hf_gradfix resumes pp and ep "
                "runs only). Fix: save_only_model=True or save_strategy='no'."
            )
        _shard_with_transformers(trainer.model, dims)
        # what Trainer.__init__ sets for a model sharded at load time: accelerate must not wrap or move it
        trainer.is_distributed_loading_by_transformers = True
        trainer.place_model_on_device = False
    plan = NDPlan(dims=dims, route=route, source=source, cp_balance=section.cp_balance,
                  cp_balance_threshold=section.cp_balance_threshold)
    if dims.tp > 1 and route in ("transformers", "model"):
        plan.partial_grad_fixed = _fix_partial_grad_allreduce(trainer, dims)
    if dims.ep > 1:
        from ...parallel.ep import EPError, check_model

        try:  # what transformers built: whole experts per ep rank, all-to-all dispatch, the gradient divide factor
            plan.ep = check_model(trainer.model)
        except EPError as err:
            raise NDParallelError(str(err)) from err
        from ..diagnostics.explained_warnings import explain

        explain(TORCH_REDISTRIBUTE_LOGGER, EP_NORM_REDISTRIBUTE, EP_NORM_REDISTRIBUTE_NOTE, once_per_run=True)
    if route in ("transformers", "model"):
        plan.data_mesh = _set_data_mesh(trainer, dims)
        _no_dispatch(trainer, dims)
    else:
        _clear_data_mesh(trainer)
    if dims.cp > 1:
        plan.cp_mesh = plan.data_mesh["cp"]
        # transformers' own CP hook (training_step / prediction_step), on this trainer instance only
        trainer._prepare_context_parallel_inputs = _cp_inputs_hook(trainer, plan)
    else:
        trainer.__dict__.pop("_prepare_context_parallel_inputs", None)
    if accelerator.is_main_process:
        logger.info("hf_gradfix: %s", plan.line)
    return plan


#: torch's note (every rank, once per process) when the Trainer measures the gradient norm (``_get_grad_norm``, every
#: step, also with clipping off; ``max_grad_norm`` clips with it) of expert weights sharded over transformers' 2-D
#: expert mesh: each expert's norm is partial over efsdp and ep and is reduced by one all-reduce per mesh dimension
TORCH_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
EP_NORM_REDISTRIBUTE = 'flatten mesh dimensions ["efsdp", "ep"]'
EP_NORM_REDISTRIBUTE_NOTE = (
    " [hf_gradfix: expected under expert parallelism, and harmless: it is the gradient norm of the expert weights "
    "(what max_grad_norm clips with and grad_norm logs), reduced over the efsdp x ep mesh by one all-reduce per mesh "
    "dimension instead of one over both; the same sum of squares in another order. Measured: on every rank within "
    "1.6e-7 of the norm of the full gradient (ep 2 with efsdp 1 and 2, fp32); `hf-gradfix verify` checks it on your "
    "run, per step. Shown once per run (rank 0)]"
)


def _fix_partial_grad_allreduce(trainer, dims: ParallelDims) -> list[str]:
    """transformers' ``replicated_with_grad_allreduce`` tp style (Qwen3 / Qwen3-MoE ``q_norm`` / ``k_norm``) all-reduces
    the accumulated gradient after every micro-batch, so under gradient accumulation a window's earlier micro-batches
    count tp times (measured 1.4-1.5x at tp 2, GA 2; stock too): replaced by an all-reduce of each micro-batch's own
    gradient (:func:`hf_gradfix.integration.parallel.tensor_parallel.fix_partial_grad_allreduce`). Where transformers' structure is
    not the known one, GA 1 trains as stock (one all-reduce per window: exact) and GA > 1 is refused in one line."""
    from ...errors import PatchError
    from .tensor_parallel import fix_partial_grad_allreduce

    try:
        return fix_partial_grad_allreduce(trainer.model)
    except PatchError as err:
        accumulation = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)
        if accumulation > 1:
            raise NDParallelError(
                f"hf_gradfix parallel: tp={dims.tp} with gradient_accumulation_steps={accumulation}: {err}"
            ) from None
        logger.warning("%s (gradient_accumulation_steps=1: transformers' own all-reduce is exact)", err)
        return []


# ----------------------------------------------------------------------------------------------------------------
# Guard: TP ranks must see the same batches
# ----------------------------------------------------------------------------------------------------------------


def _fingerprint(batches: list) -> list[float]:
    rows, tokens, checksum = 0.0, 0.0, 0.0
    for batch in batches:
        if not isinstance(batch, Mapping):
            continue
        for key in ("input_ids", "labels"):
            value = batch.get(key)
            if torch.is_tensor(value) and value.numel():
                flat = value.detach().reshape(-1).to("cpu", torch.float64)
                weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
                checksum += float((flat * weights).sum())
                tokens += float(flat.numel())
                if key == "input_ids":
                    rows += float(value.shape[0])
    return [rows, tokens, checksum]


def check_window(trainer, plan: NDPlan | None, batches: list) -> None:
    """On the first optimizer window, check that the ranks of each TP group got identical batches (a collective:
    every rank calls it). Different batches on TP ranks mean the data sharding is wrong, and the model's
    tensor-parallel forward would mix them silently."""
    if plan is None or plan.checked_window or plan.dims.non_data_parallel == 1:
        return
    plan.checked_window = True
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = torch.tensor(_fingerprint(batches), dtype=torch.float64, device=trainer.args.device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    every = [t.cpu().tolist() for t in every]
    checked = [("tensor", g) for g in plan.dims.groups("tp")] + [("context", g) for g in plan.dims.groups("cp")]
    checked += [("pipeline", g) for g in plan.dims.groups("pp")]
    for kind, group in checked:
        if len(group) > 1 and any(every[r] != every[group[0]] for r in group):
            raise NDParallelError(
                f"hf_gradfix parallel: {kind}-parallel ranks {group} received different batches in the first "
                f"window ({[every[r] for r in group]} as [rows, tokens, checksum]); every TP rank must get the same "
                "batch (and every CP rank). A custom dataloader or sampler must shard by data-parallel rank "
                "(hf_gradfix.parallel.ParallelDims.data_rank), not by process index."
            )


# ----------------------------------------------------------------------------------------------------------------
# Context parallelism
# ----------------------------------------------------------------------------------------------------------------


def _check_cp(trainer, dims: ParallelDims, fsdp_plugin) -> None:
    """Refuse what context parallelism cannot run exactly, with the reason (before anything is sharded)."""
    model = trainer.model
    what = f"hf_gradfix parallel.cp={dims.cp}"
    if fsdp_plugin is not None:
        raise NDParallelError(
            f"{what} under accelerate's FSDP plugin: hf_gradfix shards the model itself for CP (FSDP2 over "
            "dp_shard x cp with transformers' DistributedConfig). Fix: launch without fsdp_config (distributed_type "
            "MULTI_GPU, or torchrun) and set the degrees in the hf_gradfix parallel section."
        )
    if _model_sizes(model) is not None:
        raise NDParallelError(
            f"{what}: the model was already sharded by from_pretrained(distributed_config=...), whose fsdp_size "
            "cannot tell dp_shard from cp. Fix: load the model without distributed_config and let hf_gradfix shard it."
        )
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise NDParallelError(f"{what}: {type(model).__name__} is an encoder-decoder; CP runs causal LMs only.")
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        raise NDParallelError(
            f"{what}: the model uses attn_implementation={attn!r}; context parallelism runs torch's ring attention, "
            "which replaces torch.nn.functional.scaled_dot_product_attention only (eager, flex and flash kernels "
            "would attend within each rank's shard alone). Fix: load the model with attn_implementation='sdpa'."
        )
    text = _text_config(model)
    layer_types = getattr(text, "layer_types", None)
    non_full = sorted({t for t in (layer_types or ()) if t != "full_attention"})
    if not non_full and layer_types is None and getattr(text, "sliding_window", None):
        non_full = ["sliding_attention"]
    if getattr(text, "attention_chunk_size", None):
        non_full = sorted(set(non_full) | {"chunked_attention"})
    if non_full:
        raise NDParallelError(
            f"{what}: the model has attention layers of type {non_full}; ring attention expresses full causal "
            "attention only, so those layers would silently see the whole causal context. Fix: parallel.cp: 1."
        )
    if trainer.args.device.type == "cpu":  # the CPU kernel's ring handler is on private torch APIs: fail now, not mid-step
        from ...parallel.cpu_ring_attention import UnsupportedTorchError, _check_version

        try:
            _check_version()
        except UnsupportedTorchError as err:
            raise NDParallelError(str(err)) from err
    bidirectional = [n for n, m in model.named_modules() if getattr(m, "is_causal", None) is False]
    if bidirectional:
        raise NDParallelError(
            f"{what}: attention module {bidirectional[0]!r} is not causal (is_causal=False); ring attention is "
            "causal-only. Fix: parallel.cp: 1."
        )


def _cp_inputs_hook(trainer, plan: NDPlan):
    """``Trainer._prepare_context_parallel_inputs`` for this trainer: returns (context factory, split-ready inputs)."""
    from functools import partial

    from ...parallel.context import ContextParallelError, context_parallel_block, prepare_batch
    from ...parallel.context_packing import PACKED_DROPPED, PackedLayout, is_packed, packed_attention_block

    cp = plan.dims.cp
    model_dtype = {p.dtype for p in trainer.model.parameters() if p.is_floating_point()}
    float64 = torch.float64 in model_dtype

    def _prepare_context_parallel_inputs(model, inputs):
        from ..state import state_of

        state = state_of(trainer)
        if state is not None and not state.config.loss.enabled:
            raise NDParallelError(
                f"hf_gradfix parallel.cp={cp} needs the loss fix (loss.enabled: true): the targets must be counted on "
                "the full sequences before CP splits them, and transformers' own count does not know this mesh."
            )
        if not model.training and trainer.compute_metrics is not None and not trainer.args.prediction_loss_only:
            raise NDParallelError(
                f"hf_gradfix parallel.cp={cp}: compute_metrics under context parallelism would see each rank's "
                "sequence shard (load-balanced chunks) as if it were whole rows; only eval_loss is exact under CP. "
                "Fix: prediction_loss_only=True (or no compute_metrics) for the CP run."
            )
        pad = getattr(_text_config(model), "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        inputs = trainer._prepare_inputs(inputs)
        try:
            if is_packed(inputs):  # documents split over the cp ranks, the document mask built on the full rows
                return _packed_cp_inputs(inputs, pad, model.training)
            prepared, buffers, seq_dims = prepare_batch(inputs, cp, pad)
        except ContextParallelError as err:
            raise NDParallelError(str(err)) from err
        plan.cp_row_mask = None
        if model.training:  # split with the tokens: the real tokens of this rank's shard (the model gets no mask)
            plan.cp_row_mask = _real_tokens(inputs, prepared["input_ids"])
            buffers, seq_dims = [*buffers, plan.cp_row_mask], [*seq_dims, 1]
        return partial(context_parallel_block, plan.cp_mesh, buffers, seq_dims, float64=float64), prepared

    def _real_tokens(inputs, padded_ids):
        """[batch, padded length] int64: the batch's 2-D attention mask (right padding, checked by prepare_batch) or
        ones, then zeros over the pad cp added."""
        rows, length = inputs["input_ids"].shape
        mask = inputs.get("attention_mask")
        real = mask.to(torch.int64) if torch.is_tensor(mask) and mask.dim() == 2 else torch.ones(
            rows, length, dtype=torch.int64, device=padded_ids.device)
        real = real.to(padded_ids.device)
        return torch.nn.functional.pad(real, (0, padded_ids.shape[1] - length), value=0).contiguous()

    def _packed_cp_inputs(inputs, pad, training):
        layout = PackedLayout.build(inputs, cp, pad, balance=plan.cp_balance, threshold=plan.cp_balance_threshold)
        rank = plan.cp_mesh.get_local_rank()
        prepared = {k: layout.shard(k, rank) for k in layout.padded}
        rows, length = inputs["input_ids"].shape
        for key, value in inputs.items():
            if key in prepared or key in PACKED_DROPPED or key == "attention_mask":
                continue
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (rows, length):
                raise ContextParallelError(
                    f"hf_gradfix parallel.cp: batch entry {key!r} has the sequence dim, and hf_gradfix does not know "
                    "how to split it under context parallelism. Fix: drop it from the batch (remove_unused_columns)."
                )
            prepared[key] = value
        plan.packed_cp_batches += 1
        # packed rows: every token of a document is real, the pads that make each document a multiple of 2 x cp
        # and the row's tail are not
        plan.cp_row_mask = layout.shard_real(rank) if training else None
        return partial(packed_attention_block, layout.mask(rank), plan.cp_mesh.get_group(), plan.packed_cp_calls), prepared

    return _prepare_context_parallel_inputs
