"""``loss.head: lean``: the causal-LM head and its cross-entropy computed together (``hf_gradfix.loss.lean_head``), so
a micro-batch's ``(tokens, vocab)`` logits never exist, normalized by the window's global count like every path.

Where it applies: the model call of the plugin's own ``compute_loss`` body (the Trainer's default loss; TRL's
SFTTrainer runs its own fused head), with labels, in training and in a loss-only evaluation. For the length of that
one call, the output-embedding module's ``forward`` (an instance attribute, removed afterwards) computes the summed
cross-entropy of its input against the call's next-token labels and returns a zero-cost stand-in for the logits
(a 0-stride expanded zero), and the model's ``loss_function`` (its own setter) turns the sum into the loss the model
would have returned (``sum / num_items_in_batch``, or the mean). Nothing persists between calls: no third-party
function is changed, nothing to unpatch.

Decided by behaviour, per model: the call is lean only when the head ran exactly once, the loss function received
*that very* stand-in (identity: nothing transformed the logits between head and loss: soft-capping, scaling, an
upcast, a hook) and the labels it received are the call's own. Anything else (a model that post-processes its logits,
computes its loss inline, calls the head twice) is discovered on the first call, which is then run again on the
stock path; that model stays on the stock path for the rest of the run, with one line saying why. Heads: a plain
``nn.Linear`` (tied embeddings included) or PEFT's LoRA ``Linear`` on one (its weight ``W + s * B @ A``, checked
against the module's own output on two rows at first use); LoRA dropout in training, DoRA, quantized or sharded
(DTensor) heads stay stock, said once.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..loss.lean_head import IGNORE_INDEX, head_cross_entropy_sum, next_token_targets

_MISSING = object()


class _NotLean(Exception):
    """The call could not run lean (found during it); the caller reruns it on the stock path."""


@dataclass
class LeanHead:
    """Per trainer: whether the lean head is on, how often it ran, and why a model stays stock."""

    calls: int = 0  # model calls that ran lean
    stock_calls: int = 0  # model calls with labels that ran the stock head (the reason is in `refused`)
    refused: dict[int, str] = field(default_factory=dict)  # id(model) -> why it stays on the stock path
    checked_heads: set = field(default_factory=set)  # LoRA heads whose merged weight matched their own output
    warned: set = field(default_factory=set)
    logits_needed: bool = False  # an evaluation that returns the logits (compute_metrics, prediction)

    def line(self) -> str:
        return "loss head: lean (the logits of a micro-batch are never materialized; loss.head: lean)"


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
                 shift_labels: torch.Tensor | None, linear: tuple[torch.Tensor, torch.Tensor | None] | None):
        self.plan, self.inner, self.head = plan, inner, head
        self.labels, self.shift_labels = labels, shift_labels
        # the head's (weight, bias), merged once per call (a LoRA head's W + s * B @ A); None: found at its forward
        self.linear = linear
        self.head_calls = self.loss_calls = 0
        self.label_smoothing = 0.0
        self.marker: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.mismatch: str | None = None

    def head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.head_calls += 1
        if self.linear is None:  # a DTensor before the forward: FSDP2 has unsharded it by now, tensor parallel not
            found = effective_linear(self.head)
            if isinstance(found, str):
                raise _NotLean(found)
            why = _whole(found, hidden)
            if why is not None:
                raise _NotLean(why)
            self.linear = found
        linear = self.linear
        targets = self.shift_labels if self.shift_labels is not None else next_token_targets(self.labels)
        if self.head_calls > 1 or tuple(hidden.shape[:-1]) != tuple(targets.shape):
            if self.head_calls > 1:
                self.mismatch = "the model calls its output layer more than once per forward"
            else:
                self.mismatch = (f"the head's input covers {tuple(hidden.shape[:-1])} positions, the labels "
                                 f"{tuple(targets.shape)} (logits_to_keep, or a model that rearranges positions)")
            return type(self.head).forward(self.head, hidden)
        weight, bias = linear
        self._check_merged(hidden, weight, bias)
        # under autocast the matmul runs in autocast's dtype, cast chunk by chunk inside
        self.loss_sum = head_cross_entropy_sum(hidden, weight, bias, targets, label_smoothing=self.label_smoothing)
        self.count = (targets != IGNORE_INDEX).sum()
        vocab = weight.shape[0]
        self.marker = hidden.new_zeros(()).expand(*hidden.shape[:-1], vocab)
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

    def loss_function(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None,
                      ignore_index=IGNORE_INDEX, shift_labels=None, **kwargs):
        self.loss_calls += 1
        if self.mismatch is None:
            if logits is not self.marker or self.marker is None:
                self.mismatch = ("its logits are transformed between the output layer and the loss (soft-capping, "
                                 "scaling, an upcast or a hook)")
            elif labels is not self.labels or (shift_labels is not None and shift_labels is not self.shift_labels):
                self.mismatch = "the loss receives other labels than the model call's"
            elif ignore_index != IGNORE_INDEX:
                self.mismatch = f"the loss ignores {ignore_index}, not {IGNORE_INDEX}"
        if self.mismatch is not None:
            raise _NotLean(self.mismatch)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(self.loss_sum.device)
            return self.loss_sum / num_items_in_batch
        return self.loss_sum / self.count  # the stock loss's mean (NaN on a batch without targets, as stock)


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
               behaviour: Any) -> tuple[Any, bool]:
    """The model call of the plugin's compute_loss body with the lean head: ``(outputs, smoothed)``. With label
    smoothing (the Trainer popped the labels for its ``LabelSmoother``) a causal LM that takes the window's count
    gets the labels back and the lean head computes the smoothed loss itself (``smoothed`` True: ``outputs.loss`` is
    the micro-batch's smoothed sum / ``n``); if the call ran stock, the smoother is applied to its logits as before."""
    from ..loss.counting import CountRule

    smoother = getattr(trainer, "label_smoother", None)
    if (labels is not None and smoother is not None and getattr(trainer, "compute_loss_func", None) is None
            and n is not None and behaviour is not None and behaviour.honors_num_items
            and behaviour.count_rule is CountRule.SHIFTED):
        before = plan.calls
        smoothed_call = {**inputs, "labels": labels, "num_items_in_batch": n}
        outputs = run_model(plan, model, smoothed_call, lambda: model(**smoothed_call), model.training,
                            label_smoothing=float(smoother.epsilon))
        return outputs, plan.calls > before
    return run_model(plan, model, call, lambda: model(**call), model.training), False


def run_model(plan: LeanHead | None, model: nn.Module, call: dict, forward: Callable[[], Any],
              training: bool, *, label_smoothing: float = 0.0) -> Any:
    """``forward()`` (the model call with ``call``'s inputs) with the lean head where it applies, else as is.
    ``label_smoothing``: the lean loss is the label-smoothed cross-entropy (transformers' ``LabelSmoother`` per
    target: ``(1 - eps) * nll + eps * mean over the vocabulary of -log p``), summed and divided like the plain one."""
    labels = call.get("labels")
    if plan is None or not torch.is_tensor(labels) or (not training and plan.logits_needed):
        return forward()
    inner = _inner_model(model)
    key = id(inner)
    if key in plan.refused:
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
        lean = _Call(plan, inner, head, labels, shift if torch.is_tensor(shift) else None, linear)
        lean.label_smoothing = float(label_smoothing)
        try:
            with _installed(lean):
                outputs = forward()
            if lean.head_calls != 1 or lean.loss_calls != 1:
                raise _NotLean(lean.mismatch or ("the model computes its loss without its loss_function"
                                                 if lean.loss_calls == 0 else "the head or the loss ran twice"))
        except _NotLean as err:
            reason = str(err)
        else:
            plan.calls += 1
            return _drop_logits(outputs, lean.marker)
    plan.refused[key] = reason
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
