"""Pipeline parallelism (pp) for transformers decoder LMs, exact, on torch's own ``torch.distributed.pipelining``.

What it does, in the order a run meets it:

1. **Stages from the model's own description.** A transformers model that can be pipelined says so with its
   ``base_model_pp_plan`` (which modules of the base model, in order, with their inputs and outputs, e.g.
   ``embed_tokens -> layers -> norm``) and its ``_pp_plan`` (the head, ``lm_head``). The layers are split into
   ``pp x pp_virtual_stages`` contiguous stages (:func:`split_layers`); stage 0 also holds the embedding, the
   last stage the final norm and the head; every stage holds the rotary table (no weights) and builds the
   attention mask with the model's own mask function, so masks and position ids reach every stage.
   The modules another rank holds are removed from this rank's model (their parameters are never in its
   optimizer); the global layer ids are kept, so checkpoints name the same weights as one process does.
2. **The exact loss.** torch's schedule calls ``loss_fn(output_mb, target_mb, **loss_kwargs)`` on the last
   stage once per micro-batch (and once more on the first ``step()`` for shape inference). The window's target
   count ``N`` (every micro-batch of the optimizer window, summed over the data-parallel ranks only) is taken
   before the schedule runs and passed in ``loss_kwargs``; each micro-batch's loss is the model's own loss
   function with ``num_items_in_batch=N`` (a sum over its targets / N) times the data-parallel degree (DDP and
   FSDP average gradients over it), and the schedule runs with ``scale_grads=False`` (its default divides by
   the number of micro-batches again). Nothing is counted inside ``loss_fn``.
3. **The schedule.** :data:`SCHEDULES`: GPipe, 1F1B (one stage per rank), Interleaved 1F1B and torch's
   interleaved zero-bubble schedule (several stages per rank, looped: stage ``s`` on rank ``s % pp``).

Tied input and output embeddings (first and last stage): each of the two ranks keeps its copy, their gradients
are summed after every window (:func:`tie_gradients`), so the copies stay equal.

Refused (one line, naming the key, value and fix): a model without ``base_model_pp_plan``; base-model weights
the plan does not name (e.g. absolute position embeddings); attention layer types other than full and sliding-window causal attention; pp combined with
cp, tp with dp_shard, packing, GaLore / APOLLO (:func:`check_combination`). Data parallelism composes: whole
stages replicated (``dp_replicate``; gradients averaged over the data-parallel group) or sharded with FSDP2 per
stage (``dp_shard``; HSDP with both). Tensor parallelism composes (:func:`tensor_parallel_stage`): each stage's
decoder layers are sharded over the tp sub-mesh with torch's ``parallelize_module`` from the model's own
``base_model_tp_plan`` (colwise / rowwise); embedding, norms and head stay replicated, so the tensors passed
between stages are whole.

Pure torch / transformers; no import of the Trainer glue (that is :mod:`hf_gradfix.integration.parallel.pipeline`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import HfGradfixError
from ..probe_mode import probe_mode

__all__ = [
    "SCHEDULES",
    "PipelineError",
    "check_schedule",
    "check_combination",
    "split_layers",
    "tensor_parallel_stage",
    "stage_ids_of_rank",
    "pp_plan_of",
    "decoder_stage_class",
    "build_stages",
    "check_not_split",
    "window_loss_fn",
    "make_schedule",
]

#: schedule name (the ``parallel.pp_schedule`` key) -> torch.distributed.pipelining class name
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
_SINGLE_STAGE = ("gpipe", "1f1b")


class PipelineError(HfGradfixError, ValueError):
    """A pipeline-parallel setup that cannot run exactly; the message names the key, value and fix."""


# ----------------------------------------------------------------------------------------------------------------
# Validation (pure Python: used by `config check` / `launch` and at run time alike)
# ----------------------------------------------------------------------------------------------------------------


def check_schedule(pp: int, schedule: str, virtual_stages: int) -> None:
    """Refuse a schedule that does not fit the degrees.

    >>> check_schedule(2, "1f1b", 1)
    >>> check_schedule(2, "1f1b", 2)
    Traceback (most recent call last):
    ...
    hf_gradfix.parallel.pipeline.PipelineError: parallel.pp_virtual_stages=2 with pp_schedule='1f1b': 1f1b runs one stage per pp rank; use pp_schedule: interleaved_1f1b (or zero_bubble), or pp_virtual_stages: 1
    """
    if schedule not in SCHEDULES:
        raise PipelineError(f"parallel.pp_schedule={schedule!r}: unknown schedule; use one of {sorted(SCHEDULES)}")
    if virtual_stages > 1 and schedule in _SINGLE_STAGE:
        raise PipelineError(
            f"parallel.pp_virtual_stages={virtual_stages} with pp_schedule={schedule!r}: {schedule} runs one stage per "
            "pp rank; use pp_schedule: interleaved_1f1b (or zero_bubble), or pp_virtual_stages: 1"
        )
    if pp == 1 and virtual_stages > 1:
        raise PipelineError(
            f"parallel.pp_virtual_stages={virtual_stages} with pp=1: virtual stages split a pipeline; set pp >= 2 or "
            "pp_virtual_stages: 1"
        )


def check_combination(*, pp: int, tp: int = 1, cp: int = 1, dp_shard: int = 1, packing: bool = False,
                      optimizer: str = "none", fsdp_plugin: bool = False, optimizer_key: str = "optimizer.name",
                      loss_enabled: bool = True) -> None:
    """Refuse what pipeline parallelism does not run exactly yet (each with its reason and the fix)."""
    if pp <= 1:
        return
    if not loss_enabled:  # the same words as the run's refusal (integration/parallel/pipeline.py), now at config check too
        raise PipelineError(
            f"parallel.pp={pp} with loss.enabled=false: the pipeline's loss is the window's exact token mean (there is "
            "no stock transformers pipeline to fall back to); set loss.enabled: true, or pp: 1")
    if cp > 1:
        raise PipelineError(
            f"parallel.pp={pp} with cp={cp}: pipeline stages combined with context parallelism are not built yet "
            "(each stage would need its own cp sharding of the sequence); use pp with tp / dp_shard / dp_replicate, "
            "or cp: 1"
        )
    if tp > 1 and dp_shard > 1:
        raise PipelineError(
            f"parallel.pp={pp} with tp={tp} and dp_shard={dp_shard}: FSDP2 over tensor-parallel stages is not built "
            "yet; use pp x tp with dp_replicate, or tp: 1 with dp_shard"
        )
    if packing:
        raise PipelineError(
            f"parallel.pp={pp} with packing enabled: packed rows need their per-document boundaries (cu_seq_lens / "
            "position_ids) carried to every stage, which the pipeline stages do not do yet; set packing.enabled: "
            "false, or pp: 1"
        )
    if optimizer != "none":
        raise PipelineError(
            f"parallel.pp={pp} with {optimizer_key}={optimizer!r}: the low-rank optimizers broadcast their projection "
            "basis over the whole world, but under pp each rank holds different weights (the broadcast would have to "
            "run over the data-parallel group only); use a full-rank optimizer (e.g. AdamW) with pp, or pp: 1"
        )
    if fsdp_plugin:
        raise PipelineError(
            f"parallel.pp={pp} under accelerate's FSDP plugin (distributed_type FSDP / fsdp_config): hf_gradfix "
            "shards each pipeline stage itself (FSDP2 over dp_shard); launch with distributed_type MULTI_GPU "
            "(or MULTI_CPU) and set dp_shard in the hf_gradfix parallel section"
        )


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage: as even as possible, the first ``num_layers % num_stages``
    stages one layer more (the last stage also carries the head and the loss).

    >>> split_layers(8, 2), split_layers(5, 2), split_layers(6, 4)
    ([range(0, 4), range(4, 8)], [range(0, 3), range(3, 5)], [range(0, 2), range(2, 4), range(4, 5), range(5, 6)])
    """
    if num_stages < 1 or num_layers < num_stages:
        raise PipelineError(
            f"{num_stages} pipeline stages for {num_layers} layers: every stage needs at least one layer; use "
            f"pp x pp_virtual_stages <= {num_layers}"
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_ids_of_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages one pp rank holds (looped placement, torch's default for interleaved schedules).

    >>> stage_ids_of_rank(1, 2, 2)
    [1, 3]
    """
    return [pp_rank + i * pp for i in range(virtual_stages)]


# ----------------------------------------------------------------------------------------------------------------
# The model's own description
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PPPlan:
    """Where the parts of a decoder LM live (attribute names from the model's own pp plans)."""

    base_prefix: str  # attribute of the LM holding the base model ("model")
    embed: str  # base-model attribute of the input embedding (input: input_ids)
    layers: str  # base-model attribute of the decoder layers (an nn.ModuleList)
    after_layers: list[str]  # base-model attributes after the layers (the final norm)
    head: str  # LM attribute of the output head (lm_head)
    rotary: str | None  # base-model attribute of the rotary table (no weights), or None


def _model_name(model) -> str:
    return type(model).__name__


def pp_plan_of(model) -> PPPlan:
    """Read the model's ``base_model_pp_plan`` / ``_pp_plan``; refuse a model that has none or whose base model holds
    weights the plan does not name."""
    import torch

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(text, "base_model_pp_plan", None) or {})
    base = getattr(model, "base_model", None)
    if not plan or base is None or base is model:
        raise PipelineError(
            f"parallel.pp: {_model_name(model)} has no base_model_pp_plan in its config (transformers' description of "
            "which modules form a pipeline); pipeline parallelism runs decoder LMs that define one (Llama, Qwen, "
            "Mistral, Gemma families): use such a model, or pp: 1"
        )
    names = list(plan)
    embed = [n for n in names if "input_ids" in plan[n][0]]
    layers = [n for n in names if isinstance(getattr(base, n, None), torch.nn.ModuleList)]
    if len(embed) != 1 or len(layers) != 1 or names.index(embed[0]) > names.index(layers[0]):
        raise PipelineError(
            f"parallel.pp: {_model_name(model)}'s base_model_pp_plan {plan} is not embedding -> layers -> ...; "
            "only decoder LMs of that shape are pipelined; use pp: 1"
        )
    after = names[names.index(layers[0]) + 1:]
    head_plan = dict(getattr(model, "_pp_plan", None) or {})
    heads = [n for n, (_, outs) in head_plan.items() if "logits" in outs]
    if not heads:  # transformers 4.57's post_init replaces the class's head plan with the base model's, prefixed
        head_plan = dict(getattr(type(model), "_pp_plan", None) or {})
        heads = [n for n, (_, outs) in head_plan.items() if "logits" in outs]
    if len(heads) != 1:
        raise PipelineError(
            f"parallel.pp: {_model_name(model)} has no output head in its _pp_plan ({head_plan}); only causal LMs "
            "with a logits head are pipelined; use the *ForCausalLM class, or pp: 1"
        )
    prefix = [n for n, m in model.named_children() if m is base]
    rotary = None
    unnamed = []
    for name, child in base.named_children():
        if name in plan:
            continue
        if any(True for _ in child.parameters()):
            unnamed.append(name)
        elif callable(getattr(child, "forward", None)) and "position_ids" in inspect.signature(child.forward).parameters:
            rotary = name
    if unnamed:
        raise PipelineError(
            f"parallel.pp: {_model_name(model)}'s base model holds weights its base_model_pp_plan does not place "
            f"({unnamed}); they would belong to no stage; use pp: 1 for this model"
        )
    return PPPlan(prefix[0] if prefix else "model", embed[0], layers[0], after, heads[0], rotary)


def tied_embeddings(model) -> bool:
    """Whether the model's input embedding and output head share one weight (``tie_word_embeddings``)."""
    try:
        plan = pp_plan_of(model)
    except PipelineError:
        return False
    return _tied(model, plan)


def _tied(model, plan: PPPlan) -> bool:
    base = model.base_model
    emb = getattr(getattr(base, plan.embed, None), "weight", None)
    head = getattr(getattr(model, plan.head, None), "weight", None)
    return emb is not None and head is not None and emb is head


# ----------------------------------------------------------------------------------------------------------------
# One stage
# ----------------------------------------------------------------------------------------------------------------


def _mask_functions() -> dict[str, Callable]:
    from transformers import masking_utils

    return {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }


def decoder_stage_class():
    """The ``nn.Module`` class of one stage (made on first use: importing this module needs no torch)."""
    import torch

    class _DecoderStage(torch.nn.Module):
        """Stage ``index`` of ``num_stages``: (embedding) -> its layers -> (norm -> head).

        Inputs and outputs between stages: ``(hidden_states, attention_mask, position_ids)``; stage 0 takes
        ``(input_ids, attention_mask, position_ids)``; the last stage returns the logits.
        """

        def __init__(self, model, plan: PPPlan, index: int, num_stages: int, layer_ids: range):
            super().__init__()
            base = model.base_model
            self.index, self.num_stages = index, num_stages
            self.is_first, self.is_last = index == 0, index == num_stages - 1
            self.config = base.config
            self.layer_ids = list(layer_ids)
            all_layers = getattr(base, plan.layers)
            # global ids as the keys: the same parameter names as the whole model's layers.<i>
            self.layers = torch.nn.ModuleDict({str(i): all_layers[i] for i in self.layer_ids})
            self.embed = getattr(base, plan.embed) if self.is_first else None
            self.after = torch.nn.ModuleList([getattr(base, n) for n in plan.after_layers]) if self.is_last else None
            self.head = getattr(model, plan.head) if self.is_last else None
            # loss.head: lean on the last stage: it returns the final hidden states and the loss function applies
            # the head (hf_gradfix.integration.parallel.pipeline sets it where the head can take it)
            self.lean_head = False
            self.rotary = getattr(base, plan.rotary) if plan.rotary else None
            masks = _mask_functions()
            # a layer's own attention_type, else the model-wide rule (a config sliding_window: every layer slides)
            default = "sliding_attention" if getattr(self.config, "sliding_window", None) and getattr(
                self.config, "layer_types", None) is None else "full_attention"
            self.layer_types = [getattr(all_layers[i], "attention_type", default) for i in self.layer_ids]
            unknown = sorted({t for t in self.layer_types if t not in masks})
            if unknown:
                raise PipelineError(
                    f"parallel.pp: {_model_name(model)} has attention layers of type {unknown}; the pipeline stages "
                    "build full and sliding-window causal masks only; use pp: 1 for this model"
                )
            self._masks = {t: masks[t] for t in set(self.layer_types)}
            self._mask_takes = {t: set(inspect.signature(f).parameters) for t, f in self._masks.items()}

        def _mask(self, kind: str, hidden, attention_mask, position_ids):
            takes = self._mask_takes[kind]
            embeds = "inputs_embeds" if "inputs_embeds" in takes else "input_embeds"  # transformers 4.57's name
            kwargs = {"config": self.config, embeds: hidden, "attention_mask": attention_mask,
                      "position_ids": position_ids}
            for name in ("cache", "past_key_values"):
                if name in takes:
                    kwargs[name] = None
            if "cache_position" in takes:
                kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
            return self._masks[kind](**kwargs)

        def forward(self, hidden_or_ids, attention_mask, position_ids):
            hidden = self.embed(hidden_or_ids) if self.is_first else hidden_or_ids
            masks = {kind: self._mask(kind, hidden, attention_mask, position_ids) for kind in self._masks}
            rotary = self.rotary(hidden, position_ids=position_ids) if self.rotary is not None else None
            for layer_id, kind in zip(self.layer_ids, self.layer_types):
                kwargs = {"attention_mask": masks[kind], "position_ids": position_ids}
                if rotary is not None:
                    kwargs["position_embeddings"] = rotary
                out = self.layers[str(layer_id)](hidden, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
            if not self.is_last:
                return hidden, attention_mask, position_ids
            for module in self.after:
                hidden = module(hidden)
            return hidden if self.lean_head else self.head(hidden)

    return _DecoderStage


def _prune(model, plan: PPPlan, kept_layers: set[int], first: bool, last: bool) -> None:
    """Remove from this rank's model what other ranks hold (its parameters never reach this rank's optimizer).
    Layer slots become empty ``nn.Identity`` modules so that the kept layers keep their global ids."""
    import torch

    base = model.base_model
    layers = getattr(base, plan.layers)
    for i in range(len(layers)):
        if i not in kept_layers:
            layers[i] = torch.nn.Identity()
    if not first:
        setattr(base, plan.embed, None)
    if not last:
        for name in plan.after_layers:
            setattr(base, name, None)
        setattr(model, plan.head, None)


def shard_stage(module, fsdp_mesh) -> None:
    """FSDP2 over the data-parallel sub-mesh of one stage: each decoder layer its own unit, then the stage's
    remaining weights (embedding / norm / head). FSDP2 averages the gradients over that mesh (HSDP on a 2-D one)."""
    from torch.distributed.fsdp import fully_shard

    for layer in module.layers.values():
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(module, mesh=fsdp_mesh)


_TP_STYLES = ("colwise", "rowwise")


def tensor_parallel_stage(module, tp_mesh, model_config) -> None:
    """Shard one stage's decoder layers over ``tp_mesh`` from the model's ``base_model_tp_plan`` with torch's
    ``parallelize_module`` (``colwise`` -> ``ColwiseParallel``, ``rowwise`` -> ``RowwiseParallel``). Only the
    ``layers.*`` entries are applied: the embedding, norms and head stay replicated (exact, and the hidden states
    passed between stages stay whole tensors). A layer entry of another style is refused (leaving one module of
    a colwise / rowwise pair replicated would compute something else)."""
    import re

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    name = type(text).__name__
    if not plan:
        raise PipelineError(
            f"parallel.tp: {name} has no base_model_tp_plan (transformers' description of how its layers shard); "
            "use tp: 1 with pp"
        )
    sub = {}
    for pattern, style in plan.items():
        m = re.fullmatch(r"layers\.\*\.(.+)", pattern)
        if not m:
            continue  # embedding / norm / head: replicated
        if style not in _TP_STYLES:
            raise PipelineError(
                f"parallel.tp: {name}'s base_model_tp_plan shards {pattern!r} as {style!r}; pipeline stages shard "
                f"layers with {list(_TP_STYLES)} only; use tp: 1 with pp for this model"
            )
        sub[m.group(1)] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    if not sub:
        raise PipelineError(f"parallel.tp: {name}'s base_model_tp_plan {plan} names no layer modules; use tp: 1 with pp")
    for layer in module.layers.values():
        parallelize_module(layer, tp_mesh, sub)


def check_stages_reproduce_forward(model, plan: PPPlan | None = None, num_stages: int = 2) -> None:
    """Run a few tokens through every stage in turn and through the model's own forward (one process, before the
    split): the logits must agree. A model whose forward does more than its pp plan says (an embedding scale, an
    extra input) would otherwise train silently wrong under pp; it is refused here instead."""
    import torch

    plan = plan or pp_plan_of(model)
    num_layers = len(getattr(model.base_model, plan.layers))
    ranges = split_layers(num_layers, min(num_stages, num_layers))
    cls = decoder_stage_class()
    modules = [cls(model, plan, s, len(ranges), ranges[s]) for s in range(len(ranges))]
    device = next(model.parameters()).device
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 16))
    ids = (torch.arange(12, device=device).reshape(2, 6) * 7 + 3) % max(vocab, 1)
    mask = torch.ones_like(ids)
    pos = torch.arange(6, device=device).expand(2, 6)
    modes = probe_mode(model)
    modes.__enter__()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits.float()
            out = (ids, mask, pos)
            for m in modules:
                out = m(*out)
            got = out.float()
    except Exception as err:  # noqa: BLE001 - a layer or rotary table called differently than the plan says
        raise PipelineError(
            f"parallel.pp: {_model_name(model)}'s layers cannot be called from its base_model_pp_plan alone "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160]}); use pp: 1 for this model"
        ) from None
    finally:
        modes.__exit__(None, None, None)
    scale = expected.abs().max().clamp(min=1e-6)
    if got.shape != expected.shape or float((got - expected).abs().max() / scale) > 1e-3:
        raise PipelineError(
            f"parallel.pp: {_model_name(model)}'s forward does more than its base_model_pp_plan describes (the stages "
            "built from the plan give other logits than the model itself, e.g. an embedding scale or an extra input "
            "in its forward); pipelining it would train a different model: use pp: 1 for this model"
        )


SPLIT_MARK = "_hf_gradfix_pipeline_split"


def check_not_split(model) -> None:
    """Refuse a model an earlier Trainer already split into pipeline stages (every rank holds only its stage, so
    splitting or broadcasting it again would mix stages or hang); the same on every rank, before any collective."""
    split = getattr(model, SPLIT_MARK, None)
    if split is not None:
        raise PipelineError(
            f"parallel.pp: this {_model_name(model)} was already split into pipeline stages by an earlier Trainer "
            f"({split}); build the new Trainer on a freshly loaded model (e.g. from_pretrained of the saved "
            "checkpoint), or keep using the first trainer (trainer.evaluate(), trainer.train() again)"
        )


def build_stages(model, *, pp: int, pp_rank: int, virtual_stages: int, device, group,
                 fsdp_mesh=None, tp_mesh=None) -> tuple[list, list]:
    """Split ``model`` in place for pipeline rank ``pp_rank``: returns ``(stage modules, torch PipelineStages)``.

    The model keeps only this rank's parts (embedding on the first stage, norm and head on the last); every
    rank must call it with the same model (same weights). With ``fsdp_mesh`` each stage is sharded with FSDP2
    over it (:func:`shard_stage`), with ``tp_mesh`` its layers tensor-parallel over it (:func:`tensor_parallel_stage`),
    before torch's ``PipelineStage`` wraps it."""
    from torch.distributed.pipelining import PipelineStage

    plan = pp_plan_of(model)
    # Tied input / output embeddings: the first stage keeps the weight as the embedding, the last stage as the
    # head (pruning gives each rank its own copy, equal at the start); the caller sums the two gradients across
    # those ranks after each window (tie_gradients) so both copies take the same steps.
    base = model.base_model
    num_layers = len(getattr(base, plan.layers))
    num_stages = pp * virtual_stages
    check_stages_reproduce_forward(model, plan, num_stages)
    ranges = split_layers(num_layers, num_stages)
    cls = decoder_stage_class()
    ids = stage_ids_of_rank(pp_rank, pp, virtual_stages)
    modules = [cls(model, plan, s, num_stages, ranges[s]) for s in ids]
    kept = {i for s in ids for i in ranges[s]}
    _prune(model, plan, kept, first=0 in ids, last=(num_stages - 1) in ids)
    # the split cannot be undone: a later Trainer on this model must not split (or broadcast) it again
    setattr(model, SPLIT_MARK, f"pp={pp}, stage(s) {ids} of {num_stages}")
    if tp_mesh is not None:
        for m in modules:
            tensor_parallel_stage(m, tp_mesh, model.config)
    if fsdp_mesh is not None:
        for m in modules:
            shard_stage(m, fsdp_mesh)
    stages = [PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(modules, ids)]
    return modules, stages


# ----------------------------------------------------------------------------------------------------------------
# Loss and schedule
# ----------------------------------------------------------------------------------------------------------------


def tie_gradients(first_stage_weight, last_stage_weight, group) -> None:
    """Sum the tied embedding's gradient over the first and last stage (each rank passes the copy it holds, the
    other as None): both copies then get the whole model's gradient and stay equal under the same optimizer."""
    import torch.distributed as dist

    weight = first_stage_weight if first_stage_weight is not None else last_stage_weight
    if weight is None or weight.grad is None:
        return
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    dist.all_reduce(local, group=group)


def window_loss_fn(model, dp_degree: int) -> Callable:
    """``loss_fn(logits_mb, labels_mb, num_items)`` for torch's schedule: the model's own loss function with
    the window's global target count (``num_items``, passed through ``loss_kwargs``) times the data-parallel
    degree that DDP / FSDP divide the gradients by. Counts nothing itself (the schedule calls it once more on
    its first step)."""
    loss_function = model.loss_function
    vocab_size = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size

    def loss_fn(logits, labels, num_items):
        loss = loss_function(logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items)
        return loss * dp_degree

    return loss_fn


def make_schedule(name: str, stages: Sequence, n_microbatches: int, loss_fn: Callable | None):
    """torch's schedule ``name`` over this rank's stages, with ``scale_grads=False`` (the loss is already the
    window's)."""
    from torch.distributed import pipelining

    cls = getattr(pipelining, SCHEDULES[name], None)
    if cls is None:
        raise PipelineError(
            f"parallel.pp_schedule={name!r}: this torch has no {SCHEDULES[name]}; use pp_schedule: 1f1b or gpipe"
        )
    if name in _SINGLE_STAGE:
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=False)
