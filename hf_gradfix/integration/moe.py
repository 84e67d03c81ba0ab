"""Mixture-of-experts in the Trainer: the router's load-balancing loss by a declared convention, and router health.

``loss.aux_loss`` picks the convention (docs/moe.md):

- ``micro`` (alias ``micro_batch_mean``, the default): what transformers and TRL intend, the mean over micro-batches
  and data ranks of each micro-batch's load-balancing loss, without stock's x GA x world scaling; under context
  parallelism the counts of one micro-batch are summed over its cp shards (padding masked) before the loss is formed
  (:func:`_cp_micro_share`); tp ranks hold the same tokens, whose counts are already the micro-batch's;
- ``global``: the load-balancing loss of the whole optimizer window, expert frequencies counted over every routed
  token of every micro-batch on every rank (Qiu et al. 2025). Exact: before the window's first micro-batch trains,
  a routing pre-pass (one no-grad forward per micro-batch, under a forked RNG so that dropout draws what training
  draws) counts the window's top-k selections on every rank; each micro-batch then back-propagates its exact share
  (:func:`hf_gradfix.loss.moe.window_share`). Cost: one extra forward per micro-batch;
- ``previous``: the cheap approximation, the previous window's expert frequencies with this window's rows (the first
  window: ``micro``); no extra forward, one small all-reduce per window;
- ``none``: no router loss; ``as_is``: stock (for comparison).

Whether a model's ``aux_loss`` is the load-balancing loss these conventions rebuild is measured, not assumed: on the
first training forward the loss rebuilt from the model's own router logits must equal its ``aux_loss``; a model
whose aux term is something else trains with ``micro`` and one warning.

:class:`RouterHealthCallback` logs, per MoE layer, the max / mean expert load and the experts that received no token
over each logging interval (every rank's tokens), and the interval's load-balancing loss.

Imported by the trainer layers (:mod:`.trainer`) only where a model returns router logits.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from transformers import Trainer, TrainerCallback

from ..loss.counting import mean_term_share
from ..loss.moe import routing_stats, window_share
from .calling_trainer import _find_trainer
from .instance_methods import InstanceMethods
from ..errors import GradFixError
from .state import GradFixState, _dp_world, _nd_dims, _tp_size, state_of
from .trainer.windows import _IdleMicroBatch

logger = logging.getLogger("hf_gradfix")

__all__ = ["AUX_CONVENTIONS", "RouterHealthCallback", "aux_share", "before_chain", "before_forward", "bias_counting",
           "chain_correction"]

#: the values of ``loss.aux_loss`` (``micro_batch_mean`` is the earlier name of ``micro``)
AUX_CONVENTIONS = ("micro", "micro_batch_mean", "global", "previous", "bias", "none", "as_is")
_REL_TOL = 1e-4  # the model's aux_loss vs the loss rebuilt from its router logits (fp32 rounding of a sum)


@dataclass
class MoEState:
    """One trainer's routing bookkeeping (``GradFixState.moe``)."""

    top_k: int | None
    checked: bool = False  # the model's aux_loss was found equal to the rebuilt load-balancing loss
    fallback: str | None = None  # why global / previous trains as micro
    window: Any = None  # the window whose counts below are known
    window_counts: torch.Tensor | None = None  # (experts,) top-k selections of the whole window, all ranks
    window_rows: float = 0.0
    prepass_forwards: int = 0
    # what this rank routed since the last reduction (health) and in the window in progress (previous)
    local_counts: torch.Tensor | None = None  # (layers, experts)
    local_prob_sum: torch.Tensor | None = None  # (experts,)
    local_rows: float = 0.0
    window_local_counts: torch.Tensor | None = None
    window_local_rows: float = 0.0
    prev_freq: torch.Tensor | None = None  # (experts,) the previous window's C_e / N, all ranks
    hook: Any = None  # the forward hook that keeps a trainer-computed loss's router outputs (before_chain)
    captured: Any = None  # (router logits, aux_loss, attention mask) of the last training forward
    router_seen: list = field(default_factory=list)  # router outputs of the forward in progress
    chain_warned: bool = False
    bias_routers: list | None = None  # aux_loss: bias: the routers with a correction bias, in layer order
    bias_counts: dict = field(default_factory=dict)  # router -> (experts,) selections this window on this rank
    bias_seen: int = 0  # micro-batches of this window counted so far
    bias_windows: int = 0  # bias updates applied
    last_bias_counts: torch.Tensor | None = None  # the last window's counts, all ranks, routers concatenated
    bias_interval: torch.Tensor | None = None  # (routers, experts) selections since the last log, all ranks (health)
    counting: bool = False
    row_mask: Any = None
    cp_checked: bool = False  # micro under cp: the model's aux_loss was compared with the rebuilt loss (all cp ranks)
    cp_fallback: bool = False  # micro under cp trains the per-shard mean (one warning)
    health: dict = field(default_factory=dict)


def _convention(state: GradFixState) -> str:
    conv = state.config.loss.aux_loss
    return "micro" if conv == "micro_batch_mean" else conv


def _moe(trainer: Trainer, state: GradFixState) -> MoEState:
    if getattr(state, "moe", None) is None:
        config = getattr(trainer.model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        state.moe = MoEState(top_k=getattr(text, "num_experts_per_tok", None))
    return state.moe


def _router_logits(outputs: Any):
    logits = outputs.get("router_logits") if isinstance(outputs, Mapping) else getattr(outputs, "router_logits", None)
    if isinstance(logits, (tuple, list)) and logits and all(torch.is_tensor(t) for t in logits):
        return tuple(logits)
    return None


def _reduce(trainer: Trainer, t: torch.Tensor, *, per_batch: bool = True) -> torch.Tensor:
    """The sum over every rank; ``per_batch``: of a per-batch quantity (routing counts, rows), which the ranks of a tp
    group hold in as many identical copies (they run the same batch): the sum divided by tp, each token once."""
    t = t.to(device=trainer.args.device, dtype=torch.float64)
    if trainer.accelerator.num_processes > 1:
        t = trainer.accelerator.reduce(t, reduction="sum")
        copies = _tp_size(trainer) if per_batch else 1
        if copies > 1:
            t = t / copies  # integer counts summed tp times: exact in float64
    return t


def _agree(trainer: Trainer, values: list[float]) -> list[float] | None:
    """The values every rank holds, or None where some rank holds others (one all-reduce of sums and squares)."""
    t = torch.tensor([x for v in values for x in (v, v * v)], dtype=torch.float64)
    total = _reduce(trainer, t, per_batch=False).cpu()
    world = trainer.accelerator.num_processes
    out = []
    for i in range(len(values)):
        s, sq = float(total[2 * i]), float(total[2 * i + 1])
        if abs(s * s - world * sq) > 1e-6 * max(1.0, s * s):
            return None
        out.append(s / world)
    return out


def _fall_back(moe: MoEState, reason: str) -> None:
    if moe.fallback is None:
        moe.fallback = reason
        logger.warning("hf_gradfix: %s; the router aux loss is trained by the 'micro' convention instead.", reason)


@contextlib.contextmanager
def _same_randomness(device: torch.device):
    """The pre-pass consumes the random numbers the training forwards will consume next, then hands them back: with
    dropout or router jitter each micro-batch's pre-pass routes as its training forward does."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def before_forward(trainer: Trainer, state: GradFixState) -> None:
    """At the first training forward of each optimizer window: under ``global``, the routing pre-pass over the
    window's micro-batches (all ranks' counts in one all-reduce); under ``previous``, the previous window's counts
    and this window's rows (one all-reduce). Every rank calls it once per window (collectives inside)."""
    conv = _convention(state)
    window = state.window
    if conv not in ("global", "previous") or window is None or not state.aux_coef:
        return
    moe = _moe(trainer, state)
    if moe.window is window or moe.fallback is not None:
        return
    if moe.window is None:
        _check_composes(trainer, state, conv)
    moe.window = window
    if conv == "global":
        _prepass(trainer, state, moe, window)
    else:
        _previous_window(trainer, moe, window)


def _check_composes(trainer: Trainer, state: GradFixState, conv: str) -> None:
    """``global`` / ``previous`` count routing over the data-parallel ranks. Measured exact: DDP, and a model sharded
    by transformers' expert parallelism (FSDP2 over the data ranks, experts by all-to-all; the pre-pass forwards run
    in lockstep as the training forwards do). Not built or not measured: tp / cp (the pre-pass would run outside the
    sequence sharding), pp, hf_gradfix's own FSDP2 mesh, accelerate's FSDP, DeepSpeed. Under ep, tp is measured
    (tp 2 x dp_shard 2 x ep 2): the ranks of a tp group run the same batch, counted once (:func:`_reduce`)."""
    dims = _nd_dims(trainer)
    plan = getattr(state, "nd", None)
    expert_parallel = plan is not None and getattr(plan, "ep", None) is not None
    keys = ("pp", "cp") if expert_parallel else ("pp", "tp", "cp", "dp_shard")
    found = [f"parallel.{k}={getattr(dims, k)}" for k in keys if dims is not None and getattr(dims, k, 1) > 1]
    if getattr(trainer, "is_fsdp_enabled", False):
        found.append("accelerate FSDP")
    if getattr(trainer, "is_deepspeed_enabled", False):
        found.append("DeepSpeed")
    if found:
        raise GradFixError(f"loss.aux_loss={conv!r} with {found[0]}: the window's routing counts are built over "
                           "data-parallel replicas (DDP) only so far; use loss.aux_loss: micro there, or plain DDP")


def before_chain(trainer: Trainer, state: GradFixState) -> None:
    """Before a trainer's own ``compute_loss`` (TRL's SFTTrainer adds the router loss itself): the window's counts
    (as :func:`before_forward`), and a forward hook that keeps the training forward's router logits and aux loss."""
    conv = _convention(state)
    if conv == "as_is" or (conv == "micro" and _chain_adds_router_loss(state)):
        return
    moe = _moe(trainer, state)
    if moe.hook is None:
        moe.hook = [trainer.model.register_forward_hook(_keep_router_outputs(moe), with_kwargs=True)]
        moe.hook += _router_module_hooks(trainer.model, moe)
    moe.captured, moe.router_seen = None, []
    before_forward(trainer, state)


def _keep_router_outputs(moe: MoEState):
    def hook(module, args, kwargs, output):
        if torch.is_grad_enabled() and module.training:
            aux = output.get("aux_loss") if isinstance(output, Mapping) else getattr(output, "aux_loss", None)
            logits = _router_logits(output) or (tuple(moe.router_seen) if moe.router_seen else None)
            moe.captured = (logits, aux, kwargs.get("attention_mask"))
            moe.router_seen = []

    return hook


def _router_module_hooks(model: torch.nn.Module, moe: MoEState) -> list:
    """Hooks on the modules the model declares as its routers (transformers' ``_can_record_outputs["router_logits"]``,
    the recorder that fills ``outputs.router_logits``): a trainer whose forward drops ``router_logits`` from its
    outputs (TRL's fused log-prob head) still has them, in layer order."""
    recorder = None
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            break
    target, index = getattr(recorder, "target_class", None), getattr(recorder, "index", 0)
    if target is None:
        return []

    def hook(module, args, output):
        if torch.is_grad_enabled() and module.training:
            moe.router_seen.append(output[index] if isinstance(output, (tuple, list)) else output)

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, target)]


def _chain_adds_router_loss(state: GradFixState) -> bool:
    """Whether the trainer's own ``compute_loss`` adds a router term, as its probe measured: ``loss(n) = S / n + A``
    with ``A`` that term (TRL's fused path); ``A = 0`` where it drops the router loss (TRL's label-smoothing and
    ``compute_loss_func`` paths compute the loss from the logits alone)."""
    chain = getattr(state, "chain", None)
    return chain is None or abs(chain.additive_term) > 1e-9


def chain_correction(trainer: Trainer, state: GradFixState, micro_batches: int):
    """What turns the router term a trainer's own ``compute_loss`` added into the configured convention's, or None.

    Read from what the trainer declares: TRL's trainers set ``aux_loss_enabled`` and ``router_aux_loss_coef`` and add
    ``router_aux_loss_coef * aux_loss / gradient_accumulation_steps`` per micro-batch (the ``micro`` convention,
    measured exact in tests/trainer/test_trainer_matrix.py), except on the paths the probe measured adding nothing (label
    smoothing): there the whole convention's term is added; any other trainer keeps its own term, with one warning."""
    conv = _convention(state)
    adds = _chain_adds_router_loss(state)
    if conv == "as_is" or (conv == "micro" and adds):
        return None
    moe = _moe(trainer, state)
    captured, moe.captured = moe.captured, None
    coef = getattr(trainer, "router_aux_loss_coef", None)
    if not getattr(trainer, "aux_loss_enabled", False) or not coef:
        if not moe.chain_warned:
            moe.chain_warned = True
            logger.warning("hf_gradfix: loss.aux_loss=%r: %s.compute_loss adds its router loss its own way (no TRL "
                           "aux_loss_enabled / router_aux_loss_coef); it is left as the trainer computes it.",
                           conv, type(trainer).__name__)
        return None
    if captured is None or captured[1] is None or not torch.is_tensor(captured[1]):
        return None
    logits, aux, mask = captured
    added = float(coef) * aux / micro_batches if adds else 0.0  # what the trainer added
    saved = state.aux_coef
    state.aux_coef = float(coef)  # the trainer's coefficient, which it may set apart from the model's
    try:
        wanted = aux_share(trainer, state, float(coef) * aux, {"router_logits": logits}, {"attention_mask": mask},
                           micro_batches)
    finally:
        state.aux_coef = saved
    return wanted - added


# ------------------------------------------------------------------------------------------------ checkpoints
MOE_STATE_FILE = "hf_gradfix_moe_rank{rank}.pt"


def save_state(trainer: Trainer, state: GradFixState, checkpoint_dir: str) -> None:
    """``previous`` carries the last window's counts into the next window: a checkpoint keeps them (one file per
    process), so that a resumed run's first window uses them as the uninterrupted run does."""
    import os

    moe = getattr(state, "moe", None)
    if _convention(state) != "previous" or moe is None or moe.window_local_counts is None:
        return
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save({"window_local_counts": moe.window_local_counts, "window_local_rows": moe.window_local_rows},
               os.path.join(checkpoint_dir, MOE_STATE_FILE.format(rank=trainer.args.process_index)))


def load_state(trainer: Trainer, state: GradFixState, checkpoint_dir: str | None) -> None:
    import os

    if _convention(state) != "previous" or checkpoint_dir is None:
        return
    path = os.path.join(checkpoint_dir, MOE_STATE_FILE.format(rank=trainer.args.process_index))
    if not os.path.isfile(path):
        logger.warning("hf_gradfix: loss.aux_loss='previous': %s holds no router counts (%s); the resumed run's "
                       "first window trains with 'micro'.", checkpoint_dir, os.path.basename(path))
        return
    saved = torch.load(path, weights_only=True)
    moe = _moe(trainer, state)
    moe.window_local_counts = saved["window_local_counts"]
    moe.window_local_rows = float(saved["window_local_rows"])


# ------------------------------------------------------------------------------------------------ bias (aux-free)
_BIAS = "e_score_correction_bias"  # the buffer transformers' aux-free routers (DeepSeek-V3, GLM-4-MoE, ...) select with


@contextlib.contextmanager
def bias_counting(trainer: Trainer, state: GradFixState, micro_batches: int):
    """``aux_loss: bias`` around one training micro-batch's forward: count the experts each router selected (its own
    top-k output, padding masked), and after the window's last micro-batch move every router's correction bias by
    ``aux_bias_rate * sign(mean load - load_e)`` with the window's counts summed over its micro-batches and ranks
    (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2). Counted only inside this forward: the recomputation of a checkpointed
    layer during backward runs the router again, outside it, and is not counted twice."""
    moe = _moe(trainer, state)
    if moe.bias_routers is None:
        moe.bias_routers = _bias_routers(trainer)
    moe.counting = True
    try:
        yield
    finally:
        moe.counting = False
    moe.bias_seen += 1
    if moe.bias_seen >= micro_batches:
        _apply_bias_update(trainer, state, moe)


def _bias_routers(trainer: Trainer) -> list:
    """The modules the model declares as routers that select with a correction bias, in layer order, each with a
    hook that counts its selections. A model without one is refused (the convention needs it)."""
    model = trainer.model
    routers = [m for m in model.modules() if torch.is_tensor(getattr(m, _BIAS, None))]
    if not routers:
        raise GradFixError(f"loss.aux_loss='bias': {type(model).__name__} has no router correction bias "
                           f"({_BIAS}, as DeepSeek-V3's routers have); use loss.aux_loss: micro or global")
    moe = state_of(trainer).moe

    def count(module, args, output):
        if not moe.counting:
            return
        # the router's one integer output is its top-k expert indices (transformers 5: last of (logits, weights,
        # indices); 4.57: first of (indices, weights))
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        chosen = [t for t in outputs if torch.is_tensor(t) and t.dtype in (torch.int64, torch.int32)]
        if len(chosen) != 1:
            raise GradFixError(f"loss.aux_loss='bias': the router {type(module).__name__} does not return its top-k "
                               "expert indices (one integer tensor); use loss.aux_loss: micro or global")
        chosen = chosen[0]
        experts = getattr(module, _BIAS).numel()
        chosen = chosen.reshape(chosen.shape[0], -1)
        weight = torch.ones(chosen.shape[0], dtype=torch.float64, device=chosen.device)
        mask = moe.row_mask
        if mask is not None and mask.numel() == chosen.shape[0]:
            weight = mask.reshape(-1).to(device=chosen.device, dtype=torch.float64)
        c = torch.zeros(experts, dtype=torch.float64, device=chosen.device)
        c.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(chosen.shape[1]))
        moe.bias_counts[module] = moe.bias_counts.get(module, 0) + c.cpu()

    def keep_mask(module, args, kwargs):
        if moe.counting:
            mask = kwargs.get("attention_mask")
            moe.row_mask = mask if torch.is_tensor(mask) and mask.dim() == 2 else None

    moe.hook = [model.register_forward_pre_hook(keep_mask, with_kwargs=True)]
    moe.hook += [r.register_forward_hook(count) for r in routers]
    return routers


def _apply_bias_update(trainer: Trainer, state: GradFixState, moe: MoEState) -> None:
    routers = moe.bias_routers
    sizes = [getattr(r, _BIAS).numel() for r in routers]
    local = torch.cat([moe.bias_counts.get(r, torch.zeros(n, dtype=torch.float64)) for r, n in zip(routers, sizes)])
    total = _reduce(trainer, local).cpu()  # every rank, once per window
    moe.bias_counts, moe.bias_seen = {}, 0
    rate = float(state.config.loss.aux_bias_rate)
    offset = 0
    with torch.no_grad():
        for router, n in zip(routers, sizes):
            load = total[offset: offset + n]
            offset += n
            if load.sum() <= 0:
                continue
            bias = getattr(router, _BIAS)
            bias.add_((rate * torch.sign(load.mean() - load)).to(device=bias.device, dtype=bias.dtype))
    moe.bias_windows += 1
    moe.last_bias_counts = total
    if len(set(sizes)) == 1:  # router health reads the selections the bias update already summed over the ranks
        window = total.reshape(len(sizes), sizes[0])
        moe.bias_interval = window if moe.bias_interval is None else moe.bias_interval + window


def _real_batches(window) -> list:
    return [b for b in window.batches if not isinstance(b, _IdleMicroBatch)]


def _prepass(trainer: Trainer, state: GradFixState, moe: MoEState, window) -> None:
    model = trainer.model
    counts, rows = None, 0.0
    with torch.no_grad(), _same_randomness(trainer.args.device):
        for batch in _real_batches(window):
            inputs = trainer._prepare_inputs(batch)
            kw = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
            out = model(**kw, output_router_logits=True, use_cache=False)
            logits = _router_logits(out)
            if logits is None or moe.top_k is None:
                counts = None
                break
            s = routing_stats(logits, moe.top_k, kw.get("attention_mask"))
            c = s.counts.sum(0)
            counts = c if counts is None else counts + c
            rows += s.rows
            moe.prepass_forwards += 1
    # every rank joins both reductions, also one whose model returned no router logits (then all of them fall back)
    agreed = _agree(trainer, [float(counts.numel()) if counts is not None else 0.0])
    if agreed is None or agreed[0] == 0:
        _fall_back(moe, "the routing pre-pass got no router logits (output_router_logits) or no top-k "
                        "(config.num_experts_per_tok) from the model on some rank")
        return
    experts = int(agreed[0])
    local = torch.zeros(experts + 1, dtype=torch.float64)
    local[:experts] = counts.cpu()
    local[experts] = rows
    total = _reduce(trainer, local)
    moe.window_counts, moe.window_rows = total[:experts], float(total[experts])


def _previous_window(trainer: Trainer, moe: MoEState, window) -> None:
    """The previous window's frequencies (all ranks) and this window's rows, in one all-reduce."""
    layers = moe.window_local_counts.shape[0] if moe.window_local_counts is not None else 0
    rows_now = 0.0
    for batch in _real_batches(window):
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        tokens = float(mask.sum()) if torch.is_tensor(mask) else float(ids.numel()) if torch.is_tensor(ids) else 0.0
        rows_now += tokens * layers
    prev = moe.window_local_counts.sum(0) if moe.window_local_counts is not None else None
    agreed = _agree(trainer, [float(prev.numel()) if prev is not None else 0.0])
    moe.window_local_counts, moe.window_local_rows, local_rows = None, 0.0, moe.window_local_rows
    if agreed is None or agreed[0] == 0:  # the first window (nothing counted before it): micro
        moe.prev_freq, moe.window_rows = None, 0.0
        return
    experts = int(agreed[0])
    local = torch.zeros(experts + 2, dtype=torch.float64)
    local[:experts] = prev.cpu()
    local[experts] = local_rows
    local[experts + 1] = rows_now
    total = _reduce(trainer, local)
    moe.prev_freq = total[:experts] / total[experts]
    moe.window_rows = float(total[experts + 1])


def aux_share(trainer: Trainer, state: GradFixState, aux: torch.Tensor, outputs: Any, inputs: Mapping,
              micro_batches: int) -> torch.Tensor:
    """What one micro-batch adds for the router loss (already multiplied by its coefficient in ``aux``), so that the
    data-parallel gradient average gives the declared convention over the window."""
    conv = _convention(state)
    logits = _router_logits(outputs)
    moe = _moe(trainer, state)
    stats = None
    cp_plan = _cp_plan(state)
    row_mask = inputs.get("attention_mask") if cp_plan is None else _cp_row_mask(cp_plan, logits)
    if conv == "micro" and cp_plan is not None:
        share = _cp_micro_share(trainer, state, moe, cp_plan, aux, logits, row_mask, micro_batches)
        if share is not None:
            return share
    # micro and none need no routing counts (their share is the model's aux_loss): counted only for a router-health log
    # (a softmax + top-k per layer, and on a GPU a device sync, per micro-batch)
    counted = conv not in ("micro", "none") or _health_logged(trainer)
    if counted and logits is not None and moe.top_k is not None:
        try:  # router logits of a shape this does not read (never a crash: micro needs none of it)
            stats = routing_stats(logits, moe.top_k, row_mask)
        except Exception as exc:  # noqa: BLE001
            if conv in ("global", "previous"):
                _fall_back(moe, f"{type(trainer.model).__name__}'s router logits cannot be read as (rows, experts) "
                                f"({type(exc).__name__}: {str(exc)[:120]})")
        if stats is not None:
            _record(moe, stats)
            if conv in ("global", "previous") and not moe.checked and moe.fallback is None:
                _check_formula(trainer, state, moe, stats, aux)
    if conv == "none":
        return aux * 0.0
    if conv == "micro" or moe.fallback is not None or stats is None:
        if conv in ("global", "previous") and stats is None:
            _fall_back(moe, f"{type(trainer.model).__name__} returned no router_logits with its aux_loss")
        return mean_term_share(aux, micro_batches)
    experts = stats.prob_sum.numel()
    coef = state.aux_coef
    if conv == "global":
        if moe.window is not state.window or moe.window_counts is None:
            return mean_term_share(aux, micro_batches)  # outside a counted window (e.g. a user's own step)
        return coef * window_share(stats.prob_sum, moe.window_counts, moe.window_rows, experts) * _dp_world(trainer)
    # previous: this window's rows, the previous window's frequencies (first window: micro)
    if moe.prev_freq is None or moe.window_rows <= 0:
        return mean_term_share(aux, micro_batches)
    freq = moe.prev_freq.to(device=stats.prob_sum.device, dtype=stats.prob_sum.dtype)
    return coef * experts * (freq * stats.prob_sum).sum() / moe.window_rows * _dp_world(trainer)


def _health_logged(trainer: Trainer) -> bool:
    """Whether a :class:`RouterHealthCallback` reads this trainer's routing counts."""
    handler = getattr(trainer, "callback_handler", None)
    return any(isinstance(cb, RouterHealthCallback) for cb in getattr(handler, "callbacks", ()))


def _cp_plan(state: GradFixState):
    """The ND plan when the sequences are split over cp > 1 ranks, else None."""
    plan = getattr(state, "nd", None)
    if plan is None or getattr(plan, "cp_mesh", None) is None or plan.dims.cp <= 1:
        return None
    return plan


def _cp_row_mask(plan, logits):
    """This rank's real tokens under cp (the original padding and the pad cp added are 0), flat, or None where it
    does not match the router logits' rows (then the micro-batch cannot be counted over its shards)."""
    mask = getattr(plan, "cp_row_mask", None)
    if not torch.is_tensor(mask) or logits is None or any(t.dim() != 2 or t.shape[0] != mask.numel() for t in logits):
        return None
    return mask.reshape(-1)


def _cp_micro_share(trainer: Trainer, state: GradFixState, moe: MoEState, plan, aux: torch.Tensor, logits, row_mask,
                    micro_batches: int):
    """``micro`` under context parallelism: the load-balancing loss of the WHOLE micro-batch, not the mean of its
    shards' losses. Each cp rank holds a shard of every sequence and its model's ``aux_loss`` counts that shard alone
    (and the pads: under cp the model gets no attention mask). Rebuilt from the shard's router logits with the real
    tokens only: the counts ``C`` (summed over layers) and rows ``N`` are all-reduced over the cp group, so that
    ``LB = sum over the cp ranks of E * sum_e C_e * Q_e(rank) / N**2``; each rank returns
    ``coef * window_share(Q_rank, C, N, E) * cp / micro_batches``, and FSDP2's average over dp x cp ranks gives the
    mean over micro-batches and data ranks of each micro-batch's loss. One all-reduce per micro-batch (experts + 2
    numbers). None: the old per-shard mean (the model's aux term is not the Switch loss of its logits, one warning)."""
    if moe.cp_fallback:
        return None
    if logits is None or moe.top_k is None or row_mask is None or not state.aux_coef:
        why = ("returned no router_logits with its aux_loss" if logits is None else
               "has no config.num_experts_per_tok" if moe.top_k is None else
               "returned router logits that are not one (tokens, experts) row per token of the shard")
        _cp_fall_back(moe, f"{type(trainer.model).__name__} {why}")
        return None
    import torch.distributed as dist

    stats = routing_stats(logits, moe.top_k, row_mask)
    experts = stats.prob_sum.numel()
    bad = 0.0
    if not moe.cp_checked:  # the model's own aux_loss on the shard (no mask under cp) vs the Switch loss rebuilt
        own, rebuilt = _own_and_rebuilt(state, routing_stats([t.detach() for t in logits], moe.top_k, None), aux)
        bad = float(not _same_loss(own, rebuilt))
        moe.cp_checked = True
    local = torch.zeros(experts + 2, dtype=torch.float64, device=trainer.args.device)
    local[:experts] = stats.counts.sum(0).to(local.device)
    local[experts] = stats.rows
    local[experts + 1] = bad
    dist.all_reduce(local, group=plan.cp_mesh.get_group())  # every cp rank, every training micro-batch
    total = local.cpu()
    if total[experts + 1] > 0:  # on any cp rank: every rank of the group falls back together
        _cp_fall_back(moe, f"{type(trainer.model).__name__}'s aux_loss is not the Switch load-balancing loss of its "
                           f"router logits (softmax, top-{moe.top_k}) on some cp rank")
        return None
    _record(moe, stats)
    share = window_share(stats.prob_sum, total[:experts], float(total[experts]), experts)
    return state.aux_coef * share * plan.dims.cp / micro_batches


def _cp_fall_back(moe: MoEState, reason: str) -> None:
    if not moe.cp_fallback:
        moe.cp_fallback = True
        logger.warning("hf_gradfix: loss.aux_loss='micro' with parallel.cp > 1: %s; the router loss is the mean of "
                       "each cp shard's own aux_loss (padding counted), not the micro-batch's.", reason)


def _own_and_rebuilt(state: GradFixState, stats, aux: torch.Tensor) -> tuple[float, float]:
    """The model's own load-balancing loss (its aux term without the coefficient) and the Switch loss rebuilt from
    the routing statistics of its router logits."""
    rebuilt = float(window_share(stats.prob_sum.detach(), stats.counts.sum(0), stats.rows, stats.prob_sum.numel()))
    return float(aux.detach()) / state.aux_coef, rebuilt


def _same_loss(own: float, rebuilt: float) -> bool:
    return abs(rebuilt - own) <= _REL_TOL * max(abs(own), 1e-12) + 1e-9


def _check_formula(trainer: Trainer, state: GradFixState, moe: MoEState, stats, aux: torch.Tensor) -> None:
    """Measured once: the model's aux_loss equals the load-balancing loss rebuilt from its own router logits."""
    own, rebuilt = _own_and_rebuilt(state, stats, aux)
    if not _same_loss(own, rebuilt):
        _fall_back(moe, f"{type(trainer.model).__name__}'s aux_loss ({own:.6g}) is not the Switch load-balancing loss "
                        f"of its router logits ({rebuilt:.6g}: softmax, top-{moe.top_k}, padding masked)")
        return
    moe.checked = True


def _record(moe: MoEState, stats) -> None:
    c, q = stats.counts.detach().double().cpu(), stats.prob_sum.detach().double().cpu()
    if moe.local_counts is None or moe.local_counts.shape != c.shape:
        moe.local_counts, moe.local_prob_sum, moe.local_rows = c.clone(), q.clone(), 0.0
    else:
        moe.local_counts += c
        moe.local_prob_sum += q
    moe.local_rows += stats.rows
    if moe.window_local_counts is None or moe.window_local_counts.shape != c.shape:
        moe.window_local_counts, moe.window_local_rows = c.clone(), 0.0
    else:
        moe.window_local_counts += c
    moe.window_local_rows += stats.rows


def router_health(counts: torch.Tensor, prob_sum: torch.Tensor, rows: float) -> dict[str, float]:
    """Log values from (layers, experts) top-k counts, (experts,) probability sums and rows, all ranks:
    ``router/max_load`` (the largest max / mean expert load over layers), ``router/dead_experts`` (experts that got
    no token, summed over layers), per layer ``router/layer{l}/max_load`` and ``.../dead``, and ``router/lb_loss`` (the
    interval's load-balancing loss, frequencies over all of it).

    >>> router_health(torch.tensor([[3.0, 1.0, 0.0]]), torch.tensor([1.5, 1.0, 0.5]), 2.0)["router/dead_experts"]
    1.0
    """
    out: dict[str, float] = {}
    loads = []
    for layer, c in enumerate(counts):
        mean = float(c.mean())
        load = float(c.max()) / mean if mean > 0 else 0.0
        loads.append(load)
        out[f"router/layer{layer}/max_load"] = round(load, 4)
        out[f"router/layer{layer}/dead"] = float((c == 0).sum())
    experts = counts.shape[-1]
    out["router/max_load"] = round(max(loads), 4) if loads else 0.0
    out["router/dead_experts"] = float(sum(out[f"router/layer{i}/dead"] for i in range(len(loads))))
    if rows > 0:
        out["router/lb_loss"] = float(experts * (counts.sum(0).double() * prob_sum.double()).sum() / rows**2)
    return out


class RouterHealthCallback(TrainerCallback):
    """Router health in the Trainer's logs: per MoE layer the max / mean expert load, the experts that received no
    token, and the load-balancing loss, over every logging interval and every rank's tokens (padding never counted).

    Needs the plugin's loss fix on the trainer (``hf_gradfix.patch()`` or ``GradFixCallback``) and a model that returns
    router logits (``config.output_router_logits=True``); it reads the counts the loss fix takes from each training
    forward while the callback is on the trainer (no extra forward), and adds one all-reduce per log.

    >>> import transformers, hf_gradfix
    >>> from hf_gradfix.integration.moe import RouterHealthCallback
    >>> cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
    ...     output_router_logits=True)
    >>> cb = RouterHealthCallback()   # Trainer(..., callbacks=[GradFixCallback(), cb]); logs carry router/max_load
    """

    def __init__(self):
        self._trainer: Trainer | None = None
        self._methods = InstanceMethods()  # the trainer's log, wrapped for one train()

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = _find_trainer(self)
        if trainer is None:
            return
        if self._trainer is not None and self._trainer is not trainer:
            self._methods.remove_all()  # another trainer's run that ended by an exception
        self._trainer = trainer

        def wrap_log(original):
            def log(logs, *a, **kw):
                if self._methods.live(log) and isinstance(logs, dict) and "loss" in logs:
                    logs.update(self._values(trainer))
                return original(logs, *a, **kw)
            return log

        self._methods.wrap(trainer, "log", wrap_log)  # kept where a train() that raised left it installed

    def on_train_end(self, args, state, control, **kwargs):
        self._methods.remove_all()
        self._trainer = None

    @staticmethod
    def _values(trainer: Trainer) -> dict[str, float]:
        state = state_of(trainer)
        moe = getattr(state, "moe", None) if state is not None else None
        if moe is not None and moe.bias_routers is not None:
            # aux_loss: bias (same on every rank): the routers' own selections (bias included), already summed over
            # the ranks by the bias update; no probabilities, so no lb_loss
            if moe.bias_interval is None:
                return {}
            counts, moe.bias_interval = moe.bias_interval, None
            moe.health = router_health(counts, torch.zeros(counts.shape[-1], dtype=torch.float64), 0.0)
            return moe.health
        shape = list(moe.local_counts.shape) if moe is not None and moe.local_counts is not None else [0, 0]
        agreed = _agree(trainer, [float(shape[0]), float(shape[1])])  # every rank joins
        if agreed is None or agreed[0] == 0:
            if not getattr(trainer, "_hgf_router_health_warned", False):
                trainer._hgf_router_health_warned = True
                logger.warning("hf_gradfix: RouterHealthCallback found no router counts to log: it needs the plugin's "
                               "loss fix on this trainer and a model that returns a load-balancing aux_loss with its "
                               "router_logits (config.output_router_logits=True); routers that select with a bias "
                               "(DeepSeek-V3) are counted under loss.aux_loss: bias.")
            return {}
        layers, experts = int(agreed[0]), int(agreed[1])
        local = torch.zeros(layers * experts + experts + 1, dtype=torch.float64)
        if moe is not None and moe.local_counts is not None:
            local[: layers * experts] = moe.local_counts.reshape(-1)
            local[layers * experts: -1] = moe.local_prob_sum
            local[-1] = moe.local_rows
            moe.local_counts, moe.local_prob_sum, moe.local_rows = None, None, 0.0
        total = _reduce(trainer, local).cpu()
        counts = total[: layers * experts].reshape(layers, experts)
        values = router_health(counts, total[layers * experts: -1], float(total[-1]))
        if moe is not None:
            moe.health = values
        return values
