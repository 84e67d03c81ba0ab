"""A token-budget batch sampler: shuffle, pack (best-fit-decreasing), balance bins over ranks.

Pure math: imports numpy and ``torch.utils.data.Sampler`` only (no transformers, no
accelerate); numba is used through :mod:`.binpack` when installed.

Each epoch (a pure function of ``(lengths, budget, seed, epoch, num_replicas, ...)``, so
every rank computes the same plan on its own, with or without numba):

1. shuffle the sample indices with ``numpy.random.default_rng([seed, epoch])``;
2. pack them with Best-Fit-Decreasing (:func:`.binpack.pack_arrays`), globally or in
   groups of ``group_size`` shuffled samples;
3. make the bin count a multiple of ``num_replicas`` (W) **without dropping or duplicating a
   sample** (``drop_last=False``, the default): the ``n_bins % W`` least-filled bins (plus
   0..7 more groups of W, whichever gives the most even steps) are pooled and their samples
   re-dealt, longest first to the lightest bin, into the next multiple of W bins
   (:func:`_even_out_tail`). This adds fewer than W bins per epoch (1M lognormal samples on
   8 ranks: 2 bins, fill 99.995 % instead of 99.997 %) and replaces the ragged tail of BFD
   (a few half-empty bins) by evenly filled ones; it is also done when the count already
   divides, to even out the last steps. Only if no pool works (too few samples) are the
   least-filled multi-sample bins split; it raises only when there are fewer samples than
   bins needed, naming the alternatives. With ``drop_last=True`` the ``n_bins % W``
   least-filled bins are left out instead, and their samples are listed in
   ``EpochPlan.dropped``;
4. deal the bins to ranks in *steps*: bins sorted by tokens (descending) are cut into
   consecutive groups of W (one step: the bins all ranks process at the same time, so they
   are nearly the same size, which also minimizes the sum over steps of the slowest rank's
   tokens), and within a step the largest bin goes to the rank with the fewest tokens so
   far. Every rank gets exactly ``steps`` bins, and the difference between any two ranks'
   epoch token totals is at most the widest step (max minus min bin tokens within one
   step), which is at most ``budget``: by induction, giving a step's bins in descending
   order to the ranks in ascending order of load keeps ``max - min <= max(previous spread,
   this step's spread)``. Measured on lognormal lengths (budget 4096): 5 tokens of 6.1 M per
   rank (100k samples, 8 ranks), 340 of 61 M (1M samples, 8 ranks), 193 of 7.6 M (1M, 64
   ranks); see ``EpochPlan.rank_token_spread`` / ``step_token_spread``;
5. shuffle the order of the steps (``shuffle=True``).

Every rank therefore yields the same number of bins, and over an epoch the ranks together
yield every sample exactly once (unless ``oversize="drop"`` or ``drop_last=True`` were
asked for explicitly).

Two ways to shard:

- ``rank=k`` (plain DDP ``DataLoader`` per process): yields rank ``k``'s bins;
- ``rank="all"``: yields all ranks' bins interleaved, step by step (rank 0's bin, rank 1's,
  ...). Meant for ``accelerate``, whose ``BatchSamplerShard`` (used by ``Trainer`` under DDP)
  hands batch ``i`` to process ``i % num_processes``: each process then gets exactly the
  bins planned for it, and since the length is a multiple of ``num_processes`` nothing is
  looped back or repeated. (The sampler deliberately has no ``batch_size`` attribute:
  accelerate would otherwise expect equal-sized batches.)

``__len__`` is constant across epochs with the default global packing: BFD sees the same
multiset of lengths every epoch (only which of the equal-length samples goes where
changes), so it makes the same number of bins. With ``group_size`` set it may differ by a
few bins between epochs; ``Trainer`` reads the length once and runs that many steps every
epoch, so keep ``group_size=None`` under ``Trainer``.

Resume: ``state_dict()`` records the epoch and how many bins this sampler has handed out;
``load_state_dict()`` makes the next ``__iter__`` skip exactly those and yield the rest of the
epoch, identical to an uninterrupted run. With a prefetching ``DataLoader``
(``num_workers > 0``) the sampler runs ahead of the training loop: pass the number of
batches actually consumed, ``state_dict(consumed=n)``. (``Trainer`` resumes by replaying the
epoch and skipping batches, which works because the plan is deterministic.)

>>> s = PackedBatchSampler([5, 3, 8, 2, 6, 4], budget=8, num_replicas=2, rank=0, seed=0)
>>> len(s), sum(len(b) for b in s) + sum(len(b) for b in PackedBatchSampler([5, 3, 8, 2, 6, 4], 8, num_replicas=2, rank=1))
(2, 6)
"""

from __future__ import annotations

import hashlib
import heapq
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from torch.utils.data import Sampler

from ..errors import InvalidArgumentError, InvalidTypeError
from .binpack import (
    Backend,
    PackingStats,
    _check_budget,
    _csr_to_lists,
    _int_lengths,
    _pack_csr,
    _stats_from_bin_tokens,
    oversize_error,
)

__all__ = ["EpochPlan", "PackedBatchSampler"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class EpochPlan:
    """Everything one epoch of a :class:`PackedBatchSampler` will yield, for all ranks, as numpy arrays
    (built once per epoch; a rank reads its column of ``schedule``):

    - bin ``b`` holds the samples ``items[offsets[b]:offsets[b + 1]]`` (:meth:`bin`; ``bins`` lists them all);
      ``bin_tokens[b]``: its tokens;
    - ``schedule[step, rank]``: the bin that ``rank`` processes at ``step``;
    - ``rank_tokens[rank]``: tokens per rank over the epoch;
    - ``added_bins``: bins added (beyond the packer's) to make the count a multiple of
      ``num_replicas``, always ``< num_replicas``; ``repacked_bins``: the tail bins rebuilt for it
      (see :func:`_even_out_tail`);
    - ``dropped``: samples not in any bin (only with ``oversize="drop"`` or ``drop_last=True``).

    10M samples on 8 ranks: the plan keeps 65 MiB (int32 ``items``); building it takes about 2.7 s and peaks
    below 190 MiB with the lengths (numpy fallback), see ``benchmarks/results/packing-plan.md``.

    >>> plan = PackedBatchSampler([4, 4, 2, 2, 3], budget=4, num_replicas=2).plan()
    >>> plan.steps, plan.schedule.shape, int(plan.rank_tokens.sum())
    (2, (2, 2), 15)
    """

    epoch: int
    budget: int
    items: np.ndarray
    offsets: np.ndarray
    bin_tokens: np.ndarray
    schedule: np.ndarray
    rank_tokens: np.ndarray
    added_bins: int
    repacked_bins: int
    dropped: tuple[int, ...]
    #: compute cost per bin (``cost_coeff`` set: the sum of ``L * (c + L)`` over its documents), else None
    bin_costs: np.ndarray | None = None

    @property
    def n_bins(self) -> int:
        """Number of bins (all ranks).

        >>> PackedBatchSampler([3, 3, 3], budget=4).plan().n_bins
        3
        """
        return int(self.offsets.size - 1)

    def bin(self, b: int) -> list[int]:
        """The sample indices of bin ``b``.

        >>> PackedBatchSampler([3, 1], budget=4).plan().bin(0)
        [0, 1]
        """
        return self.items[self.offsets[b] : self.offsets[b + 1]].tolist()

    @property
    def bins(self) -> list[list[int]]:
        """All bins as lists of sample indices (built on demand: prefer :meth:`bin` / ``items`` at scale).

        >>> PackedBatchSampler([3, 1, 4], budget=4, shuffle=False).plan().bins
        [[2], [0, 1]]
        """
        return _csr_to_lists(self.items, self.offsets)

    @property
    def steps(self) -> int:
        """Bins per rank in this epoch.

        >>> PackedBatchSampler([3, 3, 3], budget=4).plan().steps
        3
        """
        return int(self.schedule.shape[0])

    @property
    def num_replicas(self) -> int:
        """Number of data-parallel ranks the plan is for.

        >>> PackedBatchSampler([3, 3], budget=4, num_replicas=2).plan().num_replicas
        2
        """
        return int(self.schedule.shape[1])

    @property
    def stats(self) -> PackingStats:
        """Fill/waste of the epoch's bins (see :class:`.binpack.PackingStats`).

        >>> PackedBatchSampler([3, 1, 2, 2], budget=4).plan().stats.fill
        1.0
        """
        return _stats_from_bin_tokens(
            self.bin_tokens,
            self.budget,
            n_samples=int(self.items.size),
            n_dropped=len(self.dropped),
        )

    @property
    def rank_token_spread(self) -> int:
        """Max minus min of the ranks' epoch token totals.

        >>> PackedBatchSampler([4, 4, 2, 2], budget=4, num_replicas=2).plan().rank_token_spread
        0
        """
        return int(self.rank_tokens.max() - self.rank_tokens.min()) if self.rank_tokens.size else 0

    @property
    def step_token_spread(self) -> int:
        """The largest within-step spread (max minus min bin tokens of one step): the bound
        on :attr:`rank_token_spread`, and the worst per-step imbalance between ranks.

        >>> PackedBatchSampler([4, 4, 2, 2], budget=4, num_replicas=2).plan().step_token_spread
        0
        """
        if not self.schedule.size:
            return 0
        t = self.bin_tokens[self.schedule]
        return int((t.max(axis=1) - t.min(axis=1)).max())

    def step_imbalance(self, costs: np.ndarray | None = None) -> float:
        """The mean over steps of max / mean over ranks of ``costs`` per bin (default: tokens; pass
        ``bin_costs`` for compute): 1.0 when every rank's bin of a step is as large as the others, so no rank waits.

        >>> PackedBatchSampler([4, 4, 2, 2], budget=4, num_replicas=2).plan().step_imbalance()
        1.0
        """
        values = (self.bin_tokens if costs is None else costs).astype(np.float64)
        if not self.schedule.size:
            return 1.0
        per_step = values[self.schedule]
        mean = per_step.mean(axis=1)
        ok = mean > 0
        return float((per_step.max(axis=1)[ok] / mean[ok]).mean()) if ok.any() else 1.0

    def rank_bins(self, rank: int) -> list[list[int]]:
        """The bins ``rank`` yields this epoch, in order.

        >>> PackedBatchSampler([4, 4, 2, 2], budget=4, num_replicas=2, shuffle=False).plan().rank_bins(1)
        [[1], [3]]
        """
        return [self.bin(b) for b in self.schedule[:, rank].tolist()]


class PackedBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding one packed bin (a list of dataset indices, total length
    ``<= budget``) per batch; see the module docstring for the per-epoch algorithm.

    Args:
        lengths: token count of every dataset sample (e.g. ``dataset["length"]``), ints >= 1.
        budget: tokens per bin (one packed row).
        num_replicas: data-parallel world size.
        rank: this process's rank, or ``"all"`` to yield every rank's bins interleaved
            (for accelerate's ``BatchSamplerShard``, i.e. ``Trainer`` under DDP).
        seed: shuffling seed (same on every rank).
        shuffle: shuffle samples before packing and steps after it; ``False`` gives a fixed
            order (steps by decreasing tokens).
        drop_last: ``False`` (default) re-deals the least-filled bins into more bins so the
            count divides ``num_replicas`` (no sample lost, none repeated); ``True`` leaves the
            ``n_bins % num_replicas`` least-filled bins out of the epoch instead.
        group_size: pack shuffled groups of this many samples separately (more variety of
            bin contents across epochs, slightly lower fill); ``None`` packs globally.
        oversize: samples longer than ``budget``: ``"error"`` (default) or ``"drop"`` (left
            out with a warning, listed in ``EpochPlan.dropped``). Splitting is not possible
            here, since a batch sampler yields whole indices: split long samples in the
            dataset, or use :func:`.binpack.pack` with ``oversize="split"``.
        backend: packing backend, see :func:`.binpack.pack_arrays`.

    Call ``set_epoch(epoch)`` before each epoch (``Trainer`` does), or every epoch repeats
    epoch 0's order.

    >>> lengths = [5, 3, 8, 2, 6, 4, 7, 1]
    >>> s = PackedBatchSampler(lengths, budget=8, num_replicas=2, rank=0, seed=1)
    >>> s.set_epoch(0)
    >>> bins = list(s)
    >>> len(bins) == len(s) and all(sum(lengths[i] for i in b) <= 8 for b in bins)
    True
    """

    def __init__(
        self,
        lengths: Any,
        budget: int,
        *,
        num_replicas: int = 1,
        rank: int | Literal["all"] = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        group_size: int | None = None,
        oversize: Literal["error", "drop"] = "error",
        backend: Backend = "auto",
        cost_coeff: float | None = None,
    ) -> None:
        super().__init__()
        if cost_coeff is not None and (isinstance(cost_coeff, bool) or not isinstance(cost_coeff, (int, float))
                                       or not np.isfinite(cost_coeff) or cost_coeff < 0):
            raise InvalidArgumentError(f"cost_coeff must be None (balance tokens) or a finite number >= 0 (the c of "
                                       f"the cost L * (c + L)), got {cost_coeff!r}")
        self.cost_coeff = None if cost_coeff is None else float(cost_coeff)
        self.budget = _check_budget(budget)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        self.num_replicas = int(num_replicas)
        if rank != "all":
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
                raise InvalidArgumentError(f"rank must be 'all' or an int in [0, {num_replicas}), got {rank!r}")
            rank = int(rank)
        self.rank: int | Literal["all"] = rank
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InvalidArgumentError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1
        ):
            raise InvalidArgumentError(f"group_size must be None or an int >= 1, got {group_size!r}")
        self.group_size = None if group_size is None else int(group_size)
        if oversize == "split":
            raise InvalidArgumentError(
                "PackedBatchSampler cannot split samples (it yields whole dataset indices): split samples "
                f"longer than the budget ({self.budget}) in the dataset itself, raise the budget, or use "
                "hf_gradfix.packing.binpack.pack(..., oversize='split') with a span-aware collator"
            )
        if oversize not in ("error", "drop"):
            raise InvalidArgumentError(f"oversize must be 'error' or 'drop', got {oversize!r}")
        self.oversize = oversize
        self.backend: Backend = backend
        lengths = _int_lengths(lengths)  # validated, no int64 copy of an int32 array
        # an own copy, int32 when it fits: half the memory of int64 at 10M+ samples
        self.lengths = lengths.astype(np.int32 if int(lengths.max(initial=0)) < 2**31 else np.int64, copy=True)
        del lengths
        over = np.flatnonzero(self.lengths > self.budget)
        if over.size and oversize == "error":
            raise oversize_error(  # type: ignore[misc]
                self.lengths,
                self.budget,
                split_fix="split them into budget-sized pieces in the dataset itself (this sampler yields whole "
                "samples), pass oversize='drop' to leave them out explicitly",
            )
        if over.size:
            warnings.warn(
                f"PackedBatchSampler(oversize='drop'): {over.size} sample(s) longer than the budget of "
                f"{self.budget} tokens are left out of every epoch (first: sample {int(over[0])} with "
                f"{int(self.lengths[over[0]])} tokens); they are listed in plan().dropped",
                UserWarning,
                stacklevel=2,
            )
        self._oversize_dropped = over
        self._fingerprint = self._make_fingerprint()
        self._epoch = 0
        self._resume = 0  # bins to skip at the next __iter__ (set by load_state_dict)
        self._yielded = 0  # bins handed out in epoch self._yielded_epoch
        self._yielded_epoch = 0
        self._cache: tuple[int, EpochPlan] | None = None

    # ------------------------------------------------------------------ epoch / length

    @property
    def epoch(self) -> int:
        """The epoch the next ``__iter__`` plays.

        >>> PackedBatchSampler([1], budget=4).epoch
        0
        """
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to play (the shuffle depends on ``(seed, epoch)``). Moving to
        another epoch discards a pending resume position.

        >>> s = PackedBatchSampler([3, 2, 2, 1], budget=4)
        >>> s.set_epoch(3); s.epoch
        3
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise InvalidArgumentError(f"epoch must be a non-negative int, got {epoch!r}")
        epoch = int(epoch)
        if epoch != self._epoch:
            self._resume = 0
        self._epoch = epoch

    def __len__(self) -> int:
        """Bins this sampler yields in the current epoch (all ranks' if ``rank="all"``).

        >>> len(PackedBatchSampler([3, 2, 2, 1], budget=4, num_replicas=2, rank="all"))
        2
        """
        steps = self.plan().steps
        return steps * self.num_replicas if self.rank == "all" else steps

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this epoch's bins (lists of dataset indices) for ``rank``, skipping the bins
        a loaded state says were already handed out.

        >>> [sorted(b) for b in PackedBatchSampler([3, 1, 4], budget=4, shuffle=False)]
        [[2], [0, 1]]
        """
        plan = self.plan()
        epoch = self._epoch
        start = self._resume
        self._resume = 0
        cols = list(range(self.num_replicas)) if self.rank == "all" else [self.rank]
        sched = plan.schedule[:, cols].reshape(-1).tolist()  # this stream's bins, in order
        self._yielded_epoch = epoch
        self._yielded = min(start, len(sched))
        items, offsets = plan.items, plan.offsets
        for p in range(self._yielded, len(sched)):
            self._yielded = p + 1
            b = sched[p]
            yield items[offsets[b] : offsets[b + 1]].tolist()

    # ------------------------------------------------------------------ state

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resume point: epoch and bins handed out in it (or ``consumed``, the batches the
        training loop actually used, when a prefetching DataLoader runs ahead).

        >>> s = PackedBatchSampler([3, 2, 2, 1, 4], budget=4)
        >>> it = iter(s); _ = next(it)
        >>> st = s.state_dict(); (st["epoch"], st["yielded"])
        (0, 1)
        """
        if self._resume:
            yielded = self._resume
        elif self._yielded_epoch == self._epoch:
            yielded = self._yielded
        else:
            yielded = 0
        if consumed is not None:
            if isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer)):
                raise InvalidTypeError(f"consumed must be an int, got {consumed!r}")
            if not 0 <= consumed <= len(self):
                raise InvalidArgumentError(f"consumed must be in [0, {len(self)}] (bins in this epoch), got {consumed}")
            yielded = int(consumed)
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "yielded": int(yielded),
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "budget": self.budget,
            "n_samples": int(self.lengths.size),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``__iter__`` plays ``state["epoch"]`` from bin ``state["yielded"]``
        on, identical to the uninterrupted run. Raises ``ValueError`` if the state belongs to
        a sampler with other lengths or settings.

        >>> a = PackedBatchSampler([3, 2, 2, 1, 4, 1], budget=4, seed=5)
        >>> it = iter(a); first = next(it)
        >>> b = PackedBatchSampler([3, 2, 2, 1, 4, 1], budget=4, seed=5)
        >>> b.load_state_dict(a.state_dict())
        >>> [first] + list(b) == list(PackedBatchSampler([3, 2, 2, 1, 4, 1], budget=4, seed=5))
        True
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise InvalidArgumentError(f"not a PackedBatchSampler state (version {_STATE_VERSION}): {state!r}")
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state.get(k)!r}, here {mine[k]!r}"
            for k in ("n_samples", "budget", "seed", "num_replicas", "rank", "fingerprint")
            if state.get(k) != mine[k]
        ]
        if diffs:
            raise InvalidArgumentError(
                "cannot resume: the state was saved by a sampler with different data or settings ("
                + "; ".join(diffs)
                + "); the rest of the epoch would not match the interrupted run"
            )
        epoch = state["epoch"]
        yielded = state["yielded"]
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(yielded, int) or yielded < 0:
            raise InvalidArgumentError(f"bad epoch/yielded in state: {epoch!r}/{yielded!r}")
        total = self.plan(epoch).steps * (self.num_replicas if self.rank == "all" else 1)
        if yielded > total:
            raise InvalidArgumentError(f"state says {yielded} bins were yielded, but epoch {epoch} has only {total}")
        self._epoch = epoch
        self._resume = yielded

    # ------------------------------------------------------------------ planning

    def _make_fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for a in range(0, self.lengths.size, 1 << 20):  # the int64 bytes, hashed by chunks (no n-sized copy)
            h.update(np.ascontiguousarray(self.lengths[a : a + (1 << 20)], dtype="<i8").tobytes())
        h.update(
            repr(
                (self.budget, self.seed, self.shuffle, self.drop_last, self.group_size, self.oversize, self.num_replicas)
            ).encode()
        )
        if self.cost_coeff is not None:  # another deal is another plan (token-balanced fingerprints stay as they were)
            h.update(repr(("cost_coeff", self.cost_coeff)).encode())
        return h.hexdigest()

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The full plan of ``epoch`` (default: the current one), for all ranks. Cached for
        the last epoch asked for.

        >>> p = PackedBatchSampler([3, 2, 2, 1], budget=4, num_replicas=2).plan()
        >>> sorted(p.items.tolist()), p.steps
        ([0, 1, 2, 3], 1)
        """
        epoch = self._epoch if epoch is None else int(epoch)
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        plan = self._build_plan(epoch)
        self._cache = (epoch, plan)
        return plan

    def _build_plan(self, epoch: int) -> EpochPlan:
        W = self.num_replicas
        lengths = self.lengths
        rng = np.random.default_rng([self.seed, epoch])
        n = lengths.size
        index_dtype = np.int32 if n < 2**31 else np.int64
        order = np.arange(n, dtype=index_dtype)
        if self.shuffle:  # = rng.permutation(n) (same draws), without its int64 array
            rng.shuffle(order)
        dropped: list[int] = []
        if self._oversize_dropped.size:
            order = order[lengths[order] <= self.budget]
            dropped.extend(self._oversize_dropped.tolist())
        # 1-2. pack (globally or per group of shuffled samples), kept as CSR arrays (items, offsets)
        g = order.size if self.group_size is None else self.group_size
        parts_items, parts_offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        if g >= order.size:  # one group: hand `order` over, so it is freed once mapped (memory at 10M+)
            holder = [order]
            del order
            items, offsets = _pack_csr(lengths, self.budget, self.backend, subset=holder)
            parts_items.append(items)
            parts_offsets.append(offsets[1:])
            del items, offsets
        else:
            for start in range(0, order.size, max(g, 1)):
                items, offsets = _pack_csr(lengths, self.budget, self.backend, subset=order[start : start + g])
                parts_items.append(items)
                parts_offsets.append(offsets[1:] + base)
                base += int(offsets[-1])
                del items, offsets
            del order
        items = parts_items[0] if len(parts_items) == 1 else np.concatenate([np.zeros(0, dtype=index_dtype), *parts_items])
        offsets = np.concatenate(parts_offsets)
        del parts_items, parts_offsets
        tokens = _csr_tokens(items, offsets, lengths)
        # 3. bin count -> multiple of W, without losing or repeating a sample
        added = repacked = 0
        rem = (offsets.size - 1) % W
        if rem and self.drop_last:
            by_tokens = np.lexsort((np.arange(tokens.size), tokens))
            gone = np.sort(by_tokens[:rem])
            for b in gone.tolist():
                dropped.extend(items[offsets[b] : offsets[b + 1]].tolist())
            items, offsets, tokens = _csr_replace(items, offsets, tokens, gone, [], lengths)
        if W > 1 and offsets.size > 1:
            before = offsets.size - 1
            items, offsets, tokens, repacked = _even_out_tail(items, offsets, tokens, lengths, W, self.budget)
            added = offsets.size - 1 - before
            if (offsets.size - 1) % W:
                raise InvalidArgumentError(
                    f"epoch {epoch}: {before} bins cannot be dealt evenly to {W} ranks without dropping or "
                    f"repeating a sample: there are not enough samples ({items.size}) to make "
                    f"{-(-before // W) * W} bins. "
                    "Use drop_last=True to leave the least-filled bins out of each epoch, fewer ranks, "
                    "or a smaller budget"
                )
        # 4. deal: steps of W bins of similar size; biggest bin to the lightest rank. With cost_coeff: sized by
        # compute (attention grows with L**2, so bins of equal tokens differ), tokens per rank then follow
        costs = None
        if self.cost_coeff is not None and offsets.size > 1:
            from .balance import document_cost

            costs = np.add.reduceat(document_cost(lengths[items], self.cost_coeff), offsets[:-1])
            schedule, _ = _deal(costs, W)
            loads = tokens[schedule].sum(axis=0).astype(np.int64)
        else:
            schedule, loads = _deal(tokens, W)
        K = schedule.shape[0]
        # 5. step order
        if self.shuffle and K:
            schedule = schedule[rng.permutation(K)]
        return EpochPlan(
            epoch=epoch,
            budget=self.budget,
            items=items,
            offsets=offsets,
            bin_tokens=tokens,
            schedule=schedule,
            rank_tokens=loads,
            added_bins=added,
            repacked_bins=repacked,
            dropped=tuple(sorted(dropped)),
            bin_costs=costs,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_samples={self.lengths.size}, budget={self.budget}, "
            f"num_replicas={self.num_replicas}, rank={self.rank!r}, seed={self.seed}, epoch={self._epoch})"
        )


def _csr_tokens(items: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens per bin of a CSR packing (int64)."""
    if offsets.size <= 1:
        return np.zeros(0, dtype=np.int64)
    # a bin holds at most `budget` tokens, so the lengths' own (int32) dtype cannot overflow; no int64 copy
    return np.add.reduceat(lengths[items], offsets[:-1], dtype=lengths.dtype).astype(np.int64)


def _csr_replace(
    items: np.ndarray,
    offsets: np.ndarray,
    tokens: np.ndarray,
    remove: np.ndarray,
    new_bins: list[list[int]],
    lengths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Remove the bins ``remove`` (few) and append ``new_bins``; the other bins keep their order."""
    remove = np.unique(np.asarray(remove, dtype=np.int64))
    new_sizes = np.array([len(x) for x in new_bins], dtype=np.int64)
    n_keep = int(items.size - (offsets[remove + 1] - offsets[remove]).sum())
    out = np.empty(n_keep + int(new_sizes.sum()), dtype=items.dtype)
    sizes = np.empty(offsets.size - 1 - remove.size + new_sizes.size, dtype=np.int64)
    # copy the kept stretches between the (few) removed bins: no mask or copy of the n-sized items
    pos = bpos = 0
    prev = 0
    for b in [*remove.tolist(), offsets.size - 1]:
        seg = items[offsets[prev] : offsets[b]]
        out[pos : pos + seg.size] = seg
        pos += seg.size
        sizes[bpos : bpos + b - prev] = np.diff(offsets[prev : b + 1])
        bpos += b - prev
        prev = b + 1
    out[pos:] = np.fromiter((i for x in new_bins for i in x), dtype=items.dtype, count=out.size - pos)
    sizes[bpos:] = new_sizes
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    keep_bin = np.ones(tokens.size, dtype=bool)
    keep_bin[remove] = False
    new_tokens = np.array([int(lengths[x].sum()) for x in new_bins], dtype=np.int64)
    return out, offsets, np.concatenate((tokens[keep_bin], new_tokens))


def _deal(tokens: np.ndarray, W: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps of ``W`` bins sorted by size (``tokens``, or any cost per bin; descending); within a step the largest
    bin goes to the rank with the least so far. Returns ``(schedule[K, W], loads[W])`` (loads in ``tokens``' dtype)."""
    K = tokens.size // W
    by_size = np.lexsort((np.arange(tokens.size), -tokens))  # tokens descending, ties by id
    if W == 1:
        return by_size.reshape(K, 1).astype(np.int64), np.array([tokens.sum()], dtype=tokens.dtype)
    chunks = by_size.reshape(K, W)
    # Sequential over steps (each step depends on the loads so far), but only the rank ORDER is computed in
    # Python; the bins are then placed with one vectorized scatter.
    loads = [0] * W
    ranks = list(range(W))
    key = loads.__getitem__
    schedule = np.empty((K, W), dtype=np.int64)
    block = 4096  # steps converted to Python ints at a time (a whole-epoch .tolist() costs ~100 MB at 10M samples)
    for s0 in range(0, K, block):
        chunk_tokens = tokens[chunks[s0 : s0 + block]].tolist()
        perms: list[tuple[int, ...]] = []
        for step_tokens in chunk_tokens:
            ranks.sort(key=key)  # stable: ties keep the previous order
            for t, r in zip(step_tokens, ranks):
                loads[r] += t
            perms.append(tuple(ranks))
        np.put_along_axis(schedule[s0 : s0 + block], np.array(perms, dtype=np.int64), chunks[s0 : s0 + block], axis=1)
    return schedule, np.asarray(loads, dtype=tokens.dtype)


def _lpt(items: list[int], lengths: np.ndarray, n_bins: int, budget: int) -> list[list[int]] | None:
    """Longest-processing-time: items (longest first) each to the currently lightest of
    ``n_bins`` bins. ``None`` if a bin would exceed ``budget`` or stay empty."""
    if len(items) < n_bins:
        return None
    heap = [(0, b) for b in range(n_bins)]  # (tokens, bin): ties go to the lowest bin
    out: list[list[int]] = [[] for _ in range(n_bins)]
    for i in sorted(items, key=lambda i: (-int(lengths[i]), i)):
        t, b = heapq.heappop(heap)
        t += int(lengths[i])
        if t > budget:
            return None
        out[b].append(i)
        heapq.heappush(heap, (t, b))
    return out


def _max_step_spread(sorted_tokens: np.ndarray, W: int) -> int:
    """Widest step if bins sorted by tokens (``sorted_tokens``: ascending) are dealt in consecutive groups of ``W``."""
    t = sorted_tokens[::-1].reshape(-1, W)
    return int((t[:, 0] - t[:, -1]).max()) if t.size else 0


def _even_out_tail(
    items: np.ndarray, offsets: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, W: int, budget: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Make the bin count a multiple of ``W`` without dropping or repeating a sample, and keep
    the steps balanced.

    Candidates: pool the ``k`` least-filled bins, ``k = n_bins % W + j * W`` for
    ``j = 0..7`` (``j >= 1`` when the count already divides), and re-deal their samples,
    longest first to the lightest bin, into the next multiple of ``W`` bins. A candidate is
    valid if no bin overflows or stays empty; the one whose widest step (bins sorted by
    tokens, dealt ``W`` at a time) is narrowest wins, smaller pools on ties; when the count
    already divides, leaving the bins as they are is a candidate too. If no candidate is
    valid (too few samples in the pools), the least-filled bins holding two or more samples
    are split in two until the count divides; the caller raises if even that fails (fewer
    samples than bins needed). Works on the CSR arrays (only the pooled bins become lists).
    Returns ``(items, offsets, tokens, repacked)`` with ``repacked`` the number of bins pooled.
    """
    B = tokens.size
    rem = B % W
    # least-filled first, ties by id (a stable sort; radix on 16-bit keys)
    by_fill = np.argsort(tokens.astype(np.uint16) if budget < 1 << 16 else tokens, kind="stable")
    sorted_tokens = tokens[by_fill]  # ascending
    best: tuple[int, int, np.ndarray, list[list[int]]] | None = None  # (spread, k, pool bins, new bins)
    if not rem:
        best = (_max_step_spread(sorted_tokens, W), 0, by_fill[:0], [])
    pooled_samples = 0
    for j in range(0 if rem else 1, 8):
        k = rem + j * W
        if k > B or pooled_samples > 200_000:
            break
        pool_bins = by_fill[:k]
        pool = [i for b in pool_bins.tolist() for i in items[offsets[b] : offsets[b + 1]].tolist()]
        pooled_samples = len(pool)
        new = _lpt(pool, lengths, -(-k // W) * W, budget)
        if new is None:
            continue
        new_tok = np.fromiter((int(lengths[x].sum()) for x in new), dtype=np.int64, count=len(new))
        # the kept bins are already sorted: a stable (run-merging) sort of the concatenation is linear
        spread = _max_step_spread(np.sort(np.concatenate((sorted_tokens[k:], np.sort(new_tok))), kind="stable"), W)
        if best is None or spread < best[0]:
            best = (spread, k, pool_bins, new)
    if best is not None:
        _, k, pool_bins, new = best
        if not k:
            return items, offsets, tokens, 0
        pool_bins = np.sort(pool_bins)  # a copy: the bin-sized arrays go before _csr_replace allocates
        del best, by_fill, sorted_tokens
        items, offsets, tokens = _csr_replace(items, offsets, tokens, pool_bins, new, lengths)
        return items, offsets, tokens, k
    # last resort (few samples): split the least-filled multi-sample bins (ties: lowest bin id)
    bins = _csr_to_lists(items, offsets)
    tok = tokens.tolist()
    heap = [(t, b) for b, t in enumerate(tok) if len(bins[b]) >= 2]
    heapq.heapify(heap)
    for _ in range(W - rem):
        if not heap:
            break
        _, b = heapq.heappop(heap)
        halves = _lpt(bins[b], lengths, 2, budget)
        assert halves is not None  # two halves of a bin within budget always fit
        bins[b], second = halves
        tok[b] = int(lengths[bins[b]].sum())
        bins.append(second)
        tok.append(int(lengths[second].sum()))
        for x in (b, len(bins) - 1):
            if len(bins[x]) >= 2:
                heapq.heappush(heap, (tok[x], x))
    sizes = np.array([len(x) for x in bins], dtype=np.int64)
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.fromiter((i for x in bins for i in x), dtype=items.dtype, count=int(offsets[-1]))
    return flat, offsets, np.asarray(tok, dtype=np.int64), 0
