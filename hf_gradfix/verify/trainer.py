""":func:`verify_trainer`: drives the user's ``transformers.Trainer`` through a few optimizer steps, records every
micro-batch, reported loss and accumulated gradient, then judges each step against the references
(:mod:`hf_gradfix.verify.reference`; a policy-gradient run against :mod:`hf_gradfix.verify.rl`) into a
:class:`~hf_gradfix.verify.report.VerifyReport`.  The overview is the package's docstring (:mod:`hf_gradfix.verify`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..loss.counting import CountRule
from ..errors import InvalidArgumentError, InvalidTypeError
from .report import StepResult, VerifyReport, _progress, _progress_session, verdict_of
from .reference import (_LOW, Precision, _base_model, _Context, _data_ranks, _detect_rule, _forward_keys, _gather, _group_of,
                        _is_encoder_decoder, _plain_forward, _position_limit, _rel, _scale_fit, _world,
                        loss_in_the_run_layout, references, run_precision, summed_like_a_trainer)


def _loss_scale(trainer: Any, optimizer: Any = None) -> float:
    """The factor a ``GradScaler`` (fp16 mixed precision) still holds in the gradients just before the optimizer
    step: its scale, or 1 when there is none or the gradients were unscaled already (for clipping)."""
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    if scaler is None or not callable(getattr(scaler, "get_scale", None)) or not scaler.is_enabled():
        return 1.0
    inner = optimizer if optimizer is not None else getattr(trainer, "optimizer", None)
    for _ in range(4):  # accelerate's AcceleratedOptimizer (and other wrappers) around the torch optimizer
        if getattr(inner, "optimizer", None) is None:
            break
        inner = inner.optimizer
    try:
        from torch.amp.grad_scaler import OptState

        stage = scaler._per_optimizer_states[id(inner)]["stage"] if id(inner) in scaler._per_optimizer_states else None
        if stage is OptState.UNSCALED:
            return 1.0
    except (ImportError, AttributeError, KeyError, TypeError):  # another scaler: take its scale
        pass
    return float(scaler.get_scale())


def _to_cpu(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in batch.items()}


@contextlib.contextmanager
def _no_dropout(model: nn.Module):
    """Dropout off (``nn.Dropout`` modules and float ``*dropout*`` attributes read by attention code), put back after."""
    saved: list[tuple[Any, str, Any]] = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p:
            saved.append((m, "p", m.p))
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if "dropout" in key.lower() and isinstance(value, float) and value > 0:
                saved.append((m, key, value))
                setattr(m, key, 0.0)
    for cfg in {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}.values():
        for key, value in list(vars(cfg).items()):
            if ("dropout" in key.lower() or key.endswith("_pdrop")) and isinstance(value, float) and value > 0:
                saved.append((cfg, key, value))
                setattr(cfg, key, 0.0)
    try:
        yield
    finally:
        for obj, key, value in reversed(saved):
            setattr(obj, key, value)


@contextlib.contextmanager
def _saved_rng():
    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


def _reporting_callbacks(trainer) -> list:
    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    except ImportError:  # pragma: no cover
        return []
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    # reporting integrations (files, services) and the console printers: the checked steps are not the user's run
    kinds = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type)) + (PrinterCallback, ProgressCallback)
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, kinds)]


@_progress_session
def verify_trainer(trainer: Any, steps: int = 2, *, tolerance: float = 1e-5, train_kwargs: dict | None = None,
                   run_train: Callable[[], Any] | None = None, reference_model: nn.Module | None = None) -> VerifyReport:
    """Run ``steps`` optimizer steps of ``trainer`` as configured and compare each step's gradient and reported
    loss with the one-process ground truth on the batches it actually drew, at the same parameters.

    Works with any ``transformers.Trainer`` (a subclass, TRL's ``SFTTrainer``, with or without hf_gradfix).
    Afterwards the model's parameters, the optimizer (if one was passed in), the trainer's state, its
    arguments and callbacks and the random-number generators are as before, so ``trainer.train()`` can follow.
    Under ``torchrun`` / ``hf-gradfix launch`` every rank calls it; the report is the same on every rank.
    A model no rank holds whole (ep / tp / cp / FSDP2 DTensor shards, pipeline stages, DeepSpeed ZeRO partitions, or
    one accelerate will shard when ``train()`` prepares it) is checked against an unsharded copy at its initial weights
    that verify builds (:mod:`hf_gradfix.verify.sharded`; a collective: every rank calls ``verify_trainer``);
    ``reference_model``: such a copy of your own instead (made before the trainer was built), for a model verify cannot
    rebuild from its config. A model accelerate prepared keeps the checked steps' updates in its engine / optimizer.
    Under mixed precision (``bf16=True``, bf16 parameters) the references compute as the run does and each step is
    judged within ``FLOOR_FACTOR`` times its rounding floor (``report.steps[i].tolerance``); the fp32 ground truth
    is reported beside it (``fp32_grad_rel_err``).

    >>> import contextlib, io, transformers, hf_gradfix
    >>> from hf_gradfix.verify import tiny_model, synthetic_samples, _PadCollator, _ListDataset
    >>> args = transformers.TrainingArguments("/tmp/hf_gradfix_doctest", per_device_train_batch_size=2,
    ...     gradient_accumulation_steps=2, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    >>> with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's notice on its first import, where installed
    ...     trainer = transformers.Trainer(model=tiny_model(), args=args, data_collator=_PadCollator(0),
    ...                                    train_dataset=_ListDataset(synthetic_samples(16, 128)))
    >>> report = hf_gradfix.verify_trainer(trainer, steps=1)
    >>> report.exact, report.steps[0].grad_rel_err < 1e-5
    (True, True)
    """
    import transformers

    if not isinstance(trainer, transformers.Trainer):
        raise InvalidTypeError(f"verify_trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    if steps < 1:
        raise InvalidArgumentError(f"verify_trainer: steps={steps} must be >= 1")
    model = trainer.model
    recorded: list[dict] = []
    returned: list[float] = []
    marks: list[int] = []
    grads: list[dict[str, torch.Tensor]] = []
    params_at: list[dict[str, torch.Tensor]] = []
    # policy-gradient runs (TRL's GRPO family, RLOO): what the loss function was given (generated completions,
    # advantages, old / reference log-probs), and per optimizer step how many of those had been recorded
    rl_recorded: list[dict] = []
    rl_marks: list[int] = []
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in trainable}
    initial_params = list(trainable)
    # a sharded run (ep / tp / cp / FSDP2 DTensors, pipeline stages, DeepSpeed ZeRO): the full tensors gathered over
    # the ranks, and the ground truth on an unsharded copy at the initial weights, built here (hf_gradfix.verify.sharded)
    from .sharded import RunShards, deepspeed_clipping_off

    shards = RunShards(trainer, model)
    if reference_model is None and shards.kind is not None:
        _progress(f"the model is held as {shards.words}: building an unsharded copy for the ground truth ...", phase=True)
        reference_model = shards.reference()
    ds_grads: list[dict[str, torch.Tensor]] = []  # DeepSpeed: read inside the engine's step (see _prepared)
    hooked_engines: list = []

    def _prepared(trainer) -> None:
        """At the first micro-batch accelerate has prepared the model: FSDP2 put DTensor parameters in place of the
        model's own (read from now on), and DeepSpeed's engine steps inside ``backward`` at the window's end, before
        ``on_pre_optimizer_step``: its step is hooked to read the gradient it steps with (put back afterwards)."""
        if shards.kind != "prepare":
            return
        trainable[:] = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        engine = getattr(trainer, "model_wrapped", None)
        if not getattr(trainer, "is_deepspeed_enabled", False) or not callable(
                getattr(engine, "is_gradient_accumulation_boundary", None)):
            return
        own_step = engine.step

        def step(*a, **kw):
            if engine.is_gradient_accumulation_boundary():
                ds_grads.append(RunShards.deepspeed_grads(trainable))
            return own_step(*a, **kw)

        engine.step = step
        hooked_engines.append(engine)

    lowrank_notes: list[str] = []

    class _Recorder(transformers.TrainerCallback):
        target = steps

        def on_train_begin(self, args, state, control, **kw):
            self.target = state.global_step + steps
            # A lowrank_grads optimizer keeps the projected weights' window gradient only as rank-r accumulators:
            # for the checked steps it takes full gradients (like clipping, the accumulation acts after the
            # gradient is formed); its train() puts the hooks back next time
            opt = kw.get("optimizer")
            for _ in range(4):
                if opt is None or hasattr(opt, "detach_lowrank_hooks"):
                    break
                opt = getattr(opt, "optimizer", None)
            if opt is not None and getattr(opt, "lowrank_hooks_attached", False):
                opt.detach_lowrank_hooks()
                lowrank_notes.append(
                    f"{type(opt).__name__}(lowrank_grads=True) took full gradients for the checked steps (its low-rank "
                    "accumulation acts after the gradient is formed; the next train() turns it back on)")

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if ds_grads:  # DeepSpeed stepped inside backward; its gradient was read just before (training_step)
                grads.append(ds_grads.pop())
            else:
                scale = _loss_scale(trainer, kw.get("optimizer"))  # fp16's GradScaler: the gradients are still scaled
                grads.append(shards.full(trainable, grad=True, scale=scale))
            marks.append(len(recorded))
            rl_marks.append(len(rl_recorded))

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= self.target:
                control.should_training_stop = True
            control.should_save = False
            control.should_evaluate = False
            return control

        def on_epoch_end(self, args, state, control, **kw):
            control.should_save = False
            control.should_evaluate = False
            return control

    previous_step = trainer.__dict__.get("training_step")  # an instance-level wrapper (e.g. loss.on_nonfinite's)
    inner_step = trainer.training_step  # bound: that wrapper, else the class's own

    def training_step(model_arg, inputs, *a, **kw):
        if not recorded:
            _prepared(trainer)
        if len(recorded) == (marks[-1] if marks else 0):  # first micro-batch of a window: the parameters it sees
            params_at.append(shards.full(trainable))
        # a policy-gradient trainer draws prompts (a list); its micro-batch is what its loss function is given
        recorded.append(_to_cpu(inputs) if isinstance(inputs, Mapping) else {})
        pop_declared(inputs)  # the documents the samples declared: for the ground truth, never for the model
        out = inner_step(model_arg, inputs, *a, **kw)
        returned.append(float(out.detach().float().mean()) if torch.is_tensor(out) else float(out))
        return out

    from .rl import ENTROPY_COEF_KEY, entropy_coefficient, is_policy_gradient_batch
    from .documents import declare_documents, pop_declared

    previous_loss = trainer.__dict__.get("compute_loss")
    inner_loss = trainer.compute_loss
    # the gradient norm the Trainer measures each step (what max_grad_norm clips with, logged as grad_norm; over
    # several ranks and meshes a reduction of its own), checked against the norm of the gradient it held
    norms: list[float | None] = []
    previous_norm = trainer.__dict__.get("_get_grad_norm")
    inner_norm = getattr(trainer, "_get_grad_norm", None)

    def get_grad_norm(*a, **kw):
        out = inner_norm(*a, **kw)
        norms.append(None if out is None else float(out))
        return out

    def compute_loss(model_arg, inputs, *a, **kw):
        if getattr(model_arg, "training", False) and is_policy_gradient_batch(inputs):
            rl_recorded.append({**_to_cpu(inputs), ENTROPY_COEF_KEY: entropy_coefficient(trainer)})
        return inner_loss(model_arg, inputs, *a, **kw)

    args = trainer.args
    saved_args = {k: getattr(args, k) for k in ("max_grad_norm", "output_dir", "logging_dir") if hasattr(args, k)}
    saved_trainer = {k: trainer.__dict__.get(k) for k in ("state", "control", "optimizer", "lr_scheduler")}
    # a policy-gradient trainer's own state: its micro-step, buffered generations, entropy controller, metrics
    saved_trainer.update({k: copy.deepcopy(trainer.__dict__[k]) if k == "_metrics" else trainer.__dict__[k]
                          for k in ("_step", "_buffered_inputs", "entropy_coef", "_last_world_entropy",
                                    "_entropy_window_stats", "_metrics") if k in trainer.__dict__})
    opt_state = copy.deepcopy(trainer.optimizer.state_dict()) if getattr(trainer, "optimizer", None) is not None else None
    reporting = _reporting_callbacks(trainer)
    saved_callbacks = list(trainer.callback_handler.callbacks)
    recorder = _Recorder()
    tmp = tempfile.mkdtemp(prefix="hf_gradfix_verify_")
    t0 = time.perf_counter()
    _progress(f"1/2 the run under test: {type(trainer).__name__}.train() for {steps} step(s), gradients recorded ...",
              phase=True)
    with _saved_rng(), _no_dropout(model), deepspeed_clipping_off(trainer):
        try:
            args.max_grad_norm = 0.0  # clipping acts after the gradient is formed
            args.output_dir = tmp
            if "logging_dir" in saved_args:
                args.logging_dir = tmp
            for cb in reporting:
                trainer.callback_handler.remove_callback(cb)
            trainer.add_callback(recorder)
            trainer.training_step = training_step
            trainer.compute_loss = compute_loss
            if callable(inner_norm):
                trainer._get_grad_norm = get_grad_norm
            with declare_documents(trainer):
                if run_train is not None:
                    run_train()
                else:
                    trainer.train(**(train_kwargs or {}))
        finally:
            if previous_step is None:
                trainer.__dict__.pop("training_step", None)
            else:
                trainer.training_step = previous_step
            if previous_loss is None:
                trainer.__dict__.pop("compute_loss", None)
            else:
                trainer.compute_loss = previous_loss
            if previous_norm is None:
                trainer.__dict__.pop("_get_grad_norm", None)
            else:
                trainer._get_grad_norm = previous_norm
            trainer.callback_handler.callbacks[:] = saved_callbacks  # the same objects, in the same order
            for engine in hooked_engines:
                engine.__dict__.pop("step", None)
            for k, v in saved_args.items():
                setattr(args, k, v)
            shutil.rmtree(tmp, ignore_errors=True)
        if reference_model is not None:  # the ground truth runs on the unsharded copy, in one process
            ref_params = dict(reference_model.named_parameters())
            # the names recorded on every rank (pipeline stages: their union; a tied copy appears once in the copy)
            names = list(grads[0]) if grads else [n for n, _ in trainable]
            aliases = {n for n, _ in reference_model.named_parameters(remove_duplicate=False)}
            unknown = [n for n in names if n not in aliases]
            if unknown:  # e.g. a wrapper's prefixes: never a comparison of what does not correspond
                raise InvalidArgumentError(
                    f"the run's parameters have no counterpart in the unsharded copy of the model ({len(unknown)} of "
                    f"{len(names)}, e.g. {unknown[0]!r}); pass verify_trainer(..., reference_model=) a copy whose "
                    "parameter names are the run's")
            model, trainable_ref = reference_model, [(n, ref_params[n]) for n in names if n in ref_params]
        else:
            trainable_ref = trainable
        _progress(f"2/2 the reference: each step's exact gradient recomputed in plain PyTorch on the batches the "
                  f"trainer drew (run under test took {time.perf_counter() - t0:.1f} s) ...", phase=True)
        t1 = time.perf_counter()
        with _no_dropout(model) if model is reference_model else contextlib.nullcontext():
            if rl_recorded:  # generated completions: the loss type's objective over the window (hf_gradfix.verify.rl)
                from .rl import compare as compare_policy_gradient

                report = compare_policy_gradient(trainer, model, rl_recorded, rl_marks, returned, marks, grads,
                                                 params_at, trainable_ref, tolerance)
            else:
                report = _compare(trainer, model, recorded, returned, marks, grads, params_at, trainable_ref, tolerance)
        report.notes.extend(lowrank_notes)
        _check_grad_norms(report, grads, norms, [n for n, _ in trainable_ref])
        holds_data = _data_ranks(trainer)
        report.data_ranks = sum(holds_data) if holds_data is not None else report.world_size
        _progress("done", since=t1)
        model = trainer.model
        if len(report.steps) < steps:
            report.notes.append(f"the trainer took {len(report.steps)} of the {steps} steps asked for (its data ran out)")
        with torch.no_grad():
            for n, p in initial_params:  # (a model accelerate prepared holds other, sharded parameters now: docs)
                if p.shape == initial[n].shape and not hasattr(p, "ds_id"):
                    p.copy_(initial[n])
                    p.grad = None
        for k, v in saved_trainer.items():
            setattr(trainer, k, v)
        if opt_state is not None and saved_trainer["optimizer"] is not None:
            saved_trainer["optimizer"].load_state_dict(opt_state)
    return report


def _check_grad_norms(report: VerifyReport, grads: list[dict[str, torch.Tensor]], norms: list[float | None],
                      names: Sequence[str]) -> None:
    """Per step, the gradient norm the Trainer measured on every rank (``_get_grad_norm``: what ``max_grad_norm`` clips
    with, even while verify keeps clipping off) against the norm of the full gradient it held (each parameter once): a
    reduction over ranks and meshes of its own (expert parallelism: two sequential all-reduces over efsdp and ep)."""
    every = _gather(list(norms))  # a collective: every rank gives its list, possibly empty
    for i, step in enumerate(report.steps):
        got = [r[i] for r in every if i < len(r) and r[i] is not None and math.isfinite(r[i])]
        if not got or i >= len(grads):
            continue
        exact = math.sqrt(sum(float(grads[i][n].double().pow(2).sum()) for n in names if n in grads[i]))
        step.grad_norm_rel_err = max(abs(v - exact) for v in got) / max(exact, 1e-30)
        if step.grad_norm_rel_err > (step.tolerance or report.tolerance):
            report.notes.append(f"step {step.step}: the gradient norm the Trainer measured (what max_grad_norm clips "
                                f"with) is {step.grad_norm_rel_err:.1e} off the norm of the gradient it held: clipping "
                                "would not be the exact gradient's")


def _fp32_context(ctx: _Context, precision: Precision, notes: list[str]) -> _Context | None:
    """The ground truth in fp32 beside the run's precision: the same model with autocast off, or, for low-precision
    parameters, an fp32 copy of the model (None, with a note, when it cannot be made)."""
    if precision.param_dtype not in _LOW:
        device = precision.autocast[0] if precision.autocast else next(ctx.model.parameters()).device.type
        return replace(ctx, amp=lambda: torch.autocast(device, enabled=False))
    try:
        model32 = copy.deepcopy(ctx.model).float()
    except (RuntimeError, MemoryError, TypeError) as err:  # out of memory, or a model that cannot be copied
        notes.append(f"the fp32 reference beside the run's precision was skipped: no fp32 copy of the model "
                     f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
        return None
    named = dict(model32.named_parameters())
    return replace(ctx, model=model32, params=[named[n] for n in ctx.names], amp=contextlib.nullcontext)


def _compare(trainer, model, recorded, returned, marks, grads, params_at, trainable, tolerance) -> VerifyReport:
    # read at each call, as the RL reference does: widening the factor on hf_gradfix.verify.report reaches both
    from .report import FLOOR_FACTOR

    names = [n for n, _ in trainable]
    params = [p for _, p in trainable]
    world = _world()
    ga = int(trainer.args.gradient_accumulation_steps)
    first = next((b for b in recorded if "labels" in b or "shift_labels" in b), None)
    if first is None:
        raise InvalidArgumentError("verify_trainer: the trainer's batches carry no 'labels': nothing to compare with")
    rule, how, head = _detect_rule(model, first, getattr(trainer, "compute_loss_func", None))
    enc_dec = _is_encoder_decoder(model)
    ctx = _Context(model=model, names=names, params=params, keys=_forward_keys(model), rule=rule, encoder_decoder=enc_dec,
                   config=getattr(_base_model(model), "config", None), position_limit=_position_limit(model),
                   smoothing=float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0))
    from .moe import router_spec

    ctx.router = router_spec(trainer, model)
    if _base_model(model) is not model and rule is CountRule.UNSHIFTED and not enc_dec:
        # PEFT prompt learning makes labels[..., 0] a target; whether the loss shifts is the base model's rule
        try:
            ctx.virtual_shift = _detect_rule(_base_model(model), first, None)[0] is CountRule.SHIFTED
        except Exception:  # noqa: BLE001 - the base model cannot be probed alone: no virtual-token shift
            ctx.virtual_shift = False
    notes: list[str] = []
    precision = run_precision(trainer, model)
    notes.extend(precision.notes)
    ctx.amp = precision.amp
    report = VerifyReport(exact=True, tolerance=tolerance, world_size=world, grad_accum=ga, packing=False,
                          trainer=type(trainer).__name__, head=head, count_rule=f"{rule.value} ({how})",
                          precision=precision.words(),
                          reference=f"{precision.words()}, as the run; fp32 beside it" if precision.mixed else precision.words())
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(_group_of(n), []).append(i)
    holds_data = _data_ranks(trainer)
    with _plain_forward(model):  # the precision of each reference is chosen here, not by accelerate's wrapper
        ctx32 = _fp32_context(ctx, precision, notes) if precision.mixed else None
        for step in range(len(grads)):
            lo = marks[step - 1] if step else 0
            window = _gather(recorded[lo:marks[step]])
            if holds_data is not None:  # one copy of each tp x cp group's batches
                window = [w for w, keep in zip(window, holds_data) if keep]
            logged_local = sum(returned[lo:marks[step]])
            logged = sum(_gather(logged_local)) / world
            with torch.no_grad():
                for n, p in trainable:
                    p.copy_(params_at[step][n].to(p.device, p.dtype))
                if ctx32 is not None and ctx32.model is not model:
                    for n, p in zip(ctx32.names, ctx32.params):
                        p.copy_(params_at[step][n].to(p.device, p.dtype))
            step_notes: list[str] = []
            refs, loss_exact, facts = references(ctx, window, grad_accum=ga, notes=step_notes)
            g = [grads[step][n] for n in names]
            step_tol, floor, fp32_errs = tolerance, None, (None, None)
            loss_tol, loss_floor = tolerance, None
            if precision.mixed:
                # The rounding floor: the ground truth against itself, summed as a trainer sums it, at the run's
                # precision (summed_like_a_trainer).  A correct run differs from the ground truth by rounding of the
                # same kind, so its error is judged against FLOOR_FACTOR x the floor (never below --tolerance).
                # The reported loss: against its own floor, the ground-truth loss in the run's layout (forward
                # rounding only: far below the gradient's); where that layout cannot be compared, the gradient's.
                summed, summed_loss = summed_like_a_trainer(ctx, window, offset=facts["offset"], N=max(facts["targets"], 1))
                rel_loss = lambda x: abs(x - loss_exact) / max(abs(loss_exact), 1e-30)  # noqa: E731
                floor = max(_rel(summed, refs["exact"]), rel_loss(summed_loss))
                step_tol = loss_tol = max(tolerance, FLOOR_FACTOR * floor)
                layout = loss_in_the_run_layout(ctx, window, offset=facts["offset"], N=max(facts["targets"], 1))
                if layout is not None:
                    loss_floor = max(rel_loss(layout), rel_loss(summed_loss))
                    loss_tol = max(tolerance, FLOOR_FACTOR * loss_floor)
                if ctx32 is not None:
                    refs32, loss32, _ = references(ctx32, window, grad_accum=ga, notes=[])
                    fp32_errs = (_rel(g, [x.cpu() for x in refs32["exact"]]),
                                 abs(logged - loss32) / max(abs(loss32), 1e-30))
                    # the bugs this precision cannot resolve: apart from the ground truth in fp32 (a real difference,
                    # not rounding), yet within the tolerance of the run's precision
                    for name, ref in refs32.items():
                        d = _rel(ref, refs32["exact"]) if name != "exact" else 0.0
                        if tolerance < d <= step_tol:
                            step_notes.append(
                                f"step {step + 1}: at {precision.words()} the gradient cannot tell the reference {name} "
                                f"from exact: they differ by {d:.1e} in fp32, within this precision's tolerance "
                                f"{step_tol:.1e} (the reported loss is judged on its own; run in fp32 to resolve the "
                                "gradient)")
                    del refs32
            _progress(f"   reference step {step + 1}/{len(grads)} computed")
            for note in step_notes:
                if note not in notes:
                    notes.append(note)
            report.packing = report.packing or facts["packed"]
            candidates = {name: _rel(g, [x.cpu() for x in ref]) for name, ref in refs.items()}
            c, scaled = _scale_fit(g, refs["exact"])
            if abs(c - 1.0) > step_tol:  # a factor indistinguishable from 1 is rounding, not a diagnosis
                candidates["scaled"] = _rel(g, [x.cpu() for x in scaled])
            loss_err = abs(logged - loss_exact) / max(abs(loss_exact), 1e-30)
            verdict = verdict_of(candidates, loss_err, step_tol, loss_tol)
            detail = ""
            if verdict == "reported_loss" and precision.mixed:
                # the gradient is within this precision's rounding of exact; a count bug too small for it to
                # resolve still shows in the loss, by its own factor
                for name, factor in facts.get("loss_factors", {}).items():
                    err = abs(logged - factor * loss_exact) / max(abs(factor * loss_exact), 1e-30)
                    if err <= loss_tol:
                        verdict = name
                        detail = (f"named by the reported loss, x{factor:.6g} the exact one to {err:.1e}; the gradient "
                                  f"is within {precision.words()}'s tolerance {step_tol:.1e} either way")
            if verdict == "scaled":
                detail = f"x{c:.6g}"
            elif verdict == "reported_loss":
                detail = f"reported {logged:.6g}, exact {loss_exact:.6g}, x{logged / loss_exact if loss_exact else math.nan:.4g}"
            elif verdict not in ("exact", "unexplained") and not detail:
                detail = f"reproduces the run to {candidates[verdict]:.1e}"
            report.steps.append(StepResult(
                step=step + 1, loss_exact=loss_exact, loss_logged=logged, loss_rel_err=loss_err,
                grad_rel_err=candidates["exact"], verdict=verdict, candidates=candidates, detail=detail,
                groups={k: _rel(g, [x.cpu() for x in refs["exact"]], idx) for k, idx in groups.items()},
                targets=facts["targets"], micro_batches=facts["micro_batches"], sequences=facts["sequences"],
                tolerance=step_tol, rounding_floor=floor, fp32_grad_rel_err=fp32_errs[0], fp32_loss_rel_err=fp32_errs[1],
                loss_floor=loss_floor, loss_tolerance=loss_tol,
            ))
            if verdict != "exact":
                report.exact = False
                if verdict not in report.broken:
                    report.broken.append(verdict)
    report.notes = notes
    if report.nothing_checked() is not None:  # never EXACT on nothing: the CLI exits 2 with the reason
        report.exact = False
    return report
