"""Pipeline parallelism (``parallel.pp``) inside the ``Trainer``: the glue around :mod:`hf_gradfix.parallel.pipeline`.

The user's Trainer script is unchanged. At ``install`` (``patch()`` or the callback) :func:`setup`

* validates the degrees (:class:`~hf_gradfix.parallel.ParallelDims` with ``pp`` outermost) and refuses what is not
  exact yet (:func:`~hf_gradfix.parallel.pipeline.check_combination`);
* gives every rank rank 0's weights, then splits the model in place into this rank's stage(s) (the model keeps only
  its own parameters, so the Trainer's optimizer holds only those), sharded with FSDP2 per stage over dp_shard,
  or its decoder layers tensor-parallel over tp (the model's ``base_model_tp_plan``; the tp ranks of a stage get
  the same batches and count its targets once);
* marks the model as "sharded at load time" for the Trainer (``is_distributed_loading_by_transformers``, an
  attribute transformers itself sets): accelerate neither wraps it in DDP over the whole world nor moves it;
* shards data loading by data-parallel rank (the ranks of one pipeline get the same batches): accelerate's
  ``prepare_data_loader`` with this rank's data-parallel index, on this trainer's accelerator instance only.

Each optimizer window then runs as one schedule ``step()`` (:class:`PipelineRunner`): ``get_batch_samples``
counts the window's targets (summed over data-parallel ranks only), ``training_step`` collects the window's
micro-batches and runs the schedule on the last one (the schedule's micro-batches are the window's, padded to
one shape with ignored positions), the window's loss is reduced from the last stage to every stage for
logging, gradient clipping reduces the norm over the pipeline, and data-parallel replicas average gradients
over the data-parallel group only.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config.schema import GradFixConfig
from ...loss.counting import CountRule, count_targets
from ...parallel.dims import ParallelDims
from ...parallel.pipeline import (
    PipelineError,
    build_stages,
    check_combination,
    check_not_split,
    check_schedule,
    make_schedule,
    tie_gradients,
    tied_embeddings,
    window_loss_fn,
)
from ..checkpoints.sharded import PIPELINE, checkpoint_mesh  # the checkpoint layout pp and ep share
from ..diagnostics.explained_warnings import explain
from ..versions import transformers_major

logger = logging.getLogger("hf_gradfix")

__all__ = ["PipelinePlan", "setup", "PipelineError"]

_STAGE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclass
class PipelinePlan:
    """What :func:`setup` did for one trainer (``state.pp``)."""

    dims: ParallelDims
    schedule: str
    pp_rank: int
    pp_group: Any
    dp_group: Any
    modules: list
    stages: list
    loss_fn: Any
    device: Any
    pad_token_id: int = 0
    shard_group: Any = None  # the dp_shard group (FSDP2 shards of each stage)
    fsdp: bool = False  # stages sharded with FSDP2 (it averages the gradients over the data-parallel ranks)
    tp_group: Any = None  # the tp group (the stage's layers tensor-parallel over it), None without tp
    tie_group: Any = None  # tied embeddings: this replica's first- and last-stage ranks
    tied_weight: Any = None  # the copy of the tied embedding this rank holds (first or last stage), else None
    schedule_obj: Any = None  # torch's schedule for the last window's shape
    schedule_shape: tuple = ()  # (micro-batches, rows, length) it was built for
    shape_changes: int = 0
    pending: list = field(default_factory=list)  # this window's micro-batches so far
    metrics_noted: bool = False  # the note on a trainer's per-forward metrics pp does not record, given once
    lean: str | None = None  # loss.head: lean on this rank's last stage: "lean", or why it keeps the stock head
    window_count: float | None = None
    window_size: int = 0
    tokens_counted: int = 0  # num_input_tokens_seen after the last correction (transformers 4.57 counts inline)

    @property
    def is_last(self) -> bool:
        return any(m.is_last for m in self.modules)

    @property
    def line(self) -> str:
        d = self.dims
        layers = ", ".join(f"stage {m.index}: layers {m.layer_ids[0]}-{m.layer_ids[-1]}" for m in self.modules)
        return (
            f"pipeline parallel pp={d.pp} ({d.pp_stages} stages, {self.schedule}; this rank: {layers}) x "
            f"{d.dp} data-parallel rank(s){f' x tp={d.tp}' if d.tp > 1 else ''}: one schedule step per optimizer window, loss = sum / window's target "
            f"count over data-parallel ranks, scale_grads=False"
        )


# ----------------------------------------------------------------------------------------------------------------
# Setup
# ----------------------------------------------------------------------------------------------------------------


def _refuse_trainer(trainer, config: GradFixConfig, dims: ParallelDims) -> None:
    from transformers import Trainer

    what = f"hf_gradfix parallel.pp={dims.pp}"
    if not config.loss.enabled:
        raise PipelineError(
            f"{what} with loss.enabled=false: the pipeline's loss is the window's exact token mean (there is no stock "
            "transformers pipeline to fall back to); set loss.enabled: true, or pp: 1"
        )
    args = trainer.args
    if getattr(args, "label_smoothing_factor", 0):
        raise PipelineError(f"{what} with label_smoothing_factor={args.label_smoothing_factor}: the last stage computes the "
                            "model's own cross-entropy; set label_smoothing_factor: 0, or pp: 1")
    if trainer.compute_loss_func is not None:
        raise PipelineError(f"{what} with a compute_loss_func: the last stage computes the model's own loss; drop "
                            "compute_loss_func, or pp: 1")
    own = type(trainer).compute_loss
    if own is not Trainer.compute_loss:
        # the schedule runs the model's own loss on the last stage; a compute_loss of another loss would be skipped.
        # TRL's SFTTrainer computes the same token NLL with loss_type "nll" (its metrics are not computed under pp).
        sft_nll = own.__module__.split(".")[0] == "trl" and getattr(args, "loss_type", None) == "nll"
        if not sft_nll:
            kind = f" with loss_type={args.loss_type!r}" if hasattr(args, "loss_type") else ""
            raise PipelineError(
                f"{what}: {type(trainer).__name__}{kind} computes its own loss in compute_loss, which the pipeline "
                "does not call (the schedule runs the model's own cross-entropy on the last stage); use the plain "
                "causal-LM loss (loss_type 'nll' for TRL's SFTTrainer), or pp: 1"
            )
        if getattr(trainer, "aux_loss_enabled", False):
            raise PipelineError(f"{what}: a router aux loss (MoE) is not added on the pipeline's last stage; "
                                "disable it, or pp: 1")
    if getattr(trainer, "optimizer", None) is not None:
        raise PipelineError(
            f"{what} splits the model into stages, so the optimizer passed to the Trainer holds the weights of "
            "every stage; let the Trainer build it (optimizers=(None, None)) or use optimizer_cls_and_kwargs"
        )
    if getattr(args, "save_only_model", False):
        raise PipelineError(f"{what} with save_only_model=True: a pipelined checkpoint is resumed from its distributed "
                            "checkpoint of every stage's weights and optimizer state; set save_only_model: false, or pp: 1")
    if not config.loss.eval_token_mean:
        raise PipelineError(f"{what} with loss.eval_token_mean=false: the pipeline's eval loss is the exact token "
                            "mean; set loss.eval_token_mean: true, or pp: 1")


def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


def _new_groups(dims: ParallelDims, job: str, rank: int):
    """This rank's process group for ``job`` (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    mine = None
    for ranks in dims.groups(job):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _tie_groups(dims: ParallelDims, rank: int):
    """The groups {first-stage rank, last-stage rank} of every data-parallel replica (tied embeddings)."""
    import torch.distributed as dist

    mine = None
    for ranks in dims.groups("pp"):
        pair = sorted({ranks[0], ranks[-1]})  # pp rank 0 holds stage 0; pp rank pp-1 the last stage (looped)
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    return mine


def _prepare_data_loader_for(trainer, dims: ParallelDims, rank: int):
    """accelerate's ``prepare_data_loader`` with this rank's data-parallel index: the ranks of one pipeline load
    the same batches, data-parallel ranks different ones (accelerate's own mesh rule cannot express pp)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    data_rank, data_ranks = dims.data_rank(rank), dims.dp

    def _prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in accelerator._dataloaders:
                accelerator._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = accelerator.device_placement if accelerator.distributed_type != DistributedType.XLA else False
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=data_ranks,
            process_index=data_rank,
            split_batches=accelerator.split_batches,
            put_on_device=device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,  # rank 0 would dispatch over the whole world, every stage a different batch
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = _prepare  # this trainer's accelerator instance only


def count_each_batch_once(trainer, plan: "PipelinePlan", before: int) -> None:
    """transformers counts ``num_input_tokens_seen`` gathered over every rank, but the pp (and tp) ranks of a
    pipeline hold the same batch: what was added since ``before`` is counted once per data-parallel rank."""
    same_batch = plan.dims.pp * plan.dims.tp
    added = trainer.state.num_input_tokens_seen - before
    trainer.state.num_input_tokens_seen = before + added // same_batch
    plan.tokens_counted = trainer.state.num_input_tokens_seen


def _route_clipping_457(trainer, plan: "PipelinePlan") -> None:
    """transformers 4.57 clips with ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` inside its loop
    (5.x calls ``Trainer._clip_grad_norm``, overridden in the mixin): on this trainer's accelerator instance only,
    the norm is the whole pipeline's (:func:`clip_grad_norm`)."""
    accelerator = trainer.accelerator

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        if norm_type != 2:
            raise PipelineError(f"hf_gradfix parallel.pp: gradient clipping with norm_type={norm_type}; only the "
                                "2-norm is reduced over the pipeline; use max_grad_norm with the default 2-norm")
        return clip_grad_norm(trainer, plan, float(max_norm))

    accelerator.clip_grad_norm_ = clip_grad_norm_


def setup(trainer, config: GradFixConfig) -> PipelinePlan | None:
    """Split the trainer's model into this rank's pipeline stage(s) and route its data (None when ``pp`` is 1)."""
    import torch.distributed as dist

    section = config.parallel
    if section.pp <= 1:
        check_schedule(section.pp, section.pp_schedule, section.pp_virtual_stages)
        return None
    world = int(trainer.accelerator.num_processes)
    dims = ParallelDims(world, pp=section.pp, pp_virtual_stages=section.pp_virtual_stages,
                        dp_replicate=section.dp_replicate, dp_shard=section.dp_shard, tp=section.tp, cp=section.cp)
    check_schedule(dims.pp, section.pp_schedule, dims.pp_virtual_stages)
    fsdp_plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) is not None
    from ..optim_trainer import optimizer_requested

    # a low-rank optimizer from the section, TrainingArguments(optim="galore_...") or optimizer_cls_and_kwargs
    requested = optimizer_requested(trainer, config.optimizer)
    key, optimizer = "optimizer.name", config.optimizer.name
    if requested is not None and optimizer == "none":
        if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
            key, optimizer = "optimizer_cls_and_kwargs", getattr(requested[0], "__name__", str(requested[0]))
        else:
            key, optimizer = "TrainingArguments.optim", str(trainer.args.optim).split(".")[-1].lower()
    check_combination(pp=dims.pp, tp=dims.tp, cp=dims.cp, dp_shard=dims.dp_shard, packing=config.packing.enabled,
                      optimizer=optimizer, fsdp_plugin=fsdp_plugin, optimizer_key=key)
    model = trainer.model
    check_not_split(model)  # before any collective: every rank holds the mark, every rank refuses

    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dims.check_model(text)
    _refuse_trainer(trainer, config, dims)
    if not (dist.is_available() and dist.is_initialized()):
        raise PipelineError(f"hf_gradfix parallel.pp={dims.pp}: no process group; launch with hf-gradfix launch, "
                            "accelerate launch or torchrun")
    rank = dist.get_rank()
    device = trainer.args.device
    model.to(device)
    _broadcast_from_rank0(model)
    pp_group = _new_groups(dims, "pp", rank)
    dp_group = _new_groups(dims, "dp", rank)
    shard_group = _new_groups(dims, "dp_shard", rank)
    tp_group = _new_groups(dims, "tp", rank) if dims.tp > 1 else None
    fsdp_mesh = tp_mesh = None
    if dims.dp_shard > 1 or dims.tp > 1:
        mesh = dims.build_mesh(device.type)
        if dims.dp_shard > 1:  # FSDP2 per stage over dp_shard (HSDP: dp_replicate x dp_shard)
            fsdp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        if dims.tp > 1:  # each stage's layers tensor-parallel over tp (check_combination refuses it with dp_shard)
            tp_mesh = mesh["tp"]
    tied = tied_embeddings(model)
    tie_group = _tie_groups(dims, rank) if tied else None
    modules, stages = build_stages(model, pp=dims.pp, pp_rank=dims.pp_rank(rank),
                                   virtual_stages=dims.pp_virtual_stages, device=device, group=pp_group,
                                   fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh)
    pad = getattr(text, "pad_token_id", None)
    loss_fn, lean = window_loss_fn(model, dims.dp), None
    if config.loss.head == "lean":
        loss_fn, lean = _lean_last_stage(modules, dims, section.pp_schedule, fsdp_mesh is not None, loss_fn,
                                         model.loss_function)
    plan = PipelinePlan(
        dims=dims, schedule=section.pp_schedule, pp_rank=dims.pp_rank(rank), pp_group=pp_group, dp_group=dp_group,
        modules=modules, stages=stages, loss_fn=loss_fn, lean=lean, device=device,
        pad_token_id=pad if isinstance(pad, int) else 0, shard_group=shard_group, fsdp=fsdp_mesh is not None,
        tie_group=tie_group, tp_group=tp_group,
    )
    if tied:
        first = any(m.is_first for m in modules)
        last = any(m.is_last for m in modules)
        if first:
            plan.tied_weight = model.get_input_embeddings().weight
        elif last:
            plan.tied_weight = model.get_output_embeddings().weight
    # what Trainer.__init__ sets for a model sharded at load time: accelerate must not wrap it (DDP over the
    # world would mix stages) nor move it
    trainer.is_distributed_loading_by_transformers = True
    trainer.place_model_on_device = False
    if transformers_major() < 5:
        # 4.57's Trainer has no such flag; it skips accelerate's model preparation (DDP) for a model transformers
        # tensor-parallelized at load time (is_tp_enabled), which is the same situation
        trainer.is_tp_enabled = True
        _route_clipping_457(trainer, plan)
    _prepare_data_loader_for(trainer, dims, rank)
    if not any(m.is_first for m in modules):
        explain(TRANSFORMERS_MODELING_LOGGER, NO_INPUT_EMBEDDINGS, NO_INPUT_EMBEDDINGS_NOTE)
    if trainer.accelerator.is_main_process:
        logger.info("hf_gradfix: %s", plan.line)
    return plan


#: transformers 5's warning (``PreTrainedModel.enable_input_require_grads``, called by gradient checkpointing and
#: PEFT; TRL's SFTConfig turns gradient checkpointing on by default) on a stage without the embedding layer
TRANSFORMERS_MODELING_LOGGER = "transformers.modeling_utils"
NO_INPUT_EMBEDDINGS = "does not expose input embeddings. Gradients cannot flow back"
NO_INPUT_EMBEDDINGS_NOTE = (
    " [hf_gradfix: expected under parallel.pp, not a problem: this pipeline stage holds no embedding layer (the "
    "first stage does, and makes its output require gradients there); this stage's input is the previous stage's "
    "activation, which carries the gradient back, so its checkpointed layers and adapters train exactly "
    "(tests/parallel/test_pipeline.py compares every stage's gradients with one process)]"
)


def _lean_last_stage(modules: list, dims: ParallelDims, schedule: str, fsdp: bool, stock_fn, loss_function=None):
    """``loss.head: lean`` at the last stage: ``(loss_fn, "lean")``, or ``(stock_fn, why not)`` (said once). The stage
    returns its final hidden states and the loss function applies the head with the lean cross-entropy
    (:mod:`hf_gradfix.loss.lean_head`), divided like the stock one. Where the head lives outside what the loss
    function can use it as, the stock head stays: FSDP2 shards it outside the stage's forward, tensor parallel shards
    it; and the zero-bubble schedule runs the last stage's backward twice, which torch's chunked op refuses
    (measured: "chunked backward called twice"). ``loss_function``: the model's own, which ``stock_fn`` calls
    (``window_loss_fn``): the lean one computes the objective measured on it (``measure_objective``: next-token or
    same-position targets, ``sum / num_items_in_batch``), any other keeps the stock head."""
    last = [m for m in modules if m.is_last]
    if not last:
        return stock_fn, None  # this rank holds no last stage: nothing to compute
    head = last[0].head
    from ...loss.lean_head import Objective, measure_objective
    from ..lean_head import effective_linear

    found = effective_linear(head)
    objective = Objective("next", "num_items")
    if loss_function is not None:  # called as window_loss_fn calls it
        like = torch.zeros(2, 8, dtype=torch.long)
        objective = measure_objective(loss_function, (), {"logits": None, "labels": like, "vocab_size": 0,
                                                          "num_items_in_batch": torch.tensor(1)}, like)
        if not isinstance(objective, str) and (objective.targets not in ("next", "same")
                                               or objective.reduction != "num_items"):
            objective = f"its loss_function computes {objective.describe()}"
    why = ("FSDP2 (dp_shard > 1) shards the head outside the stage's forward" if fsdp
           else "tensor parallel shards the head" if dims.tp > 1
           else ("the zero-bubble schedule runs the last stage's backward twice (input, then weight gradients), "
                 "which torch's linear_cross_entropy refuses") if schedule == "zero_bubble"
           else found if isinstance(found, str) else objective if isinstance(objective, str) else None)
    if why is not None:
        warnings.warn(f"hf_gradfix: loss.head: lean is not used on the last pipeline stage: {why}; it keeps the stock "
                      "head (the logits are materialized; the loss stays exact)", stacklevel=3)
        return stock_fn, why
    for module in last:
        module.lean_head = True
    dp = dims.dp
    shifted = objective.targets == "next"

    def lean_loss_fn(hidden, labels, num_items):
        from ...loss.lean_head import head_cross_entropy_sum, next_token_targets

        weight, bias = effective_linear(head)  # per call: a LoRA head's merged weight follows its training
        targets = next_token_targets(labels) if shifted else labels
        total = head_cross_entropy_sum(hidden, weight, bias, targets)  # autocast's dtype if on
        return total / num_items * dp  # as window_loss_fn: the window's count, times what DDP averages over

    return lean_loss_fn, "lean"


def _note_unrecorded_metrics(trainer, plan: PipelinePlan) -> None:
    """Once, at the first window (a TRL trainer sets ``_metrics`` after Trainer.__init__, where the plan is made):
    TRL's trainers record per-forward metrics inside their compute_loss, which the schedule replaces."""
    plan.metrics_noted = True
    if isinstance(trainer.__dict__.get("_metrics"), dict) and trainer.accelerator.is_main_process:
        owner = next((c.__name__ for c in type(trainer).__mro__ if "compute_loss" in c.__dict__
                      and not c.__module__.startswith(("hf_gradfix", "transformers"))), type(trainer).__name__)
        logger.warning(
            "hf_gradfix parallel.pp: the pipeline schedule computes the loss, not %s.compute_loss, so the metrics that "
            "compute_loss records per forward (TRL: entropy, mean_token_accuracy, num_tokens) are not logged under "
            "pp; the loss (exact over the window) and grad_norm are", owner)


# ----------------------------------------------------------------------------------------------------------------
# One optimizer window
# ----------------------------------------------------------------------------------------------------------------


def count_window(trainer, plan: PipelinePlan, batches: list) -> float:
    """The window's target count over the data-parallel ranks (the model's shifted causal-LM rule; a collective on
    every rank). The ranks of one pipeline hold the same batches: the world sum counts each of them pp times."""
    if not plan.metrics_noted:
        _note_unrecorded_metrics(trainer, plan)
    local = float(sum(int(count_targets(b, CountRule.SHIFTED)) for b in batches if "labels" in b))
    tensor = torch.tensor([local, float(len(batches))], dtype=torch.float64, device=plan.device)
    import torch.distributed as dist

    dist.all_reduce(tensor)
    total, micro_batches = tensor.tolist()
    if micro_batches != len(batches) * trainer.accelerator.num_processes:
        raise PipelineError(
            "hf_gradfix parallel.pp: the ranks hold different numbers of micro-batches in this window "
            f"({len(batches)} here); every rank of a pipeline must get the same batches"
        )
    return total / plan.dims.non_data_parallel


def _check_batch(batch) -> None:
    extra = sorted(k for k, v in batch.items() if k not in _STAGE_KEYS and torch.is_tensor(v))
    if extra:
        raise PipelineError(
            f"hf_gradfix parallel.pp: the batch carries {extra}, which the pipeline stages do not pass on (they take "
            f"{list(_STAGE_KEYS)}); remove those columns (remove_unused_columns=True), or pp: 1"
        )
    if "labels" not in batch:
        raise PipelineError("hf_gradfix parallel.pp: a training batch without 'labels'; the last stage needs them")
    pos = batch.get("position_ids")
    if pos is not None:
        rows, length = batch["input_ids"].shape
        if not torch.equal(pos.to("cpu"), torch.arange(length).expand(pos.shape[0], length)):
            raise PipelineError(
                "hf_gradfix parallel.pp: position_ids that restart inside a row (packed sequences) are not carried "
                "through the pipeline stages yet; use a padding collator, or pp: 1"
            )


def padded_length(length: int) -> int:
    """The sequence length a window is padded to: the next power of two (at least 8). torch's stages fix their
    buffers' shapes when a schedule first runs, so every new shape rebuilds the schedule (one shape-inference
    pass); powers of two keep the shapes few.

    >>> [padded_length(n) for n in (3, 8, 9, 41, 1000)]
    [8, 8, 16, 64, 1024]
    """
    return max(8, 1 << (max(1, length) - 1).bit_length())


def schedule_micro_batches(window: int, rows: int, *, stages: int, pp: int, interleaved: bool) -> tuple[int, int, int]:
    """``(row chunks per micro-batch, rows per chunk, idle micro-batches)`` that turn a window of ``window``
    micro-batches of ``rows`` rows into a count torch's schedule accepts: 1F1B needs at least as many
    micro-batches as stages, the interleaved schedules a multiple of pp. Micro-batches are first cut by rows
    (no extra work), then idle ones (no targets) fill up what is still missing.

    >>> schedule_micro_batches(1, 2, stages=2, pp=2, interleaved=False)   # GA 1, 2 rows: two 1-row micro-batches
    (2, 1, 0)
    >>> schedule_micro_batches(1, 1, stages=2, pp=2, interleaved=False)   # one row: one idle micro-batch
    (1, 1, 1)
    >>> schedule_micro_batches(3, 2, stages=4, pp=2, interleaved=True)
    (2, 1, 0)
    """
    chunks = 1
    if window < stages:
        chunks = min(rows, -(-stages // window))
    count = window * chunks
    need = max(count, stages)
    if interleaved and need % pp:
        need += pp - need % pp
    return chunks, -(-rows // chunks), need - count


def _window_tensors(plan: PipelinePlan, batches: list) -> tuple[tuple[torch.Tensor, ...], int]:
    """The window's micro-batches as one tensor each (rows x length), for the schedule to split on dim 0, and the
    schedule's micro-batch count. Every micro-batch is padded to :func:`padded_length` of the window's longest row
    and to the same rows, with positions whose label is ignored (-100), then cut by rows / completed with idle
    micro-batches (:func:`schedule_micro_batches`). Causal attention: a real position never attends to later
    ones, so padding appended at the end changes nothing it computes; padding rows carry no targets."""
    rows = max(int(b["input_ids"].shape[0]) for b in batches)
    length = padded_length(max(int(b["input_ids"].shape[1]) for b in batches))
    d = plan.dims
    chunks, chunk_rows, idle = schedule_micro_batches(
        len(batches), rows, stages=d.pp_stages, pp=d.pp, interleaved=plan.schedule not in ("gpipe", "1f1b"))
    rows = chunks * chunk_rows
    ids, mask, pos, labels = [], [], [], []
    dtype = batches[0]["input_ids"].dtype
    for b in list(batches) + [None] * idle:
        x = torch.full((rows, length), plan.pad_token_id, dtype=dtype, device=plan.device)
        m = torch.ones((rows, length), dtype=torch.long, device=plan.device)
        y = torch.full((rows, length), -100, dtype=torch.long, device=plan.device)
        if b is not None:
            r, t = b["input_ids"].shape
            x[:r, :t] = b["input_ids"]
            if b.get("attention_mask") is not None:
                m[:r, :t] = b["attention_mask"]
            y[:r, :t] = b["labels"]
        ids.append(x), mask.append(m), labels.append(y)
        pos.append(torch.arange(length, device=plan.device).expand(rows, length))
    tensors = (torch.cat(ids), torch.cat(mask), torch.cat(pos).contiguous(), torch.cat(labels))
    return tensors, (len(batches) + idle) * chunks


def _schedule(plan: PipelinePlan, shape: tuple):
    """torch's schedule for a window of this shape (micro-batches, rows, length); a new one when the shape changes
    (the stages then infer their buffers again)."""
    if plan.schedule_obj is None or shape != plan.schedule_shape:
        plan.schedule_obj = make_schedule(plan.schedule, plan.stages, shape[0], plan.loss_fn)
        plan.shape_changes += plan.schedule_obj is not None and bool(plan.schedule_shape)
        plan.schedule_shape = shape
    return plan.schedule_obj


def run_window(trainer, plan: PipelinePlan, batches: list) -> torch.Tensor:
    """Forward and backward of the whole window through the schedule; returns the window's loss (the same value
    on every stage of the pipeline: the sum of the micro-batch losses of the last stage)."""
    import torch.distributed as dist

    for b in batches:
        _check_batch(b)
    (ids, mask, pos, labels), micro_batches = _window_tensors(plan, batches)
    schedule = _schedule(plan, (micro_batches, ids.shape[0] // micro_batches, ids.shape[1]))
    for m in plan.modules:
        m.train()
    losses: list = []
    count = torch.tensor(plan.window_count, dtype=torch.float32, device=plan.device)
    schedule.step(ids, mask, pos, target=labels, losses=losses, loss_kwargs={"num_items": count}, return_outputs=False)
    total = torch.stack([l.detach().float() for l in losses]).sum() if (plan.is_last and losses) else torch.zeros((), device=plan.device)
    dist.all_reduce(total, group=plan.pp_group)  # the loss lives on the last stage only
    if plan.tie_group is not None:
        tie_gradients(plan.tied_weight, None, plan.tie_group)
    if plan.dims.dp > 1 and not plan.fsdp:  # replicas of each stage: average the gradients over the data-parallel group
        for p in trainer.model.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a tp shard: its own replicas
                dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=plan.dp_group)
    return total


def eval_batch(trainer, plan: PipelinePlan, batch, real_rows: int | None) -> tuple[float, int]:
    """One eval batch forward-only through the schedule: ``(sum of the target losses, targets)`` of this data rank
    (the same on every stage). ``real_rows``: the rows of accelerate's padded last batch that are real samples
    (the repeated ones get ignored labels)."""
    import torch.distributed as dist

    batch = {k: v for k, v in batch.items() if k in _STAGE_KEYS}
    _check_batch(batch)
    if real_rows is not None:
        labels = batch["labels"].clone()
        labels[real_rows:] = -100
        batch["labels"] = labels
    targets = int(count_targets(batch, CountRule.SHIFTED))
    (ids, mask, pos, labels), micro_batches = _window_tensors(plan, [batch])
    schedule = _schedule(plan, (micro_batches, ids.shape[0] // micro_batches, ids.shape[1]))
    for m in plan.modules:
        m.eval()
    losses: list = []
    one = torch.tensor(1.0, device=plan.device)  # sum over the targets: num_items 1, no data-parallel factor
    with torch.no_grad():
        schedule.eval(ids, mask, pos, target=labels, losses=losses, loss_kwargs={"num_items": one})
    total = torch.stack([l.detach().double() for l in losses]).sum() if (plan.is_last and losses) else torch.zeros((), dtype=torch.float64, device=plan.device)
    dist.all_reduce(total, group=plan.pp_group)
    return float(total) / plan.dims.dp, targets  # the loss_fn multiplies by the data-parallel degree


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------

CHECKPOINT_DIR = PIPELINE.directory  # torch distributed checkpoint of every stage (model and optimizer), one per save
MESH_FILE = PIPELINE.mesh_file


def _local(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_state_dict(trainer, plan: PipelinePlan) -> dict | None:
    """The whole model's weights on rank 0 (every stage's, FSDP2 shards gathered), None elsewhere (a collective)."""
    import torch.distributed as dist

    mine = {name: _local(t).detach().cpu() for name, t in trainer.model.state_dict().items()}
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return None
    merged: dict = {}
    for part in every:
        merged.update(part)
    return merged


def save_stage(trainer, plan: PipelinePlan, output_dir: str) -> None:
    """Write every stage's weights and optimizer state as one torch distributed checkpoint (a collective; see
    :mod:`hf_gradfix.integration.checkpoints.sharded`): FSDP2 and tensor-parallel shards are DTensors that DCP saves shard by shard, replicas over
    dp_replicate are written once. Rank 0 also writes the mesh that wrote it."""
    from ..checkpoints.sharded import save

    save(trainer, output_dir, PIPELINE, checkpoint_mesh(plan))


def load_stage(trainer, plan: PipelinePlan, checkpoint: str, *, optimizer: bool) -> None:
    """Load this rank's part of the checkpoint (weights, or with ``optimizer`` the optimizer state), in place.

    Refuses a checkpoint another mesh wrote: its data order and schedule would differ, so the run would not
    continue bit for bit.
    """
    from ..checkpoints.sharded import load

    load(trainer, checkpoint, PIPELINE, checkpoint_mesh(plan), optimizer=optimizer, error=PipelineError)


def clip_grad_norm(trainer, plan: PipelinePlan, max_norm: float) -> torch.Tensor:
    """The gradient norm over the whole model (every stage), clipped to ``max_norm`` (inf: only measured)."""
    import torch.distributed as dist
    from torch.nn.utils import clip_grads_with_norm_

    params = [p for p in trainer.model.parameters() if p.grad is not None]
    local = torch.zeros((), dtype=torch.float32, device=plan.device)
    last_copy = plan.tied_weight is not None and not any(m.is_first for m in plan.modules)
    tp_shards = torch.zeros((), dtype=torch.float32, device=plan.device)
    for p in params:
        if last_copy and p is plan.tied_weight:
            continue  # the tied embedding is counted once, on the first stage
        grad = p.grad.detach()
        if hasattr(grad, "to_local") and plan.tp_group is not None:
            tp_shards += grad.to_local().float().pow(2).sum()  # a tp shard: summed over tp below
            continue
        grad = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP2 shard: summed over dp_shard below
        local += grad.float().pow(2).sum()  # replicated over tp (embedding, norms, head): counted once
    if plan.tp_group is not None:
        dist.all_reduce(tp_shards, group=plan.tp_group)
        local += tp_shards
    dist.all_reduce(local, group=plan.pp_group)  # stages hold different weights; dp replicas hold equal gradients
    if plan.fsdp and plan.dims.dp_shard > 1:
        dist.all_reduce(local, group=plan.shard_group)
    total = local.sqrt()
    if max_norm != float("inf") and params:
        if plan.tp_group is not None:  # DTensor and plain gradients together: one float coefficient for both
            coef = min(1.0, max_norm / (float(total) + 1e-6))
            for p in params:
                p.grad.mul_(coef)
        else:
            clip_grads_with_norm_(params, max_norm, total)
    return total


def bubble(plan: PipelinePlan, micro_batches: int) -> float:
    """The schedule's idle share for a window of ``micro_batches`` (the planner's formula)."""
    from ...parallel.pipeline_schedule import PipelineSpec, bubble_fraction

    return bubble_fraction(PipelineSpec(plan.dims.pp, plan.schedule, plan.dims.pp_virtual_stages, micro_batches))
