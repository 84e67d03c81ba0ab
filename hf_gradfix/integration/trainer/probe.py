"""Probing: how each loss behaves, measured once per trainer on its first batch with labels (does it honour
``num_items_in_batch``, which targets it counts, a MoE router term), the settings the fix needs at the first
window, and the start line that lists what it changed.

Apart from the class layers because the probe is a one-time measurement with its own failure modes (a NaN probe
is deferred, a loss that cannot be read leaves the trainer stock, a contradicted setting is refused); the layers
only ask :func:`_prepare` whether the window can be normalized.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from ...errors import GradFixError
from ...loss.counting import CountRule
from ...loss.probe import LossBehaviour, NonFiniteProbeError, ProbeError, detect_count_rule, probe_honors_num_items
from ...probe_mode import probe_mode
from ..state import GradFixState, _dp_world
from ..versions import transformers_major
from .default_loss import _GradFixDefaultLoss
from .layers import below_top, first_class_defining
from .reading import _accepts_num_items, _aux_of, _has_labels, _is_num_items_type_error, _loss_of, _model_name, _split
from .windows import _disable

logger = logging.getLogger("hf_gradfix")


class _ProbeDeferred(GradFixError):
    """The probe batch's loss was not finite: undecided, probe again on a later window (the run goes on as stock)."""


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
            from ..lean_head import probe_forward

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
            owner = first_class_defining(trainer, "compute_loss")
            state.chain_is_default = owner is _GradFixDefaultLoss
            if state.chain_is_default:
                # _GradFixDefaultLoss keeps the contract for every producer: it honours the count.
                state.chain = LossBehaviour(True, state.default.count_rule, 0.0, "hf_gradfix default compute_loss")
            else:
                chain = below_top(trainer, "compute_loss")

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
        from ..diagnostics.start_line import log_on_own_line, split_changes, summary

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
        from ..diagnostics.first_run import compile_notice
        from ..diagnostics.start_line import log_on_own_line

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
