"""Per-trainer state of the loss fix and the mesh helpers every integration module shares.

The integration modules (callback, gns, nd, packing.trainer, optim_trainer, verify, ...) read a fixed trainer's
state and its data-parallel degrees from here; the Trainer class layers (:mod:`.trainer`) import this module, never
the other way round, so imports run one way: ``trainer -> state -> config / loss``.

>>> import hf_gradfix.integration.state as state
>>> state.state_of(object.__new__(__import__("transformers").Trainer)) is None
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer

from ..config import GradFixConfig
from ..loss.probe import LossBehaviour

__all__ = ["GradFixState", "state_of"]

_STATE_ATTR = "_gradfix"


# ----------------------------------------------------------------------------------------------------
# Per-trainer state
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Window:
    """One optimizer window as the training loop drew it."""

    global_count: float | None  # targets in the whole optimizer window on all data ranks; None: no labels
    micro_batches: int
    # the micro-batches as drawn (``training_step`` tells a step of this window from a call of its own by identity)
    batches: list = field(default_factory=list, repr=False)
    # counted at its first forward, inside the first training step: the loss is probed there, once the training loop
    # and the trainer have set everything a compute_loss may read (e.g. current_gradient_accumulation_steps)
    pending: bool = False
    on_counted: list[Callable[[], None]] = field(default_factory=list, repr=False)  # run once the count is known
    # id(micro-batch) -> its host copy (packing: the targets brought to the host in one transfer for the window's
    # check), counted without a read
    host: dict = field(default_factory=dict, repr=False)

    def holds(self, batch: Any) -> bool:
        return any(batch is b for b in self.batches)


@dataclass
class _Step:
    """The ``training_step`` in progress."""

    # True: a call of the user's own (a hand-written loop, a fresh trainer), not a micro-batch of the drawn window
    explicit: bool
    count: Any = None  # an explicit call's num_items_in_batch: the target count of its window, all ranks
    drawn: Any = field(default=None, repr=False)  # the micro-batch as drawn (compute_loss gets it prepared)
    # its targets as drawn ("labels", "shift_labels"), copied at the step's start: a trainer may replace or edit them
    # in the same mapping
    drawn_targets: dict = field(default_factory=dict, repr=False)
    # the last loss hf_gradfix's compute_loss returned (already normalized), detached: read back only where the loss
    # reaching backward is another tensor (:func:`..trainer.windows._accumulation_division`), so a step whose loss
    # reaches backward as returned costs no host sync
    returned: Any = None
    returned_loss: Any = None  # (that loss tensor itself, its in-place version counter when returned)
    # (the drawn targets themselves, their in-place version counters): compute_loss given these, unedited, was given
    # the drawn targets, and needs no count to tell (a host sync per micro-batch)
    drawn_refs: dict = field(default_factory=dict, repr=False)
    rescaled_by: float | None = None  # a division by the accumulation steps after compute_loss, undone


@dataclass
class _EvalTotals:
    loss_sum: float = 0.0
    targets: float = 0.0
    aux_sum: float = 0.0
    aux_batches: float = 0.0
    batches: int = 0  # eval batches counted (through compute_loss or, outside it, by prediction_step)
    uncounted: float = 0.0  # eval batches whose loss could not be counted: eval_loss then stays stock's


@dataclass
class GradFixState:
    """Everything hf_gradfix knows about one trainer. Attached as ``trainer._gradfix``."""

    config: GradFixConfig
    source: str
    settings_from: str = "defaults"  # the sources whose settings combined into ``config`` (hf_gradfix.config.sources)
    planted_count_rule: Any = None  # a CountRule hf-gradfix verify --inject count_unshifted plants (a bug on purpose)
    probed: bool = False
    flags_set: bool = False
    chain_is_default: bool = True
    model: LossBehaviour | None = None  # the model's own loss
    default: LossBehaviour | None = None  # what _GradFixDefaultLoss produces (model / compute_loss_func / smoother)
    func: LossBehaviour | None = None  # compute_loss_func
    chain: LossBehaviour | None = None  # the effective compute_loss (user override, TRL, ...)
    aux_coef: float = 0.0
    window: _Window | None = None
    step: _Step | None = None  # the training_step in progress, if any
    ga_division_logged: bool = False  # the warning for a training_step that divides by the accumulation steps, once
    explicit_logged: bool = False  # the note for a training_step called without a count outside train(), once
    # set when the trainer trained on other targets than the micro-batch the loop drew (on-policy generation, a step
    # that relabels): the rest of that window runs as stock, and every rank leaves the fix at the next window
    rewritten: str | None = None
    eval_totals: _EvalTotals | None = None
    last_aux: Any = 0.0  # the last micro-batch's aux-loss share: a float, or a detached tensor read by eval only
    in_probe: bool = False
    no_labels_logged: bool = False
    disabled_reason: str | None = None  # set when a probe failed and on_undetermined is "warn"
    stock_window: bool = False  # this optimizer window runs exactly as stock transformers (probe deferred)
    deferred_logged: bool = False
    eval_outside_logged: bool = False  # the warning for an eval loss computed outside compute_loss, once
    packing_line: str | None = None  # what prepare_model_for_packing did, for the fix log
    optimizer_line: str | None = None  # which low-rank optimizer create_optimizer built, for the fix log
    saved_accepts_loss_kwargs: Any = None
    pp: Any = None  # the pipeline plan (hf_gradfix.integration.parallel.pipeline.PipelinePlan) when parallel.pp > 1
    rl: Any = None  # a TRL policy-gradient trainer's plan (hf_gradfix.integration.rl.plan.RLPlan)
    nd: Any = None  # the ND-parallel plan (hf_gradfix.integration.parallel.nd.NDPlan) when a mesh is in force
    moe: Any = None  # routing bookkeeping of a MoE model (hf_gradfix.integration.moe.MoEState)
    lean: Any = None  # loss.head: lean (hf_gradfix.integration.lean_head.LeanHead)
    fixes: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.config.loss.enabled and not self.in_probe and self.disabled_reason is None and not self.stock_window


def state_of(trainer: Trainer) -> GradFixState | None:
    """The :class:`GradFixState` of a fixed trainer (what the probes found, the fixes applied), or None.

    ``state.fixes`` is filled on the trainer's first batch with labels (the probes are lazy).

    >>> import hf_gradfix, transformers
    >>> hf_gradfix.state_of(object.__new__(transformers.Trainer)) is None   # a trainer nobody fixed
    True
    """
    return trainer.__dict__.get(_STATE_ATTR)


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def _nd_dims(trainer: Trainer):
    """The validated ND-parallel degrees (``ParallelDims``) of this trainer's mesh, or None."""
    state = state_of(trainer)
    plan = state.nd if state is not None else None
    return plan.dims if plan is not None else None


def _tp_size(trainer: Trainer) -> int:
    dims = _nd_dims(trainer)
    if dims is not None:
        return dims.tp
    get = getattr(trainer, "get_tp_size", None)
    return int(get()) if callable(get) else 1


def _dp_world(trainer: Trainer) -> int:
    """Replicas whose gradients DDP/FSDP average: the Trainer's own ``num_processes // tp`` factor
    (with a mesh: dp_replicate x dp_shard x cp, over which FSDP2 averages)."""
    dims = _nd_dims(trainer)
    if dims is not None:
        return dims.dp_cp
    return max(1, trainer.accelerator.num_processes // _tp_size(trainer))


def _replicated_divisor(trainer: Trainer) -> int:
    """Ranks that see the same batch (tp x cp x sp), mirroring transformers' own divisor.

    The window count is all-reduced over the world; ranks of one tp group hold the same tokens (checked on the
    first window by ``nd.check_window``) and CP counts full sequences before they are split, so dividing by
    tp x cp gives the sum over the data-parallel ranks alone."""
    dims = _nd_dims(trainer)
    if dims is not None:
        return dims.non_data_parallel
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and hasattr(pc, "non_data_parallel_size"):
        return max(1, int(pc.non_data_parallel_size))
    size = _tp_size(trainer)
    for name in ("get_cp_size", "get_sp_size"):
        get = getattr(trainer, name, None)
        if callable(get):
            size *= int(get())
    return max(1, size)


_PENDING_READS = "_gradfix_pending_reads"


def defer_read(trainer: Any, values: Any, on_read: Callable[[list[float]], None]) -> None:
    """Have ``values`` (a device tensor) read back with the plugin's next read of this trainer (the window's count),
    in the same transfer, and ``on_read`` called with them as floats; :func:`take_pending_reads` hands them over."""
    trainer.__dict__.setdefault(_PENDING_READS, []).append((values, on_read))


def take_pending_reads(trainer: Any) -> list:
    """The reads :func:`defer_read` left for this trainer (now the caller's to read and hand back), oldest first."""
    return trainer.__dict__.pop(_PENDING_READS, None) or []


def read_pending(pending: list, flat: list[float]) -> None:
    """Hand each deferred read its floats (``flat``: the pending tensors' values, in order)."""
    for values, on_read in pending:
        k = values.numel()
        on_read(flat[:k])
        flat = flat[k:]
