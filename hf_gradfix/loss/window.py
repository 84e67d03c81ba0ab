"""Token-exact gradient accumulation for hand-written training loops (accelerate or plain PyTorch).

The usual recipe, ``accelerator.accumulate(model)`` with ``loss = model(**batch).loss`` (``/ GA``), averages
per-micro-batch means: micro-batches and ranks are weighted equally instead of by their token counts (gradient
error 0.7-1.4 vs the full batch, see ``shared/research/loss-normalization.md`` 1.6). :class:`TokenWindow`
keeps the invariant of :mod:`hf_gradfix.loss.counting` instead:

    gradient = (sum of per-target losses over the optimizer window, all data-parallel ranks) / N_global

>>> batches = [{"labels": torch.tensor(x)} for x in ([[5, 6, 7]], [[8, 9]], [[4, 4]])]
>>> for window in TokenWindow(None, batches, grad_accum_steps=2):   # shifted rule: 2 + 1 targets, then 1
...     for batch, micro in window:
...         _ = micro.scale(torch.tensor(2.0 * micro.local_count))  # a loss of 2 per target
...     print(window.num_items, window.num_micro_batches, window.loss)
3 2 2.0
1 1 2.0

Per optimizer step it

1. prefetches ``grad_accum_steps`` micro-batches (fewer in the last window: no extra optimizer step);
2. counts their targets with the loss's rule (:func:`~hf_gradfix.loss.counting.count_targets`: ``"shifted"``
   for causal LMs, ``"unshifted"`` for MLM / token classification / seq2seq / prompt learning, ``"elements"``
   for sequence labels, or ``callable(batch) -> int``);
3. all-reduces the count over the data-parallel group once (one SUM of a small vector that also carries every
   rank's number of micro-batches);
4. yields ``(batch, micro)`` pairs; the body of the loop runs inside ``no_sync`` for all but the last
   micro-batch, and ``micro`` turns the micro-batch loss into its share of the global token mean;
5. after the last micro-batch, all-reduces the recorded loss sums once: ``window.loss`` is the exact global
   token-mean loss (what a full-batch step would report).

Data-parallel group and factors (the defaults, for an ``accelerate.Accelerator``):

* with a ``ParallelismConfig`` mesh: the ``dp_cp`` sub-mesh (every rank whose gradient is averaged; tp ranks
  hold the same tokens and are left out). Batches are counted as the dataloader yields them, i.e. *before*
  context parallelism splits the sequences, so the ``cp`` ranks of one group count the same tokens and the
  summed count is divided by ``cp``;
* otherwise the whole world (DDP, FSDP), or no communication at all in a single process;
* ``world_factor`` = the size of that group: DDP / FSDP2 average gradients over it, so each replica
  back-propagates ``loss_sum * world_factor / N``; ``accelerator.backward`` divides by the Accelerator's own
  ``gradient_accumulation_steps`` (leave it at 1: TokenWindow accumulates), and that is multiplied back in.

Uneven ranks (the rule that keeps every collective matched): a window has ``M = max over ranks`` micro-batches
on every rank. A rank with fewer pads its window with *padding micro-batches*: a copy of its last real batch
with every label set to -100 (``micro.is_padding``); the loop runs forward and backward on them as usual (FSDP's
all-gathers and DDP's reducer need every rank to take part) and every ``micro`` helper makes their contribution
exactly zero. Windows continue until every rank's dataloader is exhausted, so a rank with fewer batches yields
fully padded windows. A rank whose window has no targets (all labels -100) just counts 0. A rank that never
had a batch cannot be padded and raises.

Mean-type terms (e.g. a MoE router aux loss, already a mean over its micro-batch) go through
``micro.mean_term(term)``: the window's term is their mean over the real micro-batches of all ranks, not
weighted by tokens.

Pure torch: no transformers or accelerate import; the Accelerator is used through its public attributes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..errors import InvalidArgumentError, InvalidTypeError, UsageError
from .counting import IGNORE_INDEX, CountRule, count_targets

__all__ = ["TokenWindow", "Window", "MicroBatch"]

CountFn = Callable[[Any], "int | torch.Tensor"]


def _zero_like(loss: torch.Tensor) -> torch.Tensor:
    """``0 * loss`` that stays 0 (and back-propagates 0) even where the loss is NaN (a mean over 0 targets)."""
    return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0


def _padding_batch(batch: Any, ignore_index: int) -> Any:
    """A copy of ``batch`` without targets (label tensors set to ``ignore_index``); other batch types are reused."""
    if not isinstance(batch, Mapping):
        return batch
    out = dict(batch)
    for key in ("labels", "shift_labels"):
        if torch.is_tensor(out.get(key)):
            out[key] = torch.full_like(out[key], ignore_index)
    return out


class MicroBatch:
    """One micro-batch of a :class:`Window`: turns its loss into the share the replica back-propagates.

    Every helper records the micro-batch's loss sum for ``window.loss`` and returns a tensor for
    ``accelerator.backward`` (or ``loss.backward()`` without accelerate); padding micro-batches return an exact 0.
    """

    def __init__(self, window: "Window", index: int, local_count: int, is_padding: bool):
        self.window = window
        self.index = index
        self.local_count = local_count  # targets of this micro-batch on this rank, by the window's rule
        self.is_padding = is_padding
        self.is_last = index == window.num_micro_batches - 1

    @property
    def num_items_in_batch(self) -> torch.Tensor:
        """What to pass as ``model(**batch, num_items_in_batch=...)`` to a model that honours it.

        ``N_global / (world_factor * backward_divisor)``: the model then returns ``loss_sum * world_factor *
        backward_divisor / N_global``, ready for ``accelerator.backward`` (report it with :meth:`model_loss`).
        ``window.num_items`` is the plain global count. Only for models whose loss divides by it (e.g. Llama; not
        BERT-family MLMs, classification heads or encoder-decoders: use :meth:`loss_from_mean` there, or check
        with :func:`hf_gradfix.loss.probe.probe_honors_num_items`).
        """
        w = self.window
        value = w.num_items / (w.world_factor * w.backward_divisor) if w.num_items else 1.0
        return torch.tensor(value, dtype=torch.float32, device=w.device)

    def scale(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` (sum of per-target losses of this micro-batch) -> the loss to back-propagate."""
        self.record(loss_sum)
        if self.is_padding:
            return _zero_like(loss_sum)
        return loss_sum * self.window._factor

    def loss_from_mean(self, mean_loss: torch.Tensor, local_count: int | None = None) -> torch.Tensor:
        """A loss that is a mean over ``local_count`` targets (default: this micro-batch's count by the window's
        rule; pass your own if the loss averages over something else) -> the loss to back-propagate."""
        count = self.local_count if local_count is None else int(local_count)
        if self.is_padding or count == 0:
            self.record(_zero_like(mean_loss))
            return _zero_like(mean_loss)
        return self.scale(mean_loss * count)

    def model_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a model returned when called with ``num_items_in_batch=micro.num_items_in_batch``: recorded
        for ``window.loss`` and returned as it is (it is already scaled)."""
        if self.is_padding:
            self.record(_zero_like(loss))
            return _zero_like(loss)
        self.record(loss * self.num_items_in_batch.to(loss.device))
        return loss

    def mean_term(self, term: torch.Tensor) -> torch.Tensor:
        """A term that is already a mean over this micro-batch (e.g. ``coef * aux_loss``), added unscaled by tokens:
        the window's term is its mean over the real micro-batches of all ranks. Returns the share to add to the
        back-propagated loss; the mean is reported as ``window.mean_terms``."""
        w = self.window
        if self.is_padding:
            return _zero_like(term)
        w._stats[2] += term.detach().to(w._stats)
        w._stats[3] += 1
        # the gradient is averaged over world_factor ranks; cp ranks hold shards of the same micro-batch
        per_mean = w.num_real_micro_batches_global * w._owner._count_copies
        return term * (w.world_factor * w.backward_divisor / per_mean)

    def record(self, loss_sum: torch.Tensor | float) -> None:
        """Add ``loss_sum`` to this micro-batch's loss sum (for ``window.loss``); the helpers above call it."""
        w = self.window
        if self.is_padding:
            return
        w._stats[0] += loss_sum.detach().to(w._stats) if torch.is_tensor(loss_sum) else float(loss_sum)
        if self.index not in w._recorded:
            w._recorded.add(self.index)
            w._stats[1] += 1


class Window:
    """The micro-batches of one optimizer step. Iterate it exactly once, to the end, on every rank.

    Attributes: ``index`` (optimizer step, from 0), ``num_items`` (global target count), ``local_num_items``,
    ``num_micro_batches`` (the same on every rank, padding included), ``num_real_micro_batches`` (this rank),
    ``num_real_micro_batches_global``, and after the iteration ``loss`` (exact global token-mean loss; None when
    a real micro-batch recorded nothing or the window has no target) and ``mean_terms`` (mean of the
    :meth:`MicroBatch.mean_term` inputs over the real micro-batches of all ranks; None if none was given).
    """

    def __init__(self, owner: "TokenWindow", index: int, batches: list, counts: list[int], num_real: int,
                 num_items: int, num_micro: int, num_real_global: int):
        self._owner = owner
        self.index = index
        self._batches = batches
        self._counts = counts
        self.num_real_micro_batches = num_real
        self.num_items = num_items
        self.local_num_items = sum(counts)
        self.num_micro_batches = num_micro
        self.num_real_micro_batches_global = num_real_global
        self.world_factor = owner.world_factor
        self.backward_divisor = owner.backward_divisor
        self.device = owner.device
        self._factor = self.world_factor * self.backward_divisor / num_items if num_items else 0.0
        # [loss sum, real micro-batches that recorded a loss, mean-term sum, mean terms given]: all-reduced at the end
        self._stats = torch.zeros(4, dtype=torch.float64, device=owner.device)
        self._recorded: set[int] = set()
        self._started = False
        self.finished = False
        self.loss: float | None = None
        self.mean_terms: float | None = None

    def __len__(self) -> int:
        return self.num_micro_batches

    def __iter__(self) -> Iterator[tuple[Any, MicroBatch]]:
        if self._started:
            raise UsageError("a TokenWindow window can be iterated only once")
        self._started = True
        for i, batch in enumerate(self._batches):
            micro = MicroBatch(self, i, self._counts[i], is_padding=i >= self.num_real_micro_batches)
            # the loop body (forward and backward) runs inside this context: no_sync except for the last one
            with self._owner._micro_context(last=micro.is_last):
                yield batch, micro
        self._finish()

    def _finish(self) -> None:
        stats = self._owner._all_reduce(self._stats).tolist()
        loss_sum, n_recorded, mean_terms, n_mean_terms = stats
        per_mean = self.num_real_micro_batches_global * self._owner._count_copies  # micro-batches x cp shards
        if self.num_items and round(n_recorded) == per_mean:
            self.loss = loss_sum / self.num_items
        if n_mean_terms:
            self.mean_terms = mean_terms / per_mean
        self.finished = True

    def __repr__(self) -> str:
        return (f"Window(index={self.index}, num_items={self.num_items}, micro_batches={self.num_micro_batches} "
                f"({self.num_real_micro_batches} real here), loss={self.loss})")


class TokenWindow:
    """Iterate ``dataloader`` one optimizer window at a time, with token-exact loss scaling.

    Args:
        accelerator: an ``accelerate.Accelerator`` (``no_sync``, ``sync_gradients``, its mesh, its device and its
            ``backward`` divisor are used), or None for plain PyTorch (``torch.distributed`` if initialized).
        dataloader: any iterable of micro-batches (this rank's shard, e.g. ``accelerator.prepare(dataloader)``).
        grad_accum_steps: micro-batches per optimizer step (the last window may have fewer).
        model: the prepared model, for ``no_sync`` (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``).
            Without it every micro-batch synchronizes (correct, slower).
        count_rule: ``"shifted"`` | ``"unshifted"`` | ``"elements"`` (see :class:`CountRule`) or
            ``callable(batch) -> int | Tensor`` counting exactly what the loss averages over.
        group: the data-parallel process group for the count (a ``ProcessGroup`` or a 1-D ``DeviceMesh``);
            default: see the module docstring.
        world_factor: the number of replicas the gradient is averaged over (default: the group's size).
        ignore_index: the label value that is not a target.

    Usage::

        tw = TokenWindow(accelerator, train_dl, grad_accum_steps=4, model=model, count_rule="shifted")
        for window in tw:
            for batch, micro in window:
                out = model(**batch, num_items_in_batch=micro.num_items_in_batch)
                accelerator.backward(micro.model_loss(out.loss))
                # or: accelerator.backward(micro.loss_from_mean(model(**batch).loss))
            optimizer.step(); optimizer.zero_grad()
            print(window.index, window.loss)
    """

    def __init__(self, accelerator: Any, dataloader: Iterable, grad_accum_steps: int, *, model: Any = None,
                 count_rule: CountRule | str | CountFn = "shifted", group: Any = None,
                 world_factor: float | None = None, ignore_index: int = IGNORE_INDEX):
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise InvalidArgumentError(f"TokenWindow: grad_accum_steps={grad_accum_steps!r}: must be a positive integer")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise InvalidArgumentError(f"TokenWindow: ignore_index={ignore_index!r}: must be an int (the loss's -100)")
        if not (hasattr(dataloader, "__iter__") or hasattr(dataloader, "__getitem__")):  # else iter() fails at the loop
            given = "None" if dataloader is None else f"a {type(dataloader).__name__}"
            raise InvalidTypeError(
                f"TokenWindow: dataloader={given}: not an iterable of batches; pass the training DataLoader (or any "
                "iterable of collated batches) as the second argument: TokenWindow(accelerator, train_dataloader, "
                "grad_accum_steps=...), with accelerator=None in a plain PyTorch loop")
        if accelerator is not None and str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED"):
            raise InvalidArgumentError("TokenWindow does not drive DeepSpeed (its engine owns the accumulation boundary and "
                             "the loss scaling); use transformers.Trainer with hf_gradfix.patch() instead")
        self.accelerator = accelerator
        self.dataloader = dataloader
        self.grad_accum_steps = grad_accum_steps
        self.model = model
        self.ignore_index = ignore_index
        self._user_count = None
        if callable(count_rule) and not isinstance(count_rule, (str, CountRule)):
            self._count_fn: CountFn = count_rule
            self._user_count = count_rule
        else:
            try:
                rule = CountRule(count_rule)
            except ValueError:  # the same words as the YAML's loss.count_rule
                allowed = ", ".join(repr(r.value) for r in CountRule)
                raise InvalidArgumentError(f"TokenWindow: count_rule={count_rule!r}: invalid value; allowed values: "
                                           f"{allowed}, or a function batch -> target count") from None
            self._count_fn = lambda batch: count_targets(batch, rule, ignore_index)
        self.count_rule = count_rule
        self.group, self._count_copies = self._resolve_group(group)
        self._dist = self._group_size() > 1
        self.group_size = self._group_size()
        self.group_rank = self._group_rank()
        self.world_factor = float(world_factor) if world_factor is not None else float(self.group_size)
        # accelerator.backward divides by the Accelerator's gradient_accumulation_steps: multiply it back
        self.backward_divisor = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        self.device = self._resolve_device()

    # ------------------------------------------------------------------ process group
    def _resolve_group(self, group: Any) -> tuple[Any, int]:
        """(process group or None for the default world, how many group ranks count the same tokens)."""
        if group is not None:
            return (group.get_group() if hasattr(group, "get_group") else group), 1
        mesh = getattr(self.accelerator, "torch_device_mesh", None) if self.accelerator is not None else None
        if mesh is None:
            return None, 1
        names = tuple(mesh.mesh_dim_names or ())
        dims = [d for d in ("dp_replicate", "dp_shard", "cp") if d in names]
        if not dims:  # e.g. tp only: every rank holds the same tokens, nothing to sum
            return _LOCAL, 1
        try:
            sub = mesh["dp_cp"]  # flattened by accelerate's ParallelismConfig.build_device_mesh
        except (KeyError, RuntimeError, ValueError):
            if len(dims) > 1:
                raise InvalidArgumentError(f"the accelerator's mesh {names} has no flattened 'dp_cp' sub-mesh; pass group=")
            sub = mesh[dims[0]]
        cp = int(mesh["cp"].size()) if "cp" in names else 1
        return sub.get_group(), cp

    def _group_size(self) -> int:
        if self.group is _LOCAL or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return 1
        return torch.distributed.get_world_size(self.group)

    def _group_rank(self) -> int:
        if self.group_size == 1:
            return 0
        return torch.distributed.get_rank(self.group)

    def _resolve_device(self) -> torch.device:
        if self.accelerator is not None and getattr(self.accelerator, "device", None) is not None:
            return torch.device(self.accelerator.device)
        if self._dist and torch.distributed.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dist:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return tensor

    # ------------------------------------------------------------------ sync
    @contextlib.contextmanager
    def _micro_context(self, last: bool):
        acc = self.accelerator
        if acc is not None:
            acc.sync_gradients = last  # what accelerate's optimizer / scheduler / user code check
        try:
            with contextlib.nullcontext() if last else self._no_sync():
                yield
        finally:
            if acc is not None:
                acc.sync_gradients = True

    def _no_sync(self):
        model = self.model
        if model is None:
            return contextlib.nullcontext()
        if self.accelerator is not None:
            return self.accelerator.no_sync(model)
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 module
            return _fsdp2_no_sync(model)
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()

    # ------------------------------------------------------------------ counting
    def _count(self, batch: Any) -> int:
        if not callable(getattr(self, "_user_count", None)) and not isinstance(batch, Mapping):
            raise InvalidArgumentError(f"TokenWindow: a batch of the dataloader is a {type(batch).__name__}, not a dict "
                                       "of tensors with labels; give a dataloader of collated batches (or a count_rule "
                                       "function that counts this batch's targets)")
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        token_targets = self._user_count is None and str(getattr(self.count_rule, "value", self.count_rule)) in (
            "shifted", "unshifted")  # "elements" counts regression targets, which are floats
        if token_targets and torch.is_tensor(labels) and (labels.is_floating_point() or labels.is_complex()):
            raise InvalidArgumentError(
                f"TokenWindow: the batch's labels are {labels.dtype} under count_rule={self.count_rule!r}: token "
                "targets are class indices (an integer tensor, -100 where ignored); convert them (labels.long()), or "
                "use count_rule='elements' (regression) or a count_rule function for another loss")
        n = self._count_fn(batch)
        return int(n.item()) if torch.is_tensor(n) else int(n)

    def __len__(self) -> int:
        """Windows of this rank's dataloader (``ceil(len / grad_accum_steps)``); with uneven ranks the iteration
        runs as long as the longest rank."""
        try:
            batches = len(self.dataloader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"TokenWindow: len() needs a dataloader with a length; this one is a "
                            f"{type(self.dataloader).__name__} (iterate the TokenWindow instead)") from None
        return math.ceil(batches / self.grad_accum_steps)

    def __iter__(self) -> Iterator[Window]:
        it = iter(self.dataloader)
        exhausted, last_batch, index = False, None, 0
        while True:
            batches: list = []
            while not exhausted and len(batches) < self.grad_accum_steps:
                try:
                    batches.append(next(it))
                except StopIteration:
                    exhausted = True
            counts = [self._count(b) for b in batches]
            # one SUM: [targets, micro-batches of group rank 0, ..., of group rank G-1]
            vec = torch.zeros(1 + self.group_size, dtype=torch.int64, device=self.device)
            vec[0] = sum(counts)
            vec[1 + self.group_rank] = len(batches)
            total, *per_rank = self._all_reduce(vec).tolist()
            if sum(per_rank) == 0:
                if index == 0:  # a pass that trains nothing is a mistake upstream (an empty split, a sampler past its end)
                    raise UsageError(
                        f"TokenWindow: the dataloader yielded no batch on any rank ({type(self.dataloader).__name__}): "
                        "nothing to train on; check the dataset, its split and the sampler")
                return
            num_micro = max(per_rank)
            num_real = len(batches)
            if batches:
                last_batch = batches[-1]
            if num_real < num_micro:
                if last_batch is None:
                    raise UsageError(
                        f"rank {self.group_rank} of the data-parallel group has no batch at all while others do: "
                        "TokenWindow pads short ranks with a masked copy of their last batch; give every rank data")
                pad = _padding_batch(last_batch, self.ignore_index)
                batches += [pad] * (num_micro - num_real)
                counts += [0] * (num_micro - num_real)
            window = Window(self, index, batches, counts, num_real, num_items=total // self._count_copies,
                            num_micro=num_micro, num_real_global=sum(per_rank) // self._count_copies)
            yield window
            if not window.finished:
                raise UsageError(f"window {index} was not iterated to its end: every rank must run every "
                                   "micro-batch of every window (the count and loss all-reduces must match)")
            index += 1


class _Local:
    def __repr__(self) -> str:
        return "<no communication>"


_LOCAL = _Local()


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
