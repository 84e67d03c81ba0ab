"""Reading what the plugin is given: a batch's targets, what a model or loss returns (loss, MoE aux loss, the
``(loss, outputs)`` pair), a model's name and whether its forward takes ``num_items_in_batch``.

Apart because every layer reads these (the probes, the default loss body, the top layer's loss and eval); they
import nothing of the plugin but the state's type.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..state import GradFixState


def _has_labels(batch: Any) -> bool:
    """A batch the plugin can count: any Mapping (dict, ``BatchEncoding``, ...) with a ``labels`` tensor."""
    return isinstance(batch, Mapping) and torch.is_tensor(batch.get("labels"))


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
