"""Online packing of a stream (``torch.utils.data.IterableDataset``, ``datasets.IterableDataset`` including
``streaming=True``): a bounded buffer packed best-fit-decreasing, rows dealt evenly to data-parallel ranks,
resumable from a small state (stream position + buffer).

A map-style dataset is packed per epoch from all lengths at once (:class:`~.sampler.PackedBatchSampler`); a stream
has no lengths up front. :class:`StreamingPacker` reads samples into a buffer of ``buffer_size`` samples; when it
is full, it packs the buffer with Best-Fit-Decreasing (:func:`.binpack.pack_arrays`), emits the bins that are
full enough (``tokens >= min_fill * budget``), fullest first, and carries the samples of the others over to be
combined with the next samples (at most half the buffer is carried, so the stream always advances). At the end
of the stream the rest is packed and emitted, and the last bins are split so that the number of rows is a
multiple of ``num_replicas``.

Sharding: the packer produces ONE global sequence of rows (a pure function of the stream and the settings), and
row ``i`` belongs to rank ``i % num_replicas``. ``rank=k`` yields rank ``k``'s rows; ``rank="all"`` yields them
all, interleaved (for accelerate, whose ``IterableDatasetShard`` deals element ``i`` to process ``i % W``, i.e.
``Trainer`` under DDP). Every rank therefore gets different samples and exactly the same number of rows, so no
rank waits at the end of a stream. (Every process reads the whole stream to reproduce the global sequence; the
packing itself is cheap, the reading and tokenizing are duplicated. Reading only a per-rank shard, e.g.
``datasets.distributed.split_dataset_by_node``, would give each rank a different number of rows, and equal rows
per step would then need a collective agreement inside the data loader at the end of the stream; not done.)

Resume: :meth:`StreamingPacker.state_dict` is the stream position (samples read), the buffered samples, the rows
already packed but not yet handed out, and the rows handed out; :meth:`~StreamingPacker.load_state_dict` continues
from there (advancing the stream to its position without packing, collating or training on anything before it),
yielding exactly the rows the uninterrupted run would have yielded. ``state_dict(rows=R)`` gives the state as it
was after ``R`` rows (a recent history is kept), for a consumer that reads ahead of what it trained on: the
``Trainer`` stores it in every checkpoint (``hf_gradfix_stream_rank{process}.pt``, ``torch.load(weights_only=True)``)
and ``resume_from_checkpoint`` continues the packer from it.

Each element yielded is one bin: a list of sample dicts, ready for :class:`~.collator.PackedCollator`.

>>> stream = [{"input_ids": list(range(n))} for n in (5, 3, 8, 2, 6, 4, 7, 1)]
>>> packer = StreamingPacker(stream, token_budget=8, buffer_size=4)
>>> [[len(s["input_ids"]) for s in row] for row in packer]
[[8], [5, 3], [6, 2], [7, 1], [4]]
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
from torch.utils.data import IterableDataset

from ..errors import InvalidArgumentError
from .binpack import pack_arrays
from .collator import PackedBatchError

__all__ = ["StreamingPacker"]

_STATE_VERSION = 1


def _length(sample: Any, index: int, budget: int) -> int:
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        keys = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
        raise PackedBatchError(
            f"stream sample {index}, column 'input_ids': missing ({keys}). Fix: tokenize the stream first "
            "(dataset.map(tokenize)), every sample needs 'input_ids'."
        )
    ids = sample["input_ids"]
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise PackedBatchError(
            f"stream sample {index}, column 'input_ids': has shape {tuple(shape)}. Fix: one flat unpadded sample per "
            "element (do not batch the stream)."
        )
    n = len(ids)
    if n == 0:
        raise PackedBatchError(f"stream sample {index}, column 'input_ids': is empty (0 tokens). Fix: filter empty samples out of the stream.")
    if n > budget:
        raise PackedBatchError(
            f"stream sample {index}, column 'input_ids': has {n} tokens, more than packing.token_budget={budget}. "
            "Fix: raise the budget, or truncate/split long samples in the stream (nothing is truncated silently)."
        )
    return n


class StreamingPacker(IterableDataset):
    """Pack a stream of tokenized samples into bins of at most ``token_budget`` tokens (see the module docstring).

    Args:
        dataset: any iterable of sample dicts with ``input_ids`` (a torch or ``datasets`` ``IterableDataset``,
            a generator function's result is NOT re-iterable: pass an iterable).
        token_budget: tokens per bin (one packed row).
        buffer_size: samples packed together (the knob: larger fills better, holds more samples in memory).
        min_fill: a bin is emitted once it holds ``>= min_fill * token_budget`` tokens; emptier bins wait for
            more samples (within the half-buffer carry limit).
        num_replicas: data-parallel world size.
        rank: this process's rank, or ``"all"`` for every rank's rows interleaved (accelerate / ``Trainer``).
        vocab_size / label_vocab_size: when given, every sample is checked as it is read (as
            :func:`.validate.validate_packing_dataset` checks a map-style dataset: dtypes, dimensions, label and
            mask lengths, padding, ids within the vocabulary), errors naming the stream index and the column.

    >>> p = StreamingPacker([{"input_ids": [1] * n} for n in (3, 3, 2, 2, 4, 1)], token_budget=5, buffer_size=3,
    ...                     num_replicas=2, rank=0)
    >>> rows = list(p); len(rows) == len(list(StreamingPacker(p.dataset, 5, buffer_size=3, num_replicas=2, rank=1)))
    True
    """

    def __init__(
        self,
        dataset: Iterable[Mapping[str, Any]],
        token_budget: int,
        *,
        buffer_size: int = 1000,
        min_fill: float = 0.98,
        num_replicas: int = 1,
        rank: int | Literal["all"] = "all",
        vocab_size: int | None = None,
        label_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise InvalidArgumentError(f"token_budget must be a positive int, got {token_budget!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 2:
            raise InvalidArgumentError(f"buffer_size must be an int >= 2 (samples packed together), got {buffer_size!r}")
        if not 0.0 <= float(min_fill) <= 1.0:
            raise InvalidArgumentError(f"min_fill must be in [0, 1], got {min_fill!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if rank != "all" and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas):
            raise InvalidArgumentError(f"rank must be 'all' or an int in [0, {num_replicas}), got {rank!r}")
        self.dataset = dataset
        self.token_budget = token_budget
        self.buffer_size = buffer_size
        self.min_fill = float(min_fill)
        self.num_replicas = num_replicas
        self.rank = rank
        self.vocab_size = vocab_size
        self.label_vocab_size = label_vocab_size
        self._epoch = 0
        self._resume: dict[str, Any] | None = None
        # live position of the current iteration (for state_dict)
        self._read = 0
        self._buffer: list[Mapping[str, Any]] = []
        self._pending: list[list[Mapping[str, Any]]] = []
        self._rows = 0
        # (rows handed out before, samples read, carried buffer, packed rows) at each pack of the current pass:
        # the state at any recent row count (state_dict(rows=...)), for a consumer that reads ahead of training
        self._history: list[tuple[int, int, list[Mapping[str, Any]], list[list[Mapping[str, Any]]]]] = []
        self.history_rows = 64 * num_replicas
        self.tokens_emitted = 0
        self.rows_emitted = 0

    # ------------------------------------------------------------------ epoch
    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the stream (``datasets.IterableDataset`` reshuffles per epoch).

        >>> StreamingPacker([], 4).set_epoch(1)
        """
        self._epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # ------------------------------------------------------------------ packing
    def _pack(self, buffer: list[Mapping[str, Any]], lengths: list[int], final: bool) -> tuple[list[list[Mapping[str, Any]]], list[Mapping[str, Any]]]:
        """BFD over the buffer: (bins to emit, fullest first; samples carried over)."""
        items, offsets = pack_arrays(np.asarray(lengths, dtype=np.int64), self.token_budget, backend="numpy")
        lens = np.asarray(lengths, dtype=np.int64)
        tokens = np.add.reduceat(lens[items], offsets[:-1])
        order = np.lexsort((np.arange(tokens.size), -tokens)).tolist()  # fullest first, ties in opening order
        bins = [items[offsets[b] : offsets[b + 1]].tolist() for b in order]
        if final:
            return [[buffer[i] for i in b] for b in bins], []
        emit, carry = [], []
        carried = 0
        limit = self.buffer_size // 2
        threshold = self.min_fill * self.token_budget
        for b, t in zip(reversed(bins), reversed(tokens[order].tolist())):  # emptiest first
            if t < threshold and carried + len(b) <= limit:
                carry.append(b)
                carried += len(b)
            else:
                emit.append(b)
        emit.reverse()
        return [[buffer[i] for i in b] for b in emit], [buffer[i] for b in reversed(carry) for i in b]

    def _even_tail(self, rows: list[list[Mapping[str, Any]]], done: int) -> list[list[Mapping[str, Any]]]:
        """Split the emptiest multi-sample rows until ``done + len(rows)`` is a multiple of ``num_replicas``."""
        W = self.num_replicas
        while (done + len(rows)) % W:
            splittable = [k for k, r in enumerate(rows) if len(r) >= 2]
            if not splittable:
                merged = self._merge_for_tail(rows, done)
                if merged is not None:
                    return merged
                extra = (done + len(rows)) % W
                warnings.warn(
                    f"StreamingPacker: the stream ended with {done + len(rows)} rows, not a multiple of "
                    f"num_replicas={W}; its last rows hold one sample each and cannot be merged within the budget, so "
                    f"the last {extra} row(s) are left out so that every rank gets the same number of rows.",
                    UserWarning,
                    stacklevel=3,
                )
                return rows[: len(rows) - extra]
            k = min(splittable, key=lambda k: (sum(len(s["input_ids"]) for s in rows[k]), -k))
            row = sorted(rows.pop(k), key=lambda s: -len(s["input_ids"]))
            halves: list[list[Mapping[str, Any]]] = [[], []]
            loads = [0, 0]
            for s in row:  # longest first to the lighter half
                h = 0 if loads[0] <= loads[1] else 1
                halves[h].append(s)
                loads[h] += len(s["input_ids"])
            rows.extend(halves)
        return sorted(rows, key=lambda r: -sum(len(s["input_ids"]) for s in r))

    def _checked_length(self, sample: Any, index: int) -> int:
        if self.vocab_size is None and self.label_vocab_size is None:
            return _length(sample, index, self.token_budget)
        from .validate import PackedDataError, _Checker, _Problem

        label_vocab = self.vocab_size if self.label_vocab_size is None else self.label_vocab_size
        try:
            check = _Checker(self.vocab_size, label_vocab, self.token_budget, -100).rows([sample])
        except _Problem as p:
            raise PackedDataError(f"stream sample {index}, column '{p.column}': {p.what}. Fix: {p.fix}.") from None
        return int(check.lengths[0])

    def _merge_for_tail(self, rows: list[list[Mapping[str, Any]]], done: int) -> list[list[Mapping[str, Any]]] | None:
        """Merge the emptiest rows pairwise (within the budget) until the row count divides ``num_replicas``."""
        rows = sorted(rows, key=lambda r: sum(len(s["input_ids"]) for s in r))
        while (done + len(rows)) % self.num_replicas:
            if len(rows) < 2:
                return None
            a, b = rows[0], rows[1]
            if sum(len(s["input_ids"]) for s in a + b) > self.token_budget:
                return None
            rows = sorted([a + b, *rows[2:]], key=lambda r: sum(len(s["input_ids"]) for s in r))
        return rows[::-1]

    def _global_rows(self) -> Iterator[list[Mapping[str, Any]]]:
        """The global row sequence, resuming from a loaded state; keeps the live state current."""
        state, self._resume = self._resume, None
        if state is not None:
            read, buffer, pending, rows = state["read"], list(state["buffer"]), [list(r) for r in state["pending"]], state["rows"]
        else:
            read, buffer, pending, rows = 0, [], [], 0
        budget = self.token_budget
        stream = iter(self.dataset)
        if read:
            stream = itertools.islice(stream, read, None)  # the stream's position; nothing is re-packed
        self._read, self._buffer, self._pending, self._rows = read, buffer, pending, rows
        self._history = [(rows, read, list(buffer), list(pending))]
        lengths = [_length(s, -1, budget) for s in buffer]

        def hand_out():
            while self._pending:
                row = self._pending.pop(0)
                self._rows += 1
                yield row

        yield from hand_out()
        for sample in stream:
            lengths.append(self._checked_length(sample, self._read))
            buffer.append(sample)
            self._read += 1
            if len(buffer) >= self.buffer_size:
                emit, carry = self._pack(buffer, lengths, final=False)
                buffer[:] = carry
                lengths = [len(s["input_ids"]) for s in buffer]
                self._pending = emit
                self._remember(self._read, buffer, emit)
                yield from hand_out()
        if buffer:
            emit, _ = self._pack(buffer, lengths, final=True)
            buffer.clear()
        else:
            emit = []
        self._pending = self._even_tail(emit, self._rows)
        self._remember(self._read, [], self._pending)
        yield from hand_out()

    def _remember(self, read: int, buffer: list[Mapping[str, Any]], rows: list[list[Mapping[str, Any]]]) -> None:
        self._history.append((self._rows, read, list(buffer), list(rows)))
        while len(self._history) > 1 and self._history[1][0] + len(self._history[1][3]) < self._rows - self.history_rows:
            self._history.pop(0)  # keep the packs that cover the last `history_rows` rows

    def __iter__(self) -> Iterator[list[Mapping[str, Any]]]:
        W = self.num_replicas
        for row in self._global_rows():
            i = self._rows - 1
            if self.rank == "all" or i % W == self.rank:
                self.rows_emitted += 1
                self.tokens_emitted += sum(len(s["input_ids"]) for s in row)
                yield row

    # ------------------------------------------------------------------ state
    def state_dict(self, rows: int | None = None) -> dict[str, Any]:
        """Stream position (samples read), buffered samples, packed rows not yet handed out, rows handed out
        (global). Bounded by ``buffer_size`` samples.

        ``rows``: the state as it was when exactly ``rows`` global rows had been handed out (a consumer that reads
        ahead, e.g. a DataLoader that prefetches, saves the state of what it has trained on); it must be one of the
        last ``history_rows`` rows of the current pass (``ValueError`` otherwise).

        >>> p = StreamingPacker([{"input_ids": [1] * n} for n in (3, 2, 4, 1)], token_budget=4, buffer_size=2)
        >>> it = iter(p); _ = next(it); st = p.state_dict(); (st["read"], st["rows"])
        (2, 1)
        >>> _ = next(it); q = StreamingPacker(p.dataset, 4, buffer_size=2); q.load_state_dict(p.state_dict(rows=1))
        >>> [len(r[0]["input_ids"]) for r in q]  # rows 2, 3, ... as the uninterrupted pass yields them
        [4, 2]
        """
        if rows is None:
            read, buffer, pending, done = self._read, self._buffer, self._pending, self._rows
        else:
            rows = int(rows)
            for start, read, buffer, packed in reversed(self._history):
                if start <= rows <= start + len(packed):
                    pending, done = packed[rows - start :], rows
                    break
            else:
                raise InvalidArgumentError(
                    f"StreamingPacker.state_dict(rows={rows}): not within the last {self.history_rows} rows of this "
                    f"pass (rows handed out: {self._rows})"
                )
            if rows > self._rows:
                raise InvalidArgumentError(f"StreamingPacker.state_dict(rows={rows}): only {self._rows} rows handed out")
        return {
            "version": _STATE_VERSION,
            "read": read,
            "buffer": [dict(s) for s in buffer],
            "pending": [[dict(s) for s in r] for r in pending],
            "rows": done,
            "token_budget": self.token_budget,
            "buffer_size": self.buffer_size,
            "min_fill": self.min_fill,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue, at the next ``__iter__``, exactly where ``state`` was taken.

        >>> stream = [{"input_ids": [1] * n} for n in (3, 2, 4, 1, 2, 2)]
        >>> a = StreamingPacker(stream, token_budget=4, buffer_size=2); it = iter(a); first = next(it)
        >>> b = StreamingPacker(stream, token_budget=4, buffer_size=2); b.load_state_dict(a.state_dict())
        >>> [first] + list(b) == list(StreamingPacker(stream, token_budget=4, buffer_size=2))
        True
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise InvalidArgumentError(f"StreamingPacker.load_state_dict: not a StreamingPacker state of version "
                                       f"{_STATE_VERSION} (version: {got!r}); a damaged or foreign stream state")
        _check_state_fields(state)
        for key in ("token_budget", "buffer_size", "min_fill", "num_replicas"):
            if state[key] != getattr(self, key):
                raise InvalidArgumentError(
                    f"cannot resume: the state was saved with {key}={state[key]!r}, this packer has "
                    f"{getattr(self, key)!r}; the rest of the stream would not be packed like the interrupted run"
                )
        self._resume = dict(state)


def _check_state_fields(state: Mapping[str, Any]) -> None:
    """Every field of a saved stream state present and of its kind (a damaged checkpoint file reaches this on resume:
    one line naming the field, not a KeyError / TypeError later in the packing loop)."""
    def bad(key: str, what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"StreamingPacker.load_state_dict: field {key!r}: {what}; the stream state is "
                                    "damaged (resume from another checkpoint, or without the stream state)")

    def is_count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def is_sample(v: Any) -> bool:
        return isinstance(v, Mapping) and "input_ids" in v

    for key in ("read", "rows", "token_budget", "buffer_size", "num_replicas"):
        if key not in state:
            raise bad(key, "missing")
        if not is_count(state[key]):
            raise bad(key, f"{state[key]!r} is not a count >= 0")
    if "min_fill" not in state:
        raise bad("min_fill", "missing")
    if isinstance(state["min_fill"], bool) or not isinstance(state["min_fill"], (int, float)):
        raise bad("min_fill", f"{state['min_fill']!r} is not a number")
    for key in ("buffer", "pending"):
        if not isinstance(state.get(key), list):
            raise bad(key, "missing" if key not in state else f"a {type(state[key]).__name__}, not a list")
    if not all(is_sample(s) for s in state["buffer"]):
        raise bad("buffer", "holds an entry that is not a sample with input_ids")
    if not all(isinstance(r, list) and all(is_sample(s) for s in r) for r in state["pending"]):
        raise bad("pending", "holds a row that is not a list of samples with input_ids")
