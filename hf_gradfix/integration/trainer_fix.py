"""Exact loss normalization inside ``transformers.Trainer`` (and subclasses such as TRL's ``SFTTrainer``).

How it is wired (why a class swap and not a callback): a ``TrainerCallback`` cannot change the loss,
and a subclass's ``super().compute_loss(...)`` must reach the fixed default body. So a fixed trainer
gets a generated class whose MRO is::

    [_GradFixTop, UserTrainer, ..., SFTTrainer, ..., _GradFixDefaultLoss, Trainer, ...]

- ``_GradFixTop`` (outermost) sees every micro-batch first: it counts the window's targets once per
  optimizer step (all micro-batches, all data-parallel ranks, with the loss's own count rule) and turns
  whatever the effective ``compute_loss`` returns into ``S_mb * W / N_global``.
- ``_GradFixDefaultLoss`` replaces the body of ``Trainer.compute_loss`` reached through ``super()``:
  it returns ``S_mb * W / N`` for every head (also heads that ignore ``num_items_in_batch``),
  ``compute_loss_func`` and label smoothing, and averages MoE aux losses over micro-batches and ranks.

Nothing here touches a transformers function: the class of one trainer instance is changed.
How each loss behaves is detected by probing it on the first batch (:mod:`hf_gradfix.loss.probe`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from ..config import GradFixConfig
from ..errors import GradFixError
from .probe_mode import probe_mode
from ..loss.counting import CountRule, count_targets
from ..loss.probe import LossBehaviour, NonFiniteProbeError, ProbeError, detect_count_rule, probe_honors_num_items
from .state import (  # noqa: F401  (re-exported: documented and imported from here by user code and tests)
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
from .reentry import passes_through_delegates, snapshot_methods
from .versions import transformers_major
from .windows import (
    _NOT_COUNTED,
    _all_reduce_sum,
    _as_stock,
    _begin_stock_window,
    _close_short_window,
    _disable,
    _draw_window,
    _end_stock_window,
    _IdleMicroBatch,
    _never_opened,
    _sequence_sharded,
    _watch_backward,
)

logger = logging.getLogger("hf_gradfix")

class _ProbeDeferred(GradFixError):
    """The probe batch's loss was not finite: undecided, probe again on a later window (the run goes on as stock)."""


def _has_labels(batch: Any) -> bool:
    """A batch the plugin can count: any Mapping (dict, ``BatchEncoding``, ...) with a ``labels`` tensor."""
    return isinstance(batch, Mapping) and torch.is_tensor(batch.get("labels"))


class _UnreadableBatch(GradFixError):
    """A training batch the plugin cannot count (not a Mapping): that trainer trains as stock, with one warning."""


def _check_readable(trainer: Trainer, batches: list) -> None:
    """Every batch must be a Mapping (the Trainer passes it on as ``model(**batch)``). Anything else, e.g. the list of
    prompts of TRL's GRPOTrainer, is a layout the plugin does not understand: it is never refused and never skipped
    (a skipped batch would silently drop its targets from the count); the trainer trains as stock."""
    for batch in batches:
        if not isinstance(batch, Mapping):
            raise _UnreadableBatch(
                f"hf_gradfix cannot read {type(trainer).__name__}'s training batches (a "
                f"{type(batch).__module__}.{type(batch).__qualname__}, not a Mapping with the targets under 'labels'), "
                "so it cannot count their targets: this trainer trains exactly as stock computes it."
            )


def _loss_of(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    return getattr(outputs, "loss", None)


def _aux_of(outputs: Any) -> torch.Tensor | None:
    aux = outputs.get("aux_loss") if isinstance(outputs, Mapping) else getattr(outputs, "aux_loss", None)
    return aux if torch.is_tensor(aux) else None


def _router_term(state: GradFixState, outputs: Any, like: torch.Tensor) -> torch.Tensor | None:
    """``coef * aux_loss``: the MoE router term of a model whose aux coefficient the probes found, else None."""
    aux = _aux_of(outputs) if state.aux_coef else None
    return state.aux_coef * aux.to(like.device) if aux is not None else None


def _zero_connected(loss: torch.Tensor | None, outputs: Any, model: torch.nn.Module) -> torch.Tensor:
    """A zero loss that still reaches every parameter the forward used, so DDP's hooks all fire.

    Used for a micro-batch without targets, whose mean loss is 0/0 = NaN (a NaN that ``* 0`` would keep).
    """
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if torch.is_tensor(logits) and logits.requires_grad:
        return logits.sum() * 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    if params:
        return torch.stack([p.sum() for p in params]).sum() * 0.0
    return torch.zeros((), device=loss.device if loss is not None else None)


def _split(result: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], result[1]
    return result, None


def _model_name(model: torch.nn.Module) -> str:
    base = getattr(model, "base_model", None)
    inner = getattr(base, "model", None)
    if inner is not None and type(model).__name__.startswith("Peft"):
        return f"{type(model).__name__}({type(inner).__name__})"
    return type(model).__name__


def _accepts_num_items(model: torch.nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return "num_items_in_batch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _is_num_items_type_error(err: TypeError) -> bool:
    return "num_items_in_batch" in str(err) or "unexpected keyword" in str(err)


# ----------------------------------------------------------------------------------------------------
# Probing (once per trainer, on its first batch with labels)
# ----------------------------------------------------------------------------------------------------


class _ContradictedSetting(GradFixError):
    """A setting the measurement contradicts (e.g. loss.count_rule): refused even under on_undetermined: warn, which
    is for losses the plugin cannot read, not for settings it can prove wrong."""


def _forced_rule(state: GradFixState) -> CountRule | None:
    rule = state.config.loss.count_rule
    return None if rule == "auto" else CountRule(rule)


def _probe_callable(loss_fn, batch, state: GradFixState, what: str) -> LossBehaviour:
    # Two probes, two different fixes: the count rule can be set in the config, the scaling cannot.
    try:
        try:
            honors, additive = probe_honors_num_items(loss_fn, batch)
        except TypeError as err:
            if not _is_num_items_type_error(err):
                raise
            honors, additive = False, 0.0  # forward without **kwargs: cannot take the count at all
    except NonFiniteProbeError as err:
        raise _ProbeDeferred(f"hf_gradfix could not probe how {what} normalizes its loss: {err}") from err
    except ProbeError as err:
        raise GradFixError(
            f"hf_gradfix could not tell how {what} scales its loss with num_items_in_batch: {err}. "
            "Fix: make it return (sum of per-target losses) / num_items_in_batch (or ignore num_items_in_batch and "
            "return a mean), or leave this loss to transformers with `loss: {on_undetermined: warn}`."
        ) from err
    rule = _forced_rule(state)
    planted = getattr(state, "planted_count_rule", None)  # hf-gradfix verify --inject count_unshifted, on purpose
    if planted is not None:
        return LossBehaviour(honors_num_items=honors, count_rule=planted, additive_term=additive,
                             reason=f"counts {planted.value} targets (planted by hf-gradfix verify --inject)")
    if rule is None:
        try:
            rule, why = detect_count_rule(loss_fn, batch, honors)
        except NonFiniteProbeError as err:
            raise _ProbeDeferred(f"hf_gradfix could not probe how {what} counts its targets: {err}") from err
        except ProbeError as err:
            raise GradFixError(
                f"hf_gradfix could not tell which targets {what} counts: {err}. "
                "Fix: set `loss.count_rule` (shifted | unshifted | elements) in the hf_gradfix config, "
                "or leave this loss to transformers with `loss: {on_undetermined: warn}`."
            ) from err
    else:
        why = "set by loss.count_rule in the configuration"
        try:  # a set rule the loss measurably contradicts would divide by the wrong count: refused, not obeyed
            measured, _ = detect_count_rule(loss_fn, batch, honors)
        except ProbeError:  # includes NonFiniteProbeError: the loss cannot tell, which is what the setting is for
            measured = None
        if measured is not None and measured != rule:
            raise _ContradictedSetting(
                f"hf_gradfix.loss.count_rule: {rule.value!r}, but {what} measurably sums {measured.value} targets: "
                f"the window would be divided by the wrong count. Fix: remove loss.count_rule (auto measures it) or "
                f"set count_rule: {measured.value}")
    reason = f"counts {rule.value} targets ({why})"
    return LossBehaviour(honors_num_items=honors, count_rule=rule, additive_term=additive, reason=reason)


def _first_class_defining(trainer: Trainer, name: str, after: type) -> type | None:
    mro = type(trainer).__mro__
    for klass in mro[mro.index(after) + 1 :]:
        if name in klass.__dict__:
            return klass
    return None


def _probe(trainer: Trainer, state: GradFixState, batch: Mapping, prepared: bool = False) -> None:
    model = trainer.model
    # the probes edit labels on copies: a plain dict of the same tensors (a batch compute_loss was given is prepared
    # already: a trainer's own _prepare_inputs may have side effects, e.g. generation)
    batch = dict(batch if prepared else trainer._prepare_inputs(batch))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    holder: dict[str, Any] = {}

    def model_loss(b, n):
        kwargs = dict(b)
        if n is not None:
            kwargs["num_items_in_batch"] = n
        if state.lean is not None:  # loss.head: lean: the first window's probes never materialize the logits
            from .lean_head import probe_forward

            out = probe_forward(state.lean, model, kwargs)
        else:
            out = model(**kwargs)
        holder.setdefault("aux", _aux_of(out))  # the first probe call: the batch whose additive term is measured
        loss = _loss_of(out)
        if loss is None:
            raise ProbeError(f"{_model_name(model)} returned no loss for a batch with labels")
        return loss

    state.in_probe = True
    # no dropout, no router jitter: the probes compare forwards exactly (quantized layers keep their mode, every
    # module's mode comes back as it was: hf_gradfix/probe_mode.py)
    modes = probe_mode(model)
    modes.__enter__()
    # TRL's trainers record per-forward metrics (entropy, token accuracy) in `_metrics[mode]` from compute_loss; the
    # probe's forwards must not be averaged into the next logged eval metrics
    saved_metrics = copy.deepcopy(trainer.__dict__["_metrics"]) if "_metrics" in trainer.__dict__ else None
    # The probes pass a count, and a compute_loss given a count may read what the training loop sets per window (TRL's
    # SFTTrainer reads current_gradient_accumulation_steps for its MoE aux term). A training window is probed inside
    # its first step, where the loop has set it; an eval before any training step is probed with the value the loop
    # will set, for the probe only.
    provisional_ga = "current_gradient_accumulation_steps" not in trainer.__dict__
    if provisional_ga:
        trainer.__dict__["current_gradient_accumulation_steps"] = max(1, int(trainer.args.gradient_accumulation_steps))
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            uses_model_loss = trainer.compute_loss_func is None and trainer.label_smoother is None
            if uses_model_loss or trainer.label_smoother is not None:
                if not _accepts_num_items(model):
                    honors_fn = lambda b, n: model_loss(b, None)  # noqa: E731 (cannot pass the count)
                    state.model = _probe_callable(honors_fn, batch, state, _model_name(model))
                else:
                    state.model = _probe_callable(model_loss, batch, state, _model_name(model))
                _resolve_aux(trainer, state, holder)
            if trainer.compute_loss_func is not None:

                def func_loss(b, n):
                    out = model(**{k: v for k, v in b.items() if k != "labels"})
                    return trainer.compute_loss_func(out, b["labels"], num_items_in_batch=n)

                state.func = _probe_callable(func_loss, batch, state, "compute_loss_func")
                state.default = state.func
            else:
                state.default = state.model
            owner = _first_class_defining(trainer, "compute_loss", _GradFixTop)
            state.chain_is_default = owner is _GradFixDefaultLoss
            if state.chain_is_default:
                # _GradFixDefaultLoss keeps the contract for every producer: it honours the count.
                state.chain = LossBehaviour(True, state.default.count_rule, 0.0, "hf_gradfix default compute_loss")
            else:
                chain = super(_GradFixTop, trainer).compute_loss

                def chain_loss(b, n):
                    # return_outputs=False: the outputs are not needed, and TRL deprecates asking for them
                    loss, _ = _split(chain(model, dict(b), return_outputs=False, num_items_in_batch=n))
                    return loss

                state.chain = _probe_callable(chain_loss, batch, state, f"{owner.__name__}.compute_loss")
    finally:
        modes.__exit__(None, None, None)
        state.in_probe = False
        if saved_metrics is not None:
            trainer.__dict__["_metrics"] = saved_metrics
        if provisional_ga:
            trainer.__dict__.pop("current_gradient_accumulation_steps", None)
    state.probed = True
    _describe_fixes(trainer, state, owner)


def _resolve_aux(trainer: Trainer, state: GradFixState, holder: dict) -> None:
    """Find the coefficient of a MoE router aux loss the model adds to its loss, if any; refuse a router-loss
    convention that has no router loss to act on."""
    _find_aux_coef(trainer, state, holder)
    conv = state.config.loss.aux_loss
    if conv in ("global", "previous", "none") and not state.aux_coef:
        # measured on the probe forward: no aux_loss with the loss, or one that adds nothing (coefficient 0)
        raise _ContradictedSetting(
            f"hf_gradfix.loss.aux_loss: invalid value {conv!r}; {_model_name(trainer.model)} adds no router "
            "load-balancing loss to its loss (measured on the first batch: no aux_loss, or router_aux_loss_coef 0; "
            "a MoE model adds one with config.output_router_logits=True), so the convention has nothing to act on: "
            "set output_router_logits=True (and router_aux_loss_coef > 0) on the model's config, or remove aux_loss")


def _find_aux_coef(trainer: Trainer, state: GradFixState, holder: dict) -> None:
    behaviour = state.model
    aux = holder.get("aux")
    config = getattr(trainer.model, "config", None)
    config_coef = getattr(config, "router_aux_loss_coef", None)
    if behaviour.honors_num_items:
        additive = behaviour.additive_term
        if abs(additive) <= 1e-9:
            state.aux_coef = 0.0
            return
        if aux is None or float(aux) == 0.0:
            raise GradFixError(
                f"{_model_name(trainer.model)} adds a term ({additive:.6g}) to its loss that does not scale with "
                "num_items_in_batch and is not exposed as `outputs.aux_loss`; hf_gradfix cannot normalize it. "
                "Fix: return the extra term as `aux_loss`, or set `loss: {enabled: false}`."
            )
        coef = additive / float(aux)
        if config_coef is not None and math.isclose(coef, float(config_coef), rel_tol=1e-3):
            coef = float(config_coef)  # the exact value, not a difference of two rounded losses
        state.aux_coef = coef
    elif aux is not None and float(aux) != 0.0:
        if config_coef is None:
            raise GradFixError(
                f"{_model_name(trainer.model)} returns an aux_loss but its config has no router_aux_loss_coef; "
                "hf_gradfix cannot separate it from the token loss. Fix: set `loss.aux_loss: as_is` or disable the fix."
            )
        state.aux_coef = float(config_coef)


# what stock transformers 5 already does for a loss that honours num_items_in_batch (the start line says "unchanged")
_STOCK_EXACT = "passing the exact global count"


def _describe_fixes(trainer: Trainer, state: GradFixState, owner: type | None) -> None:
    w = _dp_world(trainer)
    model_name = _model_name(trainer.model)
    fixes = state.fixes
    m = state.model
    if m is not None and trainer.compute_loss_func is None and trainer.label_smoother is None:
        if not m.honors_num_items:
            fixes.append(f"head ignores num_items_in_batch, {m.reason}: rescaling its mean loss by local/global target count")
        elif getattr(trainer, "model_accepts_loss_kwargs", True) is False:
            fixes.append(f"model honours num_items_in_batch although accepts_loss_kwargs=False, {m.reason}: passing the count")
        else:
            fixes.append(f"model honours num_items_in_batch, {m.reason}: {_STOCK_EXACT}")
    if state.func is not None:
        how = _STOCK_EXACT if state.func.honors_num_items else "rescaling its per-micro-batch mean"
        verb = "honours" if state.func.honors_num_items else "ignores"
        fixes.append(f"compute_loss_func {verb} num_items_in_batch, {state.func.reason}: {how}")
    if trainer.label_smoother is not None and m is not None:
        fixes.append(f"label smoothing with the model's own {m.count_rule.value} targets, normalized by the global count")
    if state.aux_coef:
        conv = state.config.loss.aux_loss
        fixes.append(
            f"MoE aux loss (coef {state.aux_coef:g}) "
            + {"micro": "averaged over micro-batches and ranks", "micro_batch_mean": "averaged over micro-batches and ranks",
               "global": "of the whole window (expert frequencies over every micro-batch and rank, routing pre-pass)",
               "previous": "with the previous window's expert frequencies (approximation)",
               "bias": "replaced by DeepSeek-V3's bias balancing", "none": "removed",
               "as_is": "added once per micro-batch (stock)"}[conv]
        )
    if state.config.loss.aux_loss == "bias":
        fixes.append(f"router correction biases moved by {state.config.loss.aux_bias_rate:g} * sign(mean - load) after "
                     "each window, loads over every micro-batch and rank (aux-loss-free balancing)")
    if not state.chain_is_default and owner is not None:
        c = state.chain
        if c.honors_num_items:
            fixes.append(f"{owner.__name__}.compute_loss honours num_items_in_batch, {c.reason}: {_STOCK_EXACT}")
        else:
            fixes.append(f"{owner.__name__}.compute_loss ignores num_items_in_batch, {c.reason}: rescaling its per-micro-batch mean")
    # only where this run evaluates: the start line of a train-only run lists what its training changed
    if state.config.loss.eval_token_mean and getattr(trainer, "eval_dataset", None) is not None:
        fixes.append("eval_loss = exact target mean over the eval set and all ranks")
    if state.packing_line:
        fixes.append(state.packing_line)
    if state.optimizer_line:
        fixes.append(state.optimizer_line)
    if state.config.log_fixes:
        from .diagnostics.start_line import log_on_own_line, split_changes, summary

        # transformers 5 passes the window's global count itself: a loss that honours it was already exact
        stock_exact = (_STOCK_EXACT,) if transformers_major() >= 5 else ()
        log_on_own_line(
            logger,
            "hf_gradfix (%s; settings from: %s) on %s with %s: loss = sum over the optimizer window / global target "
            "count (all micro-batches, %d data-parallel rank(s)). %s.",
            state.source,
            state.settings_from,
            type(trainer).__name__,
            model_name,
            w,
            summary(*split_changes(fixes, stock_exact)),
        )


def _set_flags(trainer: Trainer, state: GradFixState) -> None:
    """Settings the fix needs, enforced at the first window (subclass __init__s may reset them)."""
    args = trainer.args
    state.flags_set = True
    if not state.probed:  # before the first forward of this trainer, where torch.compile would compile silently
        from .diagnostics.first_run import compile_notice
        from .diagnostics.start_line import log_on_own_line

        notice = compile_notice(trainer)
        if notice is not None:
            log_on_own_line(logger, notice)
    # Launch modes the plugin cannot normalize: never refused (stock trains them), left exactly as stock, loudly.
    if getattr(args, "n_gpu", 1) > 1:
        _disable(trainer, state, (
            f"hf_gradfix: torch.nn.DataParallel over {args.n_gpu} GPUs in one process hides its replicas' token counts "
            f"from the loss, so {type(trainer).__name__} trains exactly as stock computes it. For an exact loss, launch "
            "one process per GPU (`hf-gradfix launch`, `accelerate launch` or `torchrun`)."
        ))
        return
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "sp_backend", None) == "deepspeed" and getattr(pc, "sp_enabled", False):
        _disable(trainer, state, (
            "hf_gradfix: DeepSpeed Ulysses sequence parallelism computes its own per-micro-batch token mean "
            f"(transformers' deepspeed_sp_compute_loss), which hf_gradfix does not normalize yet, so "
            f"{type(trainer).__name__} trains exactly as stock computes it. For an exact loss, use parallel.cp instead."
        ))
        return
    if not getattr(args, "average_tokens_across_devices", True) and trainer.accelerator.num_processes > 1:
        logger.warning(
            "hf_gradfix: average_tokens_across_devices=False weights ranks equally instead of by their token "
            "counts; turning it on so the loss is the exact global token mean."
        )
        with contextlib.suppress(Exception):
            args.average_tokens_across_devices = True
    if transformers_major() < 5:
        # transformers 4.57 divides by the accumulation steps unless this is True and a count is passed;
        # our compute_loss already returns window-normalized losses.
        state.saved_accepts_loss_kwargs = trainer.model_accepts_loss_kwargs
        trainer.model_accepts_loss_kwargs = True


def _prepare(
    trainer: Trainer, state: GradFixState, batches: list, prepared: Mapping | None = None, drawn: Any = None
) -> bool:
    """Probe on the first batch with labels (once per trainer): ``prepared``, a batch compute_loss was given (``drawn``
    is the same micro-batch as drawn), first, then the others of ``batches`` (as drawn). Returns False when every
    probe batch gave a NaN / inf loss: nothing could be decided, and the caller runs this window as stock and retries
    later."""
    if not state.flags_set:
        _set_flags(trainer, state)
    if state.probed or state.disabled_reason is not None:
        return True
    deferred = None
    try:
        _check_readable(trainer, batches)
        candidates = [(prepared, True)] if prepared is not None else []
        candidates += [(b, False) for b in batches if b is not prepared and (drawn is None or b is not drawn)]
        for batch, is_prepared in candidates:
            if not _has_labels(batch):
                continue
            try:
                _probe(trainer, state, batch, prepared=is_prepared)
                return True
            except _ProbeDeferred as err:
                deferred = str(err)  # NaN weights or a NaN sample: try the window's next batch
                state.default = None
    except _UnreadableBatch as err:
        _disable(trainer, state, str(err))  # never refused: a layout the plugin does not understand trains as stock
        return True
    except GradFixError as err:
        if state.config.loss.on_undetermined != "warn" or isinstance(err, _ContradictedSetting):
            raise
        _disable(trainer, state, f"{err} This trainer trains exactly as stock computes it (loss.on_undetermined: warn).")
        return True
    if deferred is None:
        return True
    if not state.deferred_logged:
        logger.warning(
            "%s. This window is left exactly as stock transformers computes it; the probe runs again on each "
            "following window until a loss is finite.", deferred
        )
        state.deferred_logged = True
    return False


def _check_packed(batches: list) -> None:
    from ..packing.collator import check_packed_batch

    for batch in batches:
        check_packed_batch(batch)


def _we_divide_by_ga(trainer: Trainer, num_items: Any) -> bool:
    """Batches without labels: divide by the accumulation steps exactly when stock transformers would.

    On 5.x our ``loss_is_scaled_for_ga`` property says True, so the Trainer never divides and we apply the
    stock rule (the class's or user's own ``loss_is_scaled_for_ga``, e.g. TRL's GRPO sets it). On 4.57 the
    Trainer divides by itself whenever no count is passed, which is the stock behaviour already.
    """
    if not hasattr(Trainer, "loss_is_scaled_for_ga"):
        return False
    scaled = _own_loss_is_scaled_for_ga(trainer)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    return not scaled


_GA_FLAG = "_gradfix_loss_is_scaled_for_ga"


def _own_loss_is_scaled_for_ga(trainer: Trainer) -> Any:
    """The trainer's own ``loss_is_scaled_for_ga``: set on the instance (after the class swap, through our setter;
    before it, e.g. by a subclass before ``super().__init__()``, as a plain instance attribute that our property
    would otherwise hide), else its class's value."""
    if _GA_FLAG in trainer.__dict__:
        return trainer.__dict__[_GA_FLAG]
    if "loss_is_scaled_for_ga" in trainer.__dict__:
        return trainer.__dict__["loss_is_scaled_for_ga"]
    return getattr(super(_GradFixTop, trainer), "loss_is_scaled_for_ga", None)


def _keep_instance_ga_flag(trainer: Trainer) -> None:
    """Before the class swap: a ``loss_is_scaled_for_ga`` the instance already holds moves where our property reads it."""
    if "loss_is_scaled_for_ga" in trainer.__dict__:
        trainer.__dict__[_GA_FLAG] = trainer.__dict__.pop("loss_is_scaled_for_ga")


def _outside_path_name(trainer: Trainer) -> str:
    if getattr(trainer.args, "predict_with_generate", False):
        return "predict_with_generate=True"
    return f"{type(trainer).__name__}.prediction_step"


# ----------------------------------------------------------------------------------------------------
# The two mixins
# ----------------------------------------------------------------------------------------------------


class _GradFixTop:
    """Outermost layer: window counting, normalization of whatever compute_loss returns, exact eval loss."""

    @property
    def loss_is_scaled_for_ga(self):
        # transformers 5.x: our compute_loss returns window-normalized losses, so training_step must not
        # divide by the accumulation steps. When the fix is off, the user's or the class's own value.
        state = state_of(self)
        if state is not None and state.config.loss.enabled and state.disabled_reason is None and not state.stock_window:
            return True
        return _own_loss_is_scaled_for_ga(self)

    @loss_is_scaled_for_ga.setter
    def loss_is_scaled_for_ga(self, value):
        self.__dict__["_gradfix_loss_is_scaled_for_ga"] = value

    def create_optimizer(self, *args, **kwargs):
        # GaLore / APOLLO from the optimizer section or optimizer_cls_and_kwargs, with the Trainer's own
        # lr, weight_decay (and no-decay names), betas and eps (transformers' galore handler drops them).
        state = state_of(self)
        if state is not None and self.optimizer is None:
            from .optim_trainer import begin_lowrank_training, build_low_rank_optimizer, describe, optimizer_requested

            requested = optimizer_requested(self, state.config.optimizer)
            if requested is not None:
                model = kwargs.get("model", args[0] if args else None)
                model = self.model if model is None else model
                self.optimizer = build_low_rank_optimizer(self, model, *requested)
                state.optimizer_line = describe(self.optimizer, self)
                begin_lowrank_training(self)
                return self.optimizer
        optimizer = super().create_optimizer(*args, **kwargs)
        if state is not None:  # optimizer_cls_and_kwargs / Trainer(optimizers=...) with a lowrank_grads optimizer
            from .optim_trainer import begin_lowrank_training

            begin_lowrank_training(self)
        return optimizer

    def train(self, *args, **kwargs):
        # A lowrank_grads optimizer's backward hooks live exactly as long as a train() call: on at its start (again
        # for a second train()), off at its end and on an exception, so the model never keeps hooks that clear
        # its gradients for an optimizer that no longer steps (a second, plain trainer trains every weight).
        from .optim_trainer import begin_lowrank_training, end_lowrank_training

        from .checkpoints.complete import resolve

        state = state_of(self)
        if args:  # resume_from_checkpoint=True: the newest COMPLETE checkpoint (a save a crash tore is skipped)
            args = (resolve(self, args[0]),) + tuple(args[1:])
        elif "resume_from_checkpoint" in kwargs:
            kwargs["resume_from_checkpoint"] = resolve(self, kwargs["resume_from_checkpoint"])
        if state is not None:
            begin_lowrank_training(self)
        try:
            result = super().train(*args, **kwargs)
            if state is not None:
                _never_opened(self, state)  # the last window too: a trainer whose steps never call compute_loss
            return result
        finally:
            end_lowrank_training(self)
            if state is not None:  # a training_step called after train() is the caller's own, never the last window's
                state.window = None

    def get_train_dataloader(self):
        state = state_of(self)
        if state is None or not state.config.packing.enabled:
            return super().get_train_dataloader()
        from .packing.trainer import packed_train_dataloader, prepare_model_for_packing

        state.packing_line = prepare_model_for_packing(self, state.config.packing)
        return packed_train_dataloader(self, state.config.packing)

    def _save_rng_state(self, output_dir, *args, **kwargs):
        # per process, into the checkpoint folder: a packed stream's position and buffer go with it
        super()._save_rng_state(output_dir, *args, **kwargs)
        state = state_of(self)
        if state is not None and state.config.packing.enabled:
            from .packing.trainer import save_stream_state

            save_stream_state(self, output_dir)
        if state is not None and getattr(state, "moe", None) is not None:
            from .moe import save_state

            save_state(self, state, output_dir)
        from .checkpoints.complete import finish

        # this process's files of the checkpoint are all written: its marker; every process's marker is on disk
        # before rank 0 lists the folder's files and goes on to trainer_state.json and rotate_checkpoints, so
        # rotation never deletes an older checkpoint while the new one can still be torn (complete_checkpoints.py)
        finish(self, output_dir)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        # the start file before anything is written (a torn folder is known as the plugin's); a full disk is reported
        # as such, naming the folder it tore (complete_checkpoints.py)
        from .checkpoints.complete import saving

        with saving(self, trial):
            return super()._save_checkpoint(model, trial, *args, **kwargs)

    def save_model(self, output_dir=None, _internal_call=False):
        state = state_of(self)
        if state is None or state.pp is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        # pipeline: every stage's weights gathered on rank 0, saved as one model (from_pretrained loads it)
        from .parallel.pipeline import full_state_dict

        merged = full_state_dict(self, state.pp)
        if self.args.should_save:
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=merged)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir):
        from .checkpoints.sharded import sharded

        writer = sharded(state_of(self))
        if writer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # pipeline / expert parallelism: every rank's weights and optimizer shards as one distributed checkpoint
        writer.save(self, output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from .checkpoints.sharded import refuse_foreign, sharded

        state = state_of(self)
        writer = sharded(state)
        if writer is None:
            nd = state.nd if state is not None else None
            this_run = f"{nd.dims.describe()}, no expert parallelism" if nd is not None else "without pp or ep"
            refuse_foreign(resume_from_checkpoint, this_run)  # a sharded run's checkpoint has no optimizer.pt
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        writer.load(self, resume_from_checkpoint, optimizer=False)

    def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
        from .checkpoints.sharded import sharded

        state = state_of(self)
        writer = sharded(state)
        if writer is not None:
            if checkpoint is None:
                return None
            writer.load(self, checkpoint, optimizer=True)
            path = os.path.join(checkpoint, "scheduler.pt")
            if os.path.isfile(path) and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
        # per process, on resume, before the dataloader is iterated: the packed stream continues from its state,
        # the previous window's router counts too (both saved with the RNG state, whatever writes the optimizer)
        if state is not None and state.config.packing.enabled:
            from .packing.trainer import load_stream_state

            load_stream_state(self, checkpoint)
        if state is not None and state.config.loss.aux_loss == "previous":
            from .moe import load_state

            load_state(self, state, checkpoint)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        state = state_of(self)
        if state is not None and state.pp is not None:
            return self._gradfix_pipeline_window(state, epoch_iterator, num_batches, device)
        if state is not None:
            _end_stock_window(self, state)  # a deferred probe is tried again on every window
            _never_opened(self, state)
        if state is not None and state.config.packing.enabled and not state.config.loss.enabled:
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            _check_packed(batches)
            return _close_short_window(self, batches, num_batches, device), count
        if state is None or not state.enabled:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches, count = self._gradfix_draw_window(epoch_iterator, num_batches, device)
        if state.nd is not None:  # first window: every tp rank got the same batches (a collective on all ranks)
            from .parallel.nd import check_window

            check_window(self, state.nd, batches)
        if state.config.packing.enabled:
            _check_packed(batches)
        sharded = _sequence_sharded(self)
        if not state.probed and not sharded:
            # The loss is probed inside the window's first step (the window's first compute_loss), where the training
            # loop and the trainer have set everything a compute_loss reads; the window is counted there. Until then
            # the Trainer holds stock's own count: what this window trains with if it ends up stock.
            if not batches:
                state.window = None
                return batches, None
            if count is _NOT_COUNTED:
                count = self._get_num_items_in_batch(batches, device)
            batches = _close_short_window(self, batches, num_batches, device)
            state.window = _Window(None, len(batches), batches, pending=True)
            return batches, count
        # Context / sequence parallelism: probed here, on the whole drawn sequences, before the step splits them (inside
        # the step, compute_loss sees a shard, and the probe's forwards would run in the step's context-parallel
        # region); the probe then gives the loop's per-window attributes their coming values (see _probe)
        decided = True if state.probed else _prepare(self, state, batches)
        window = _Window(None, len(batches), batches)
        counted = self._gradfix_count_window(state, window, decided=decided)
        if counted == "empty":
            return batches, None
        if counted in ("stock", "disabled"):
            return batches, self._get_num_items_in_batch(batches, device)
        batches = _close_short_window(self, batches, num_batches, device)
        window.batches = batches
        if counted == "no_labels":
            return batches, self._get_num_items_in_batch(batches, device)
        return batches, self._gradfix_count_tensor(window.global_count)

    def _gradfix_draw_window(self, epoch_iterator, num_batches, device) -> tuple[list, Any]:
        """(the window's micro-batches, the count stock passes or ``_NOT_COUNTED``): through a trainer subclass's own
        ``get_batch_samples`` when it has one, else drawn the way transformers draws them (without stock's count,
        which costs a collective and is used only if the window runs as stock)."""
        owner = _first_class_defining(self, "get_batch_samples", _GradFixTop)
        if owner is not None and owner not in (_GradFixDefaultLoss, Trainer):
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            return list(batches), count
        return _draw_window(epoch_iterator, num_batches), _NOT_COUNTED

    def _gradfix_count_tensor(self, count: float) -> torch.Tensor:
        # int64 like transformers' own count (a float64 count would turn the loss into float64)
        value = int(count) if float(count).is_integer() else float(count)
        return torch.tensor(value, device=self.args.device)

    def _gradfix_count_window(self, state, window: _Window, decided: bool) -> str:
        """Count the window's targets once over every rank (every rank joins, also with an empty window or a probe that
        failed, so nobody hangs) and set ``window.global_count``; becomes ``state.window``. Returns what the window
        is: "counted", "no_labels" (trains as stock), "stock" (a probe undecided on some rank: this window as stock),
        "disabled" (some rank cannot read its batches: the trainer trains as stock), "empty" (past the end of the
        data)."""
        batches = [b for b in window.batches if not isinstance(b, _IdleMicroBatch)]
        has_labels = any(_has_labels(b) for b in batches)
        local = 0.0
        if state.probed and has_labels and state.disabled_reason is None:
            local = float(sum(int(count_targets(b, state.chain.count_rule)) for b in batches))
        disabled = state.disabled_reason is not None or state.rewritten is not None
        total, ranks_with_labels, ranks_undecided, micro_batches, ranks_disabled = _all_reduce_sum(
            self,
            [local, 1.0 if has_labels else 0.0, 0.0 if decided else 1.0, float(len(batches)), 1.0 if disabled else 0.0],
        )
        window.pending = False
        window.micro_batches = len(batches)  # the real ones: what stock divides by where it divides
        state.window = None
        if ranks_disabled:
            if state.rewritten is not None:
                _disable(self, state, state.rewritten, log=False)  # logged when it was seen
            _disable(self, state, "hf_gradfix: another rank cannot read its training batches (its warning names them); "
                     f"{type(self).__name__} trains exactly as stock computes it on every rank.")
            return "disabled"
        if micro_batches == 0:  # past the end of the data (a stream's epoch ran out): nothing to count or train
            return "empty"
        if ranks_undecided:  # a NaN / inf probe on some rank: every rank runs this window as stock
            _begin_stock_window(self, state)
            return "stock"
        state.window = window
        if ranks_with_labels == 0:
            if not state.no_labels_logged:
                logger.warning(
                    "hf_gradfix: %s's batches carry no 'labels'; targets cannot be counted, so the loss is left "
                    "exactly as stock computes it. Put the targets under 'labels' for an exact token mean.",
                    type(self).__name__,
                )
                state.no_labels_logged = True
            return "no_labels"
        window.global_count = total / _replicated_divisor(self)
        return "counted"

    def _gradfix_open_window(self, state, inputs) -> None:
        """The window's first forward: probe the loss (once per trainer) on the batch compute_loss was given, then
        count the window."""
        window = state.window
        if state.rl is None and not state.probed and self._gradfix_detect_rl(state, inputs):
            if state.rl is None:  # recognized, but left to TRL (one warning said why)
                return
        if state.rl is not None:  # a TRL policy-gradient trainer: its window counted from the generation batch
            from .rl.policy_gradient import open_window

            open_window(self, state.rl, window.micro_batches, lambda values: _all_reduce_sum(self, values))
            window.pending = False
            return
        prepared = inputs if isinstance(inputs, Mapping) else None
        drawn = state.step.drawn if state.step is not None and prepared is not None else None
        decided = _prepare(self, state, window.batches, prepared=prepared, drawn=drawn)
        self._gradfix_count_window(state, window, decided)
        callbacks, window.on_counted = window.on_counted, []
        for callback in callbacks:
            callback()

    def _gradfix_pipeline_window(self, state, epoch_iterator, num_batches, device):
        """Pipeline parallelism: the window's micro-batches and their target count over the data-parallel ranks."""
        from .parallel.nd import check_window
        from .parallel.pipeline import count_window

        batches = _draw_window(epoch_iterator, num_batches)
        check_window(self, state.nd, batches)
        plan = state.pp
        plan.pending = []
        plan.window_size = len(batches)
        plan.tokens_counted = self.state.num_input_tokens_seen  # 4.57 adds each micro-batch's tokens inline
        plan.window_count = count_window(self, plan, batches) if batches else 0.0
        state.window = _Window(plan.window_count, len(batches)) if batches else None
        count = plan.window_count
        return batches, torch.tensor(int(count) if float(count).is_integer() else count, device=device)

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        state = state_of(self)
        if state is not None and state.pp is not None:
            from .parallel.pipeline import count_each_batch_once

            count_each_batch_once(self, state.pp, before)

    def _sync_replicated_trainable_parameters(self, model):
        # a pipelined model holds different weights on each stage: transformers' world-wide broadcast does not apply
        state = state_of(self)
        if state is not None and state.pp is not None:
            return None
        return super()._sync_replicated_trainable_parameters(model)

    def _clip_grad_norm(self, model):
        state = state_of(self)
        if state is not None and state.pp is not None:
            from .parallel.pipeline import clip_grad_norm

            return clip_grad_norm(self, state.pp, self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        state = state_of(self)
        if grad_norm is None and state is not None and state.pp is not None:
            from .parallel.pipeline import clip_grad_norm

            grad_norm = clip_grad_norm(self, state.pp, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def training_step(self, model, inputs, *args, **kwargs):
        state = state_of(self)
        if state is not None and state.pp is not None:
            # the whole window runs as one schedule step, on its last micro-batch
            from .parallel.pipeline import run_window

            plan = state.pp
            if transformers_major() < 5:  # 4.57 added this micro-batch's tokens inline, just before this call
                from .parallel.pipeline import count_each_batch_once

                count_each_batch_once(self, plan, plan.tokens_counted)
            plan.pending.append(self._prepare_inputs(inputs))
            if len(plan.pending) < plan.window_size:
                return torch.zeros((), device=self.args.device)
            batches, plan.pending = plan.pending, []
            return run_window(self, plan, batches)
        if isinstance(inputs, _IdleMicroBatch):  # the front of a window the data ended inside: nothing to train
            return torch.zeros((), device=self.args.device)
        if state is None or not state.enabled:
            return super().training_step(model, inputs, *args, **kwargs)
        num_items = kwargs.get("num_items_in_batch", args[0] if args else None)
        window = state.window
        # A micro-batch of the window the loop drew, or a call of the caller's own (a hand-written loop, a fresh
        # trainer, after train()): then the caller's count is the window's, as in stock transformers.
        explicit = window is None or not window.holds(inputs)
        targets = {k: v.clone() for k, v in inputs.items() if k in ("labels", "shift_labels") and torch.is_tensor(v)} \
            if isinstance(inputs, Mapping) else {}
        step = _Step(explicit=explicit, count=num_items if explicit else None, drawn=inputs, drawn_targets=targets)
        stock_step = explicit and (num_items is None or not _has_labels(inputs))
        if stock_step and num_items is None and not state.explicit_logged:
            logger.info(
                "hf_gradfix: %s.training_step was called outside train() without num_items_in_batch: the loss is the "
                "micro-batch's own, exactly as stock computes it. Pass num_items_in_batch (the window's target count "
                "over all ranks) for an exact step.", type(self).__name__,
            )
            state.explicit_logged = True
        state.step = step
        try:
            with _as_stock(self, state) if stock_step else contextlib.nullcontext(), _watch_backward(self, state, step):
                result = super().training_step(model, inputs, *args, **kwargs)
        finally:
            state.step = None
        if step.rescaled_by is not None and torch.is_tensor(result):
            result = result * step.rescaled_by  # the logged loss: the division undone there too
        return result

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        state = state_of(self)
        chain = super().compute_loss
        if state is None or not state.enabled:
            return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        step, window = state.step, state.window
        window_step = step is not None and not step.explicit and window is not None
        if window_step and window.pending and model.training:
            self._gradfix_open_window(state, inputs)
            window = state.window
        else:
            _prepare(self, state, [inputs], prepared=inputs if isinstance(inputs, Mapping) else None)
        if not state.enabled:  # a layout or loss the plugin cannot read, or a window run as stock: exactly stock
            return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        if state.rl is not None:  # TRL's policy-gradient losses: each term by its objective over the window
            if not (window_step and model.training and state.rl.counted):
                return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
            from .rl.policy_gradient import window_loss

            loss = window_loss(self, state.rl, inputs, lambda: chain(
                model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch, **kwargs))
            step.returned = float(loss.detach().float())
            return (loss, None) if return_outputs else loss
        if window_step and model.training and self._gradfix_batch_rewritten(state, step, inputs):
            _begin_stock_window(self, state)  # the rest of this window as stock; every rank leaves at the next window
            return chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        # The count this loss is normalized by: the window's (all micro-batches, all ranks), an explicit step's
        # caller's, or a direct call's own argument; None: the micro-batch mean (eval, or no count anywhere).
        count = None
        if model.training:
            if window_step:
                count = window.global_count
            elif step is not None:
                count = step.count
            else:
                count = num_items_in_batch
        if not state.probed or (window_step and count is None):  # no labels to count: as stock
            result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
            if model.training and window_step and _we_divide_by_ga(self, num_items_in_batch):
                loss, outputs = _split(result)
                loss = loss / window.micro_batches
                return (loss, outputs) if return_outputs else loss
            return result
        if count is not None:
            loss, outputs = self._gradfix_train_loss(state, model, inputs, count, return_outputs, kwargs)
            if step is not None and torch.is_tensor(loss):
                step.returned = float(loss.detach().float().sum())
        else:
            loss, outputs = self._gradfix_eval_loss(state, model, inputs, return_outputs, kwargs)
        return (loss, outputs) if return_outputs else loss

    def _gradfix_batch_rewritten(self, state, step, inputs) -> bool:
        """Whether compute_loss was given other targets than the micro-batch the loop drew (TRL's GKD / GOLD train on
        on-policy generations in its place, a training_step may relabel): the window's count is then not the count
        of what it trains on. Measured per step by the loss's own count rule."""
        if not state.probed or state.chain is None or _sequence_sharded(self):
            return False
        if not isinstance(step.drawn, Mapping) or not isinstance(inputs, Mapping):
            return False
        rule = state.chain.count_rule
        drawn = step.drawn_targets
        counted = int(count_targets(drawn, rule)) if _has_labels(drawn) else 0
        seen = int(count_targets(inputs, rule)) if _has_labels(inputs) else 0
        if counted == seen:
            return False
        if state.rewritten is None:
            state.rewritten = (
                f"hf_gradfix: {type(self).__name__} trains on other targets than the micro-batches the data loader "
                f"drew (measured: {counted} counted in the drawn micro-batch, {seen} in what compute_loss was given; "
                "e.g. on-policy generation), so a count of the drawn window does not normalize its loss: it trains "
                "exactly as stock computes it."
            )
            logger.warning("%s", state.rewritten)
        return True

    def _gradfix_detect_rl(self, state, inputs) -> bool:
        """Whether this is a TRL policy-gradient trainer (GRPO, RLOO and their subclasses, decided by what compute_loss
        is given): then it is made exact by :mod:`.rl`, or left to TRL with one warning."""
        from .rl.policy_gradient import check_aux_convention, detect

        found = detect(self, inputs, _own_loss_is_scaled_for_ga(self))
        if found is None:
            return False
        if isinstance(found, str):
            _disable(self, state, found)
            return True
        check_aux_convention(self, state.config.loss.aux_loss)
        found.data_ranks = _dp_world(self)
        state.rl = found
        state.fixes.append(found.line)
        if state.config.log_fixes:
            logger.info("hf_gradfix (%s; settings from: %s) on %s with %s: %s.", state.source, state.settings_from,
                        type(self).__name__, _model_name(self.model), found.line)
        return True

    def _gradfix_train_loss(self, state, model, inputs, count, return_outputs, kwargs):
        """``S_mb * W / N`` for the target count ``count`` (N: the window's targets over every data rank)."""
        chain = super().compute_loss
        global_count = float(count.sum()) if torch.is_tensor(count) else float(count)
        n = count if torch.is_tensor(count) else self._gradfix_count_tensor(global_count)
        state.last_aux = 0.0
        local = int(count_targets(inputs, state.chain.count_rule))  # before: user code may pop "labels"
        own_aux = bool(state.aux_coef) and not state.chain_is_default and model.training
        if own_aux:  # the trainer's compute_loss adds the router loss itself (TRL): the convention is corrected after
            from .moe import before_chain

            before_chain(self, state)
        counting = contextlib.nullcontext()
        if state.config.loss.aux_loss == "bias" and model.training:  # aux-free balancing: count this forward's routing
            from .moe import bias_counting

            window = state.window
            in_window = window.micro_batches if window is not None and window.micro_batches else None
            counting = bias_counting(self, state, in_window or max(1, getattr(self, "current_gradient_accumulation_steps", 1)))
        # outputs only when the caller asked: TRL deprecates return_outputs=True (an extra forward there)
        with counting:
            result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=n, **kwargs)
        loss, outputs = _split(result)
        if own_aux and loss is not None and global_count != 0:
            from .moe import chain_correction

            correction = chain_correction(self, state, max(1, getattr(self, "current_gradient_accumulation_steps", 1)))
            if correction is not None:
                loss = loss + correction.to(loss.device)
        if global_count == 0:
            return _zero_connected(loss, outputs, model), outputs
        if state.chain.honors_num_items:
            return loss, outputs  # contract: S_mb * W / N (+ the aux share)
        if local == 0:
            return _zero_connected(loss, outputs, model), outputs
        return loss * (local * _dp_world(self) / global_count), outputs

    def _gradfix_eval_loss(self, state, model, inputs, return_outputs, kwargs):
        chain = super().compute_loss
        state.last_aux = 0.0
        untouched = dict(inputs)  # user code may pop "labels" from the mapping it is given
        local = int(count_targets(untouched, state.chain.count_rule))
        result = chain(model, inputs, return_outputs=return_outputs, num_items_in_batch=None, **kwargs)
        loss, outputs = _split(result)
        totals = state.eval_totals
        if totals is not None and loss is not None and not model.training:
            totals.batches += 1
            aux = state.last_aux
            mean = float(loss.detach().double().mean())
            real_rows = self._gradfix_real_eval_rows(untouched)
            if real_rows is not None:  # accelerate padded this last batch with repeated samples: drop them
                mean, local = self._gradfix_eval_subset(state, model, untouched, real_rows, kwargs)
            elif self._gradfix_eval_lockstep(untouched):
                # a sharded model's forward is a collective (FSDP all-gather, TP): run the extra forward that the
                # padded ranks run, and discard it, or they would wait for this rank forever
                self._gradfix_eval_subset(state, model, untouched, int(untouched["labels"].shape[0]), kwargs)
                state.last_aux = aux
            if local > 0:
                totals.loss_sum += (mean - aux) * local
                totals.targets += local
            totals.aux_sum += aux
            totals.aux_batches += 1
        return loss, outputs

    def _gradfix_pipeline_prediction(self, state, inputs, prediction_loss_only):
        """Pipeline parallelism: the eval batch forward-only through the schedule; the loss (a token mean) only."""
        from .parallel.pipeline import PipelineError, eval_batch

        if not prediction_loss_only:
            raise PipelineError(
                f"hf_gradfix parallel.pp={state.pp.dims.pp}: logits exist on the last stage only, so compute_metrics "
                "and prediction outputs are not available through the pipeline; use prediction_loss_only=True (or no "
                "compute_metrics), or pp: 1"
            )
        inputs = self._prepare_inputs(inputs)
        loss_sum, targets = eval_batch(self, state.pp, inputs, self._gradfix_real_eval_rows(inputs))
        totals = state.eval_totals
        if totals is not None:
            totals.batches += 1
            totals.loss_sum += loss_sum
            totals.targets += targets
        mean = loss_sum / targets if targets else 0.0
        return torch.tensor(mean, device=self.args.device), None, None

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        state = state_of(self)
        if state is not None and state.lean is not None:  # the lean head gives no logits: not where they are read
            state.lean.logits_needed = not prediction_loss_only
        if state is not None and state.pp is not None:
            return self._gradfix_pipeline_prediction(state, inputs, prediction_loss_only)
        totals = state.eval_totals if state is not None else None
        if totals is None or not _has_labels(inputs):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        counted_before = totals.batches
        untouched = dict(inputs)  # the step may edit the mapping (generation inputs)
        result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        loss = result[0] if isinstance(result, tuple) and result else None
        if totals.batches == counted_before and torch.is_tensor(loss):
            # the loss was computed without compute_loss (Seq2SeqTrainer with predict_with_generate: a plain
            # `model(**inputs).loss`): count it here, with the model's own count rule (any other such loss stays
            # stock's, with a warning)
            self._gradfix_count_eval_loss(state, model, untouched, loss, kwargs)
        return result

    def _gradfix_count_eval_loss(self, state, model, inputs, loss, kwargs) -> None:
        """Add one eval batch's mean loss, computed outside compute_loss, to the exact eval totals."""
        totals = state.eval_totals
        why = None
        if not getattr(self.args, "predict_with_generate", False):
            # a prediction_step of the user's own: what its loss is (a mean by which count?) is unknown
            why = "a prediction_step that computes the loss itself"
        elif self.compute_loss_func is not None:
            why = "the trainer has a compute_loss_func, which this path bypasses"
        elif not state.probed and state.enabled:
            _prepare(self, state, [inputs])
        behaviour = state.model
        if why is not None:
            pass
        elif not state.enabled or not state.probed or behaviour is None:
            why = "the model's loss could not be probed" if state.enabled else "the loss fix is off for this trainer"
        elif state.aux_coef:
            why = "the model adds a MoE aux loss, which this path does not separate"
        if why is not None:
            if not state.eval_outside_logged:
                logger.warning(
                    "hf_gradfix: %s computes its eval loss without compute_loss (%s: %s), so eval_loss stays "
                    "transformers' mean of per-batch means, not the exact target mean. Set "
                    "prediction_loss_only=True (or predict_with_generate=False) for an exact eval_loss.",
                    type(self).__name__, _outside_path_name(self), why,
                )
                state.eval_outside_logged = True
            totals.batches += 1
            totals.uncounted += 1
            return
        # label smoothing there: transformers' LabelSmoother with shift_labels=False counts every label != -100
        rule = CountRule.UNSHIFTED if self.label_smoother is not None else behaviour.count_rule
        mean = float(loss.detach().double().mean())
        local = int(count_targets(inputs, rule))
        real_rows = self._gradfix_real_eval_rows(inputs)
        if real_rows is not None:  # accelerate padded this last batch with repeated samples: drop them
            mean, local = self._gradfix_eval_subset(state, model, inputs, real_rows, kwargs)
        elif self._gradfix_eval_lockstep(inputs):
            self._gradfix_eval_subset(state, model, inputs, int(inputs["labels"].shape[0]), kwargs)
        if local > 0:
            totals.loss_sum += mean * local
            totals.targets += local
        totals.batches += 1

    def _gradfix_real_eval_rows(self, inputs) -> int | None:
        """Rows of this rank's last eval batch that are real samples, or None when all are.

        With ``even_batches`` accelerate completes the last global batch with samples from the start of
        the dataset; ``gather_for_metrics`` keeps the first ``remainder`` rows in rank order. We apply the
        same rule to this rank's rows (the sums and counts are all-reduced, not gathered).
        """
        gradient_state = self.accelerator.gradient_state
        if self.accelerator.num_processes <= 1 or not gradient_state.end_of_dataloader:
            return None
        remainder = gradient_state.remainder
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        if remainder is None or remainder <= 0 or not torch.is_tensor(labels):
            return None
        rows = int(labels.shape[0])
        real = self._gradfix_real_rows_by_data_rank(remainder, rows)[self._gradfix_data_index()]
        return None if real == rows else real

    def _gradfix_data_index(self) -> int:
        """This rank's index among the ranks accelerate shards data over (with a mesh: its data-parallel rank)."""
        dims = _nd_dims(self)
        return dims.data_rank(self.accelerator.process_index) if dims is not None else self.accelerator.process_index

    def _gradfix_real_rows_by_data_rank(self, remainder: int, rows: int) -> list[int]:
        dims = _nd_dims(self)
        ranks = dims.dp if dims is not None else self.accelerator.num_processes
        return [min(max(remainder - d * rows, 0), rows) for d in range(ranks)]

    def _gradfix_sharded_model(self) -> bool:
        """Whether the model's forward is a collective (FSDP / TP), so every rank must run the same forwards."""
        state = state_of(self)
        if state is not None and state.nd is not None and state.nd.route != "ddp":
            return True
        sharded = getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_distributed_loading_by_transformers", False)
        return bool(sharded)

    def _gradfix_eval_lockstep(self, inputs) -> bool:
        """A sharded model, in accelerate's padded last eval batch, on a rank that needs no subset forward while
        another rank does."""
        gradient_state = self.accelerator.gradient_state
        if self.accelerator.num_processes <= 1 or not gradient_state.end_of_dataloader or not self._gradfix_sharded_model():
            return False
        remainder = gradient_state.remainder
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        if remainder is None or remainder <= 0 or not torch.is_tensor(labels):
            return False
        rows = int(labels.shape[0])
        return any(real != rows for real in self._gradfix_real_rows_by_data_rank(remainder, rows))

    def _gradfix_eval_subset(self, state, model, inputs, real_rows, kwargs):
        """(mean loss, target count) over the first ``real_rows`` rows of an eval batch."""
        if real_rows == 0:
            if self._gradfix_sharded_model():  # the other ranks run a forward: join it on one row, discard it
                self._gradfix_eval_subset(state, model, inputs, 1, kwargs)
            return 0.0, 0
        rows = int(inputs["labels"].shape[0])
        subset = {k: (v[:real_rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == rows else v) for k, v in inputs.items()}
        local = int(count_targets(subset, state.chain.count_rule))
        state.last_aux = 0.0
        loss = super().compute_loss(model, subset, return_outputs=False, num_items_in_batch=None, **kwargs)
        loss, _ = _split(loss)
        return float(loss.detach().double().mean()), local

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        state = state_of(self)
        if state is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        stock_window, state.stock_window = state.stock_window, False  # a stock training window does not make eval stock
        try:
            return self._gradfix_evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        finally:
            state.stock_window = stock_window

    def _gradfix_evaluation_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
        state = state_of(self)
        if not state.enabled or not state.config.loss.eval_token_mean:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        state.eval_totals = _EvalTotals()
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        finally:
            totals, state.eval_totals = state.eval_totals, None
        loss_sum, targets, aux_sum, aux_batches, uncounted = _all_reduce_sum(
            self, [totals.loss_sum, totals.targets, totals.aux_sum, totals.aux_batches, totals.uncounted]
        )
        key = f"{metric_key_prefix}_loss"
        if targets > 0 and uncounted == 0 and output.metrics is not None and key in output.metrics:
            value = loss_sum / targets + (aux_sum / aux_batches if aux_batches else 0.0)
            output.metrics[key] = value
            dims = _nd_dims(self)  # tp and pp ranks evaluated the same rows: count them once (cp: different shards)
            once = targets / (dims.tp * dims.pp) if dims is not None else targets
            output.metrics[f"{metric_key_prefix}_loss_targets"] = once
        return output



# Pipeline-parallel overrides of Trainer methods that only transformers 5.x has (on 4.57 the pipeline glue routes
# clipping through this trainer's accelerator and corrects the token count in training_step). On 4.57 the
# mixin must not add them: code that tells the two Trainers apart by these methods (the noise-scale monitor reads the
# pre-clip norm through ``_get_grad_norm`` on 5.x and through ``accelerator.clip_grad_norm_`` on 4.57) would take
# the 5.x path, which the 4.57 Trainer never calls.
for _name in ("_clip_grad_norm", "_get_grad_norm", "_track_num_input_tokens", "_sync_replicated_trainable_parameters"):
    if not hasattr(Trainer, _name):
        delattr(_GradFixTop, _name)
del _name

#: the Trainer methods the generated class overrides: a delegate of one of them that calls back into the trainer
#: (``patch.object(MyTrainer, "training_step", wraps=trainer.training_step)``) continues the stock chain (reentry.py)
_TOP_OVERRIDES = tuple(n for n, v in vars(_GradFixTop).items() if callable(v) and hasattr(Trainer, n))
passes_through_delegates(_GradFixTop, _TOP_OVERRIDES)


class _GradFixDefaultLoss(Trainer):
    """The body of ``Trainer.compute_loss`` made exact for every loss producer.

    Contract (the one transformers' own compute_loss keeps for registered causal LMs): given
    ``num_items_in_batch = N`` (targets in the whole window on all data ranks) it returns
    ``S_mb * W / N`` (``W``: data-parallel replicas DDP averages over), plus the micro-batch's share of
    a mean-type aux loss; given ``None`` it returns the micro-batch mean, like transformers.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        state = state_of(self)
        if (
            state is None
            or state.default is None
            or state.disabled_reason is not None
            or state.stock_window
            or not state.config.loss.enabled
        ):
            if state is not None and state.in_probe and state.default is None:
                raise ProbeError("compute_loss was probed before the model")
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        n = num_items_in_batch
        inputs = dict(inputs)
        labels = None
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        model_behaviour = state.model
        call = inputs
        if (
            labels is None
            and n is not None
            and model_behaviour is not None
            and model_behaviour.honors_num_items
            and "labels" in inputs
        ):
            call = {**inputs, "num_items_in_batch": n}
        if state.aux_coef and model.training and n is not None:
            from .moe import before_forward

            before_forward(self, state)  # global / previous router loss: the window's routing counts
        if state.lean is not None:  # loss.head: lean (integration/lean_head.py), the probes' calls too
            from .lean_head import call_model

            outputs, smoothed_lean = call_model(self, state.lean, model, call, inputs, labels, n, model_behaviour,
                                                probe=state.in_probe)
        else:
            outputs, smoothed_lean = model(**call), False
        if getattr(self.args, "past_index", -1) >= 0:  # removed in transformers 5
            self._past = outputs[self.args.past_index]

        aux = 0.0
        if self.compute_loss_func is not None:
            behaviour = state.func
            if behaviour.honors_num_items:
                local = count_targets({"labels": labels}, behaviour.count_rule)
                base = self.compute_loss_func(outputs, labels, num_items_in_batch=n if n is not None else local)
                n_used = n
            else:
                base = self._gradfix_mean_to_window(
                    self.compute_loss_func(outputs, labels, num_items_in_batch=n), labels, behaviour, n, outputs, model
                )
                n_used = n
        elif labels is not None and smoothed_lean:
            # the smoothed sum over this micro-batch's targets / the window's count, plus the router term a MoE model
            # adds when it is given labels (taken out here, added back below by the declared convention)
            raw = _loss_of(outputs)
            aux_term = _router_term(state, outputs, raw)
            base = raw - aux_term if aux_term is not None else raw
            aux = aux_term if aux_term is not None else 0.0
            n_used = n
        elif labels is not None:
            rule = model_behaviour.count_rule if model_behaviour is not None else CountRule.UNSHIFTED
            mean = self.label_smoother(outputs, labels, shift_labels=rule is CountRule.SHIFTED)
            base = self._gradfix_mean_to_window(mean, labels, model_behaviour, n, outputs, model)
            # the label smoother reads the logits only: a MoE model's router loss, computed beside them, is added here
            # by the declared convention (stock's label-smoothing path drops it without a word)
            aux_term = _router_term(state, outputs, base)
            aux = aux_term if aux_term is not None else 0.0
            n_used = n
        else:
            raw = _loss_of(outputs)
            if raw is None:
                keys = ",".join(outputs.keys()) if isinstance(outputs, Mapping) else type(outputs).__name__
                raise ValueError(
                    f"The model did not return a loss from the inputs, only the following keys: {keys}. "
                    f"For reference, the inputs it received are {','.join(inputs.keys())}."
                )
            aux_term = _router_term(state, outputs, raw)
            main = raw - aux_term if aux_term is not None else raw
            if model_behaviour.honors_num_items or n is None:
                base = main
            else:
                base = self._gradfix_mean_to_window(main, inputs["labels"], model_behaviour, n, outputs, model)
            n_used = n
            if aux_term is not None:
                aux = aux_term
        if n_used is None:
            loss = base + aux
            state.last_aux = float(aux.detach()) if torch.is_tensor(aux) else aux
        else:
            share = aux
            if torch.is_tensor(aux) and model.training and state.config.loss.aux_loss != "as_is":
                from .moe import aux_share

                share = aux_share(self, state, aux, outputs, inputs,
                                  max(1, getattr(self, "current_gradient_accumulation_steps", 1)))
            loss = base * _dp_world(self) + share
            state.last_aux = float(share.detach()) if torch.is_tensor(share) else share
        return (loss, outputs) if return_outputs else loss

    def _gradfix_mean_to_window(self, mean, labels, behaviour, n, outputs, model):
        """Micro-batch mean over its own targets -> sum / N (N: global count); unchanged when N is None."""
        if n is None:
            return mean
        local = int(count_targets({"labels": labels}, behaviour.count_rule))
        if local == 0:
            return _zero_connected(mean, outputs, model)
        return mean * (local / float(n))


# ----------------------------------------------------------------------------------------------------
# Installing on one trainer
# ----------------------------------------------------------------------------------------------------

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
        from ..config.schema import cp_balance_without_cp

        raise GradFixError("hf_gradfix.parallel.cp_balance: " + cp_balance_without_cp(
            f"this trainer's mesh has cp 1 ({nd.dims.describe() if nd is not None else 'no parallel mesh'})"))


def install(trainer: Trainer, config: GradFixConfig, source: str, settings_from: str = "defaults") -> GradFixState:
    """Make one trainer's loss exact (idempotent). Returns its state."""
    state = state_of(trainer)
    if state is not None:
        return state
    from .parallel.nd import setup as nd_setup
    from .optim_trainer import (
        begin_lowrank_training,
        check_optimizer_setup,
        lowrank_optimizer_of,
        optimizer_requested,
        route_clipping,
    )

    from .environment import check_launched_world

    check_launched_world(trainer)
    check_optimizer_setup(trainer, config.optimizer)
    state = GradFixState(config=config, source=source, settings_from=settings_from)
    # Pipeline parallelism (parallel.pp > 1): the model split into this rank's stages, data by data-parallel rank
    from .parallel.pipeline import setup as pipeline_setup

    state.pp = pipeline_setup(trainer, config)
    if state.pp is not None:
        from .parallel.nd import NDPlan

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
        from .internal_callbacks import add_internal_callback
        from .lean_head import LeanHead, LeanHeadUnusedCheck

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
