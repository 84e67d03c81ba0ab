"""``loss.head: lean``: the LM head and its cross-entropy computed together (``hf_gradfix.loss.lean_head``), so
a micro-batch's ``(tokens, vocab)`` logits never exist, normalized by the window's global count like every path.

Where it applies: the model call of the plugin's own ``compute_loss`` body (the Trainer's default loss; TRL's
SFTTrainer runs its own fused head), with labels, in training, in a loss-only evaluation and in the loss probes of
the first window. For the length of that one call, the output-embedding module's ``forward`` (an instance
attribute, removed afterwards) keeps its input and returns a zero-cost stand-in for the logits (a 0-stride
expanded zero), and the model's ``loss_function`` (its own setter) computes, from that input, the objective the
model's own ``loss_function`` computes: the cross-entropy against next-token targets (a causal LM), same-position
targets (a masked LM, a seq2seq decoder) or the call's ``shift_labels``, ``sum / num_items_in_batch`` or the mean.
That objective is measured, not assumed: the model's own ``loss_function`` is called once per model and call
signature on random float64 logits of a small vocabulary with the call's own arguments
(:func:`hf_gradfix.loss.lean_head.measure_objective`); a loss that is none of them (label smoothing inside it,
class weights, a z-loss, another reduction) keeps the stock head. So the loss probes, which run through the lean
head, measure what the model's own loss does. Nothing persists between calls: no third-party function is changed,
nothing to unpatch.

Decided by behaviour, per model: the call is lean only when the head ran exactly once, the loss function received
*that very* stand-in (identity: nothing transformed the logits between head and loss: soft-capping, scaling, an
upcast, a hook), the labels it received are the call's own and its objective is one of the above. Anything else (a
model that post-processes its logits, computes its loss inline, calls the head twice) is discovered on the first
call, which is then run again on the stock path; that model stays on the stock path for the rest of the run, with
one line saying why. Heads: a plain ``nn.Linear`` (tied embeddings included) or PEFT's LoRA ``Linear`` on one (its
weight ``W + s * B @ A``, checked against the module's own output on two rows at first use); LoRA dropout in
training, DoRA, quantized or sharded (DTensor) heads stay stock, said once.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..loss.lean_head import (IGNORE_INDEX, TARGETS, Objective, head_cross_entropy_sum, measure_objective,
                               next_token_targets)

_MISSING = object()


class _NotLean(Exception):
    """The call could not run lean (found during it); the caller reruns it on the stock path."""


@dataclass
class LeanHead:
    """Per trainer: whether the lean head is on, how often it ran, and why a model stays stock."""

    calls: int = 0  # model calls that ran lean
    stock_calls: int = 0  # model calls with labels that ran the stock head (the reason is in `refused`)
    probe_calls: int = 0  # the loss probes' forwards that ran lean (not counted in `calls`)
    refused: dict[int, str] = field(default_factory=dict)  # id(model) -> why it stays on the stock path
    checked_heads: set = field(default_factory=set)  # LoRA heads whose merged weight matched their own output
    warned: set = field(default_factory=set)
    # (model, loss function, call signature) -> the Objective its loss_function computes, or why none
    objectives: dict = field(default_factory=dict)
    logits_needed: bool = False  # an evaluation that returns the logits (compute_metrics, prediction)

    def line(self) -> str:
        return "loss head: lean (the logits of a micro-batch are never materialized; loss.head: lean)"


class LeanHeadUnusedCheck:
    """An internal handler (``integration/internal_callbacks.py``): at the first optimizer step, a run whose training
    steps never called the model through hf_gradfix's loss body (TRL's SFTTrainer and GRPOTrainer compute their loss
    with their own log-prob head; a ``compute_loss`` override that calls the model itself) never tried the lean head:
    said once, since ``loss.head: lean`` did nothing there. Measured by the model calls, not by the trainer's class."""

    def __init__(self, plan: LeanHead, trainer: Any) -> None:
        self.plan, self.trainer_name, self.done = plan, type(trainer).__name__, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        if self.plan.calls == 0 and self.plan.stock_calls == 0:
            warnings.warn(
                f"hf_gradfix: loss.head: lean is not used: {self.trainer_name}.compute_loss computes its loss without "
                "calling the model through hf_gradfix's loss body (TRL's trainers run their own log-prob head, which "
                "materializes no full logits either); the loss stays exact; remove loss.head to silence this",
                stacklevel=2)


def _inner_model(model: nn.Module) -> nn.Module:
    """The module whose forward runs the head and its loss: below DDP / accelerate wrappers and PEFT."""
    seen = 0
    while seen < 8:
        seen += 1
        # by the class: DeepSpeed's engine forwards unknown attributes (get_output_embeddings) to its module
        if isinstance(getattr(model, "module", None), nn.Module) and not hasattr(type(model), "get_output_embeddings"):
            model = model.module
            continue
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base) and type(model).__name__.startswith("Peft"):
            model = get_base()
            continue
        break
    return model


def _sharded_outside_forward(head: nn.Module) -> bool:
    """The head's weight is a DTensor now and may be whole inside its forward (FSDP2 swaps in the unsharded tensor
    during the model's forward; tensor parallel keeps the DTensor): decided in the head's forward."""
    return any(type(p).__name__ == "DTensor" for p in head.parameters())


def _partitioned_by_zero3(head: nn.Module) -> bool:
    """DeepSpeed ZeRO-3 partitioned parameters (``ds_status``): gathered for the head's backward by hooks on its
    output, which the lean head's loss does not pass through (measured: the hooks hand the loss a copy of the
    stand-in, so the call would have run stock anyway)."""
    return any(hasattr(p, "ds_status") for p in head.parameters())


def _whole(linear: tuple[torch.Tensor, torch.Tensor | None], hidden: torch.Tensor) -> str | None:
    """Why ``(weight, bias)`` found in the head's forward cannot be used there, else None."""
    weight, bias = linear
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.numel() == 0 or (
            bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        return f"its weight inside its forward is {tuple(weight.shape)}, not (vocab, {hidden.shape[-1]})"
    return None


def effective_linear(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """``(weight, bias)`` with ``head(x) == x @ weight.T + bias`` (autograd-connected), or why there is none."""
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        weight = head.weight
        if type(weight).__name__ == "DTensor":
            return "its weight is sharded (DTensor: tensor parallel or FSDP outside its forward)"
        return weight, head.bias
    base = getattr(head, "base_layer", None)
    if base is not None and hasattr(head, "lora_A") and hasattr(head, "lora_B") and hasattr(head, "scaling"):
        inner = effective_linear(base)
        if isinstance(inner, str):
            return f"its LoRA base layer: {inner}"
        weight, bias = inner
        if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
            return weight, bias
        for name in getattr(head, "active_adapters", []):
            if name not in head.lora_A:
                continue
            if getattr(head, "use_dora", {}).get(name, False):
                return "it is a DoRA head (its magnitude vector is not a linear term)"
            dropout = head.lora_dropout[name] if hasattr(head, "lora_dropout") else None
            if head.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
                return f"LoRA dropout {dropout.p} on the head in training (dropout of the input is not a weight)"
            a, b = head.lora_A[name], head.lora_B[name]
            if not (type(a).forward is nn.Linear.forward and type(b).forward is nn.Linear.forward) or a.bias is not None:
                return "its LoRA adapter is not a pair of plain linear layers"
            scale = head.scaling[name]
            weight = weight + scale * (b.weight.to(weight.dtype) @ a.weight.to(weight.dtype))
            if b.bias is not None:
                extra = scale * b.bias.to(weight.dtype)
                bias = extra if bias is None else bias + extra
        return weight, bias
    return (f"its output layer is a {type(head).__name__}, not a plain linear layer (or PEFT LoRA on one): "
            "quantized and custom heads keep the stock path")


class _Call:
    """One lean model call: the head's stand-in forward, the loss function, and what they saw."""

    def __init__(self, plan: LeanHead, inner: nn.Module, head: nn.Module, labels: torch.Tensor,
                 shift_labels: torch.Tensor | None, linear: tuple[torch.Tensor, torch.Tensor | None] | None,
                 original_loss: Callable[..., Any]):
        self.plan, self.inner, self.head = plan, inner, head
        self.labels, self.shift_labels = labels, shift_labels
        # the head's (weight, bias), merged once per call (a LoRA head's W + s * B @ A); None: found at its forward
        self.linear = linear
        self.original_loss = original_loss  # the model's own loss_function, which this call replaces
        self.head_calls = self.loss_calls = 0
        self.label_smoothing = 0.0
        self.smoothing_targets: str | None = None  # the targets LabelSmoother scores (from the measured count rule)
        self.hidden: torch.Tensor | None = None
        self.compute_dtype: torch.dtype | None = None
        self.marker: torch.Tensor | None = None
        self.mismatch: str | None = None

    def head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.head_calls += 1
        if self.head_calls > 1:
            self.mismatch = "the model calls its output layer more than once per forward"
            return type(self.head).forward(self.head, hidden)
        if self.linear is None:  # a DTensor before the forward: FSDP2 has unsharded it by now, tensor parallel not
            found = effective_linear(self.head)
            if isinstance(found, str):
                raise _NotLean(found)
            why = _whole(found, hidden)
            if why is not None:
                raise _NotLean(why)
            self.linear = found
        weight, bias = self.linear
        self._check_merged(hidden, weight, bias)
        # the loss is computed where the loss function is called (its targets and reduction are that function's);
        # the matmul runs in the dtype the stock head's would run in here (autocast's, where it is on)
        self.hidden = hidden
        device_type = hidden.device.type
        self.compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                              else hidden.dtype)
        self.marker = hidden.new_zeros(()).expand(*hidden.shape[:-1], weight.shape[0])
        return self.marker

    def _check_merged(self, hidden, weight, bias) -> None:
        """A LoRA head: its merged weight against its own forward on two rows, once per head (a PEFT variant
        whose forward is not ``W + s * B @ A`` is caught here instead of training on a wrong head)."""
        if isinstance(self.head, nn.Linear) or id(self.head) in self.plan.checked_heads:
            return
        with torch.no_grad():
            rows = hidden.reshape(-1, hidden.shape[-1])[:2].detach()
            own = type(self.head).forward(self.head, rows).double()
            merged = torch.nn.functional.linear(rows.double(), weight.double(),
                                                None if bias is None else bias.double())
            scale = float(own.abs().max().clamp_min(1e-30))
            if float((own - merged).abs().max()) > 1e-4 * scale:
                raise _NotLean("the LoRA head's own output differs from W + s * B @ A")
        self.plan.checked_heads.add(id(self.head))

    def loss_function(self, *args, **kwargs):
        """In place of the model's ``loss_function(logits, labels, vocab_size, **kwargs)``: the cross-entropy that
        function computes (measured once per model and call signature, :func:`objective_of`), from the head's input
        instead of the logits."""
        self.loss_calls += 1
        bound = dict(zip(("logits", "labels", "vocab_size"), args))
        bound.update({k: v for k, v in kwargs.items() if k not in bound})
        logits, labels = bound.get("logits"), bound.get("labels")
        shift_labels = bound.get("shift_labels")
        ignore_index = bound.get("ignore_index", IGNORE_INDEX)
        if self.mismatch is None:
            if len(args) > 3:
                self.mismatch = f"the model passes {len(args)} positional arguments to its loss_function"
            elif logits is not self.marker or self.marker is None:
                self.mismatch = ("its logits are transformed between the output layer and the loss (soft-capping, "
                                 "scaling, an upcast or a hook)")
            elif labels is not self.labels or (shift_labels is not None and shift_labels is not self.shift_labels):
                self.mismatch = "the loss receives other labels than the model call's"
            elif ignore_index != IGNORE_INDEX:
                self.mismatch = f"the loss ignores {ignore_index}, not {IGNORE_INDEX}"
        if self.mismatch is not None:
            raise _NotLean(self.mismatch)
        objective = objective_of(self.plan, self.inner, self.original_loss, args, kwargs, labels)
        if isinstance(objective, str):
            raise _NotLean(objective)
        targets = {"next": lambda: next_token_targets(labels), "same": lambda: labels,
                   "shift_labels": lambda: shift_labels}[objective.targets]()
        hidden = self.hidden
        if tuple(hidden.shape[:-1]) != tuple(targets.shape):
            raise _NotLean(f"the head's input covers {tuple(hidden.shape[:-1])} positions, its loss's targets "
                           f"{tuple(targets.shape)} (logits_to_keep, or a model that rearranges positions)")
        n = bound.get("num_items_in_batch")
        if self.label_smoothing:
            # LabelSmoother's objective over the targets it scores (the count rule's), divided by the window's count
            if objective.targets != self.smoothing_targets or objective.reduction != "num_items":
                raise _NotLean(f"with label smoothing its loss_function computes {objective.describe()}, where "
                               f"the label smoother scores {TARGETS[self.smoothing_targets or 'next']} over the "
                               "window's count")
        weight, bias = self.linear
        if weight.untyped_storage().nbytes() == 0:  # an FSDP2 unit that reshards the head right after its forward
            raise _NotLean("its weight is resharded between its forward and the loss (FSDP2 free_full_weight)")
        total = head_cross_entropy_sum(hidden, weight, bias, targets, label_smoothing=self.label_smoothing,
                                       compute_dtype=self.compute_dtype)
        if objective.reduction == "num_items":
            if torch.is_tensor(n):
                n = n.to(total.device)
            return total / n
        if objective.reduction == "mean":
            return total / (targets != IGNORE_INDEX).sum()  # the stock loss's mean (NaN without targets, as stock)
        return total


def objective_of(plan: LeanHead, inner: nn.Module, loss_fn: Callable[..., Any], args: tuple, kwargs: dict,
                 labels: torch.Tensor) -> Objective | str:
    """What the model's own ``loss_fn`` computes when called as the model calls it (``measure_objective``), once
    per model, loss function and call signature (which arguments it passes, a count or not, shift_labels or not):
    the lean call computes exactly that, or the model keeps the stock head (the string says why)."""
    n = kwargs.get("num_items_in_batch")
    key = (id(inner), id(getattr(loss_fn, "__func__", loss_fn)), len(args), tuple(sorted(kwargs)),
           n is not None, torch.is_tensor(n), torch.is_tensor(kwargs.get("shift_labels")))
    if key not in plan.objectives:
        plan.objectives[key] = measure_objective(loss_fn, args, kwargs, labels)
    return plan.objectives[key]


@contextlib.contextmanager
def _installed(call: _Call):
    head, inner = call.head, call.inner
    saved_forward = head.__dict__.get("forward", _MISSING)
    saved_loss = inner.__dict__.get("_loss_function", _MISSING)
    head.forward = call.head_forward
    inner.loss_function = call.loss_function  # PreTrainedModel's own setter (an instance _loss_function)
    try:
        yield
    finally:
        if saved_forward is _MISSING:
            head.__dict__.pop("forward", None)
        else:
            head.forward = saved_forward
        if saved_loss is _MISSING:
            inner.__dict__.pop("_loss_function", None)
        else:
            inner.__dict__["_loss_function"] = saved_loss


def call_model(trainer, plan: LeanHead, model: nn.Module, call: dict, inputs: dict, labels: Any, n: Any,
               behaviour: Any, *, probe: bool = False) -> tuple[Any, bool]:
    """The model call of the plugin's compute_loss body with the lean head: ``(outputs, smoothed)``. With label
    smoothing (the Trainer popped the labels for its ``LabelSmoother``) a model that takes the window's count and
    whose loss is the cross-entropy against the targets the smoother scores (the measured count rule: shifted, or
    unshifted) gets the labels back and the lean head computes the smoothed loss itself (``smoothed`` True:
    ``outputs.loss`` is the micro-batch's smoothed sum / ``n``); if the call ran stock, the smoother is applied to
    its logits as before. ``probe``: a forward of the loss probes (counted apart)."""
    from ..loss.counting import CountRule

    smoother = getattr(trainer, "label_smoother", None)
    smoothed_targets = {CountRule.SHIFTED: "next", CountRule.UNSHIFTED: "same"}.get(
        getattr(behaviour, "count_rule", None))
    if (labels is not None and smoother is not None and getattr(trainer, "compute_loss_func", None) is None
            and n is not None and behaviour is not None and behaviour.honors_num_items
            and smoothed_targets is not None):
        before = plan.calls + plan.probe_calls
        smoothed_call = {**inputs, "labels": labels, "num_items_in_batch": n}
        outputs = run_model(plan, model, smoothed_call, lambda: model(**smoothed_call), model.training,
                            label_smoothing=float(smoother.epsilon), smoothing_targets=smoothed_targets, probe=probe)
        return outputs, plan.calls + plan.probe_calls > before
    return run_model(plan, model, call, lambda: model(**call), model.training, probe=probe), False


def probe_forward(plan: LeanHead, model: nn.Module, call: dict) -> Any:
    """One forward of the loss probes (``model(**call)`` under no_grad, the logits never read) through the lean head
    where it applies, so that the first window, which the probes run in, never materializes the logits either. What
    the probes measure is the model's own loss: the lean call computes what the model's ``loss_function`` computes
    (:func:`objective_of`), or the model keeps the stock head."""
    return run_model(plan, model, call, lambda: model(**call), True, probe=True)


def run_model(plan: LeanHead | None, model: nn.Module, call: dict, forward: Callable[[], Any],
              training: bool, *, label_smoothing: float = 0.0, smoothing_targets: str | None = None,
              probe: bool = False) -> Any:
    """``forward()`` (the model call with ``call``'s inputs) with the lean head where it applies, else as is.
    ``label_smoothing``: the lean loss is the label-smoothed cross-entropy (transformers' ``LabelSmoother`` per
    target: ``(1 - eps) * nll + eps * mean over the vocabulary of -log p``) against ``smoothing_targets`` ("next"
    or "same", what the smoother scores), summed and divided like the plain one. ``probe``: counted in
    ``plan.probe_calls``, not in ``calls`` / ``stock_calls``."""
    labels = call.get("labels")
    if plan is None or not torch.is_tensor(labels) or (not training and plan.logits_needed):
        return forward()
    inner = _inner_model(model)
    key = id(inner)
    if key in plan.refused:
        if not probe:
            plan.stock_calls += 1
        return forward()
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    reason = None
    if hasattr(inner, "_orig_mod"):
        # the lean call swaps the head's forward for a per-call function: a compiled graph would guard on it and
        # recompile at every micro-batch
        reason = "the model is torch.compile'd (the lean head replaces the head's forward per call)"
    elif head is None:
        reason = "the model has no output embeddings (get_output_embeddings() is None)"
    elif not hasattr(type(inner), "loss_function"):
        reason = "the model has no loss_function to hand the lean loss to"
    elif _partitioned_by_zero3(head):
        reason = ("its weights are DeepSpeed ZeRO-3 partitions, gathered for its backward by hooks on its output that "
                  "the lean loss does not pass through")
    elif _sharded_outside_forward(head):
        linear = None  # whole only inside the head's forward, if at all: decided there
    else:
        linear = effective_linear(head)
        if isinstance(linear, str):
            reason = linear
    if reason is None:
        shift = call.get("shift_labels")
        lean = _Call(plan, inner, head, labels, shift if torch.is_tensor(shift) else None, linear,
                     inner.loss_function)  # the one the call replaces: an instance's own, else its class's
        lean.label_smoothing = float(label_smoothing)
        lean.smoothing_targets = smoothing_targets
        try:
            with _installed(lean):
                outputs = forward()
            if lean.head_calls != 1 or lean.loss_calls != 1:
                raise _NotLean(lean.mismatch or (
                    "the model does not call its output layer's forward" if lean.head_calls == 0
                    else "the model computes its loss without its loss_function (inline)" if lean.loss_calls == 0
                    else "the head or the loss ran twice"))
        except _NotLean as err:
            reason = str(err)
        else:
            if probe:
                plan.probe_calls += 1
            else:
                plan.calls += 1
            return _drop_logits(outputs, lean.marker)
    plan.refused[key] = reason
    if not probe:
        plan.stock_calls += 1
    if key not in plan.warned:
        plan.warned.add(key)
        warnings.warn(f"hf_gradfix: loss.head: lean is not used for {type(inner).__name__}: {reason}; this model "
                      "keeps the stock head (the logits are materialized; the loss stays exact)", stacklevel=3)
    return forward()


def _drop_logits(outputs: Any, marker: torch.Tensor | None) -> Any:
    """The stand-in is not the logits: a caller that reads them gets None (as from TRL's fused head), never zeros.
    transformers' ``ModelOutput`` is an ordered dict whose None fields are not keys: the key goes, the attribute is
    None. A tuple (``return_dict=False``) is rebuilt with None in the stand-in's place (positions kept)."""
    from collections import OrderedDict

    if marker is None:
        return outputs
    if isinstance(outputs, tuple) and not hasattr(outputs, "_fields"):
        return tuple(None if item is marker else item for item in outputs)
    if isinstance(outputs, dict) and outputs.get("logits") is marker:
        if isinstance(outputs, OrderedDict):
            OrderedDict.__delitem__(outputs, "logits")  # ModelOutput refuses __delitem__ itself
        else:
            del outputs["logits"]
    if getattr(outputs, "logits", None) is marker:
        object.__setattr__(outputs, "logits", None)
    return outputs
