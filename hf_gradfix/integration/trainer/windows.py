"""The optimizer window and the step, as the fixed trainer sees them: drawing a window, running a window, a step or
the whole trainer exactly as stock when the plugin cannot read it, telling a step of the drawn window from a call of
the user's own, and watching what reaches ``accelerator.backward``.

Split from the class layers, which import it (the window concern, :mod:`.window_steps`, and the others of this
package); the plugin's other modules import only :class:`_IdleMicroBatch`.

>>> from hf_gradfix.integration.trainer.windows import _draw_window
>>> _draw_window(iter([{"x": 1}, {"x": 2}, {"x": 3}]), 2)
[{'x': 1}, {'x': 2}]
"""

from __future__ import annotations

import collections.abc
import contextlib
import logging
import math
from typing import Any

import torch
from transformers import Trainer

from ..state import GradFixState, _nd_dims, _replicated_divisor, _Step, _tp_size, read_pending, take_pending_reads

logger = logging.getLogger("hf_gradfix")

_NOT_COUNTED = object()  # a window drawn without stock's count


def _begin_stock_window(trainer: Trainer, state: GradFixState) -> None:
    """Run this optimizer window exactly as stock transformers would (the probe was deferred on some rank)."""
    state.stock_window = True
    if state.saved_accepts_loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = state.saved_accepts_loss_kwargs


def _end_stock_window(trainer: Trainer, state: GradFixState) -> None:
    if state.stock_window:
        state.stock_window = False
        state.flags_set = False  # re-applied by the next _prepare (the 4.57 accepts_loss_kwargs flag)


def _disable(trainer: Trainer, state: GradFixState, reason: str, log: bool = True) -> None:
    """Leave this trainer's loss exactly to transformers / the trainer, with one warning (a batch layout or loss the
    plugin cannot read)."""
    if state.disabled_reason is not None:
        return
    state.disabled_reason = reason
    state.window = None
    if state.saved_accepts_loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = state.saved_accepts_loss_kwargs
    if log:
        logger.warning("%s", reason)


def _sequence_sharded(trainer: Trainer) -> bool:
    """Whether compute_loss sees a shard of each drawn sequence (context / sequence parallelism), not the whole."""
    dims = _nd_dims(trainer)
    if dims is not None:
        return dims.cp > 1
    return _replicated_divisor(trainer) > _tp_size(trainer)


def _never_opened(trainer: Trainer, state: GradFixState) -> None:
    """A window whose steps never called compute_loss: the trainer computes its loss some other way (e.g. TRL's
    OnlineDPOTrainer.training_step); nothing of it was normalized, and the user is told so, once."""
    window = state.window
    if window is not None and window.pending and state.disabled_reason is None:
        _disable(trainer, state, (
            f"hf_gradfix: {type(trainer).__name__}'s training steps do not call compute_loss (its training_step "
            "computes the loss itself), so hf_gradfix cannot normalize it: it trains exactly as stock computes it."
        ))


class _IdleMicroBatch(dict):
    """A micro-batch that trains on nothing: ``training_step`` returns 0 for it without a forward or backward.

    Placed at the FRONT of a window that the data ended inside (a stream whose last window holds fewer than
    ``gradient_accumulation_steps`` micro-batches; transformers knows no shorter last window without a dataloader
    length): the window then has its full length, so the Trainer syncs the gradients on its last real micro-batch and
    steps it in its epoch, normalized by its own target count, instead of carrying its gradient into the next
    epoch's first step. It holds the model's main input with 0 tokens (no tokens seen, no FLOPs).
    """

    @classmethod
    def for_model(cls, model: Any, device: Any) -> "_IdleMicroBatch":
        name = getattr(model, "main_input_name", "input_ids")
        empty = torch.zeros((1, 0), dtype=torch.long, device=device)
        return cls({name: empty, "attention_mask": empty.clone()})


def _close_short_window(trainer: Trainer, batches: list, num_batches: int, device: Any) -> list:
    """A window the data ended inside, brought to ``num_batches`` micro-batches by idle ones in front (see
    :class:`_IdleMicroBatch`); every rank has the same number of micro-batches in every window then."""
    # Only where transformers cannot close the window itself: a dataset without a length (a stream). A map-style
    # epoch's last window is already asked for with its own, shorter num_batches; a shortfall there (4.57 on resume)
    # is left exactly as stock.
    if isinstance(getattr(trainer, "train_dataset", None), collections.abc.Sized):
        return batches
    if 0 < len(batches) < num_batches:
        idle = [_IdleMicroBatch.for_model(trainer.model, device) for _ in range(num_batches - len(batches))]
        return idle + batches
    return batches


def _all_reduce_sum(trainer: Trainer, values: list, dtype=torch.float64) -> list[float]:
    """``values`` summed over every rank, read back together (one host sync); an entry may be a device tensor (a
    count not yet read back). The reads other parts of the plugin deferred to this one (the non-finite guard's
    verdict of the previous window, :func:`..state.defer_read`) come back in the same transfer, not reduced."""
    device = trainer.args.device
    pending = take_pending_reads(trainer)
    if trainer.accelerator.num_processes == 1 and not pending and not any(torch.is_tensor(v) for v in values):
        return [float(v) for v in values]  # values already on the host: nothing to reduce or read back
    if any(torch.is_tensor(v) for v in values):
        tensor = torch.stack([v.detach().to(device=device, dtype=dtype).reshape(()) if torch.is_tensor(v)
                              else torch.tensor(v, dtype=dtype, device=device) for v in values])
    else:
        tensor = torch.tensor(values, dtype=dtype, device=device)
    if trainer.accelerator.num_processes > 1:
        tensor = trainer.accelerator.reduce(tensor, reduction="sum")
    if not pending:
        return tensor.tolist()
    flat = torch.cat([tensor.reshape(-1)] + [v.detach().reshape(-1).to(device=tensor.device, dtype=dtype)
                                             for v, _ in pending]).tolist()
    read_pending(pending, flat[len(values):])
    return flat[: len(values)]


def _draw_window(epoch_iterator, num_batches: int) -> list:
    """Up to ``num_batches`` micro-batches of one optimizer window (fewer at the end of the data), as transformers'
    own ``get_batch_samples`` draws them."""
    batches = []
    for _ in range(num_batches):
        try:
            batches.append(next(epoch_iterator))
        except StopIteration:
            break
    return batches


@contextlib.contextmanager
def _as_stock(trainer: Trainer, state: GradFixState):
    """One training step exactly as stock computes it (a call of the caller's own without a count)."""
    was_stock = state.stock_window
    _begin_stock_window(trainer, state)
    try:
        yield
    finally:
        state.stock_window = was_stock
        if not was_stock and state.saved_accepts_loss_kwargs is not None:
            trainer.model_accepts_loss_kwargs = True  # the 4.57 flag, as _set_flags left it


def _accumulation_division(trainer: Trainer, step: _Step, loss: Any) -> int | None:
    """k when the loss reaching backward is the loss hf_gradfix returned divided by the accumulation steps k.

    hf_gradfix's loss is already normalized over the whole window, so a trainer that divides it again (a subclass's
    ``training_step`` written for stock's per-micro-batch means, e.g. LLaMA-Factory's when
    ``model_accepts_loss_kwargs`` is False; transformers 4.57's own step when it was given no count) would take 1/k of
    the gradient. Measured, not assumed from a class: the value compute_loss returned against the value backward
    receives."""
    if step.returned is None or not torch.is_tensor(loss) or loss.numel() != 1:
        return None
    if step.returned_loss is not None and loss is step.returned_loss[0] and _version(loss) == step.returned_loss[1]:
        return None  # the very tensor compute_loss returned, unedited: nothing divided it (no read back)
    returned = step.returned
    if torch.is_tensor(returned):
        returned = float(returned.float().sum())
    if not math.isfinite(returned):
        return None
    if abs(returned) < 1e-30:
        return None
    ratio = float(loss.detach().float()) / returned
    candidates = {int(getattr(trainer, "current_gradient_accumulation_steps", 0) or 0),
                  int(trainer.args.gradient_accumulation_steps)}
    for k in sorted(candidates):
        if k > 1 and math.isclose(ratio * k, 1.0, rel_tol=1e-3):
            return k
    return None


def _version(tensor: Any) -> int | None:
    """A tensor's in-place version counter (None where it has none: an inference tensor)."""
    try:
        return tensor._version
    except (AttributeError, RuntimeError):
        return None


def _record_returned(step: _Step, loss: Any) -> None:
    """Remember the loss compute_loss returned for :func:`_accumulation_division`, without reading it back."""
    if torch.is_tensor(loss):
        step.returned = loss.detach()
        step.returned_loss = (loss, _version(loss))


def _same_targets(step: _Step, inputs: Any) -> bool:
    """Whether ``inputs`` holds the very target tensors the step drew, unedited (then they count the same; no read
    back needed)."""
    if not isinstance(inputs, collections.abc.Mapping) or not step.drawn_refs:
        return False
    for key in ("labels", "shift_labels"):
        drawn, seen = step.drawn_refs.get(key), inputs.get(key)
        if drawn is None or seen is None:
            if drawn is not None or torch.is_tensor(seen):
                return False
            continue
        if seen is not drawn[0] or drawn[1] is None or _version(seen) != drawn[1]:
            return False
    return True


@contextlib.contextmanager
def _watch_backward(trainer: Trainer, state: GradFixState, step: _Step):
    """Around one training step: ``accelerator.backward`` (this trainer's instance only, for this step) undoes a
    division of hf_gradfix's loss by the accumulation steps made after compute_loss (see
    :func:`_accumulation_division`)."""
    accelerator = trainer.accelerator
    saved = accelerator.__dict__.get("backward")
    original = accelerator.backward

    def backward(loss, *args, **kwargs):
        k = _accumulation_division(trainer, step, loss)
        if k is not None:
            step.rescaled_by = float(k)
            if not state.ga_division_logged:
                logger.warning(
                    "hf_gradfix: %s.training_step divides the loss by the %d accumulation steps after compute_loss "
                    "(measured: backward received 1/%d of the loss hf_gradfix returned, which is already normalized "
                    "over the whole window); the division is undone, so the step stays exact.",
                    type(trainer).__name__, k, k,
                )
                state.ga_division_logged = True
            loss = loss * k
        return original(loss, *args, **kwargs)

    accelerator.backward = backward
    try:
        yield
    finally:
        if saved is not None:
            accelerator.backward = saved
        else:
            accelerator.__dict__.pop("backward", None)
