"""Best-fit-decreasing bin packing of sample lengths under a token budget.

Pure math: imports numpy only (numba lazily, if installed; no torch, transformers or accelerate).

``pack(lengths, budget)`` returns bins of sample indices, every bin's total length within
``budget``. The algorithm is Best-Fit-Decreasing (BFD): samples sorted by length, longest
first (ties in index order); each goes into the open bin whose free space is the smallest
that still fits it, or opens a new bin. Ties between bins with equal free space go to the
bin that reached that free space last (a stack per free-space value), which makes the
result a pure function of the input, identical for both implementations:

- numba (used when importable): one pass over the samples with a segment tree over the
  ``budget + 1`` possible free-space values, O(n log budget);
- numpy fallback: the samples of one length are placed together (BFD puts equal items into
  the smallest fitting bin until it is full, then the next one), so the Python loop runs per
  (length, free-space bucket) pair instead of per sample, with a two-level count of bins
  per free space to skip empty ranges.

Set ``HF_GRADFIX_NO_NUMBA=1`` (or ``backend="numpy"``) to force the fallback.

Measured on 2 shared CPU cores (lognormal lengths, median 300, sigma 1, clipped to [8, 4096],
budget 4096, as in the research digest; ``benchmarks/bench_packing.py``), ``pack()`` including
the list-of-lists output:

- 100k samples: 11 862 bins (= the lower bound), fill 99.992 %; 0.02-0.03 s numba, 0.09-0.15 s numpy;
- 1M samples: 118 982 bins (bound 118 979), fill 99.997 %; 0.25-0.30 s numba, 0.24-0.35 s numpy.

Harder inputs for the fallback (1M samples): uniform lengths up to a 32k budget 1.0 s,
lognormal with a 128k budget 2.4 s (numba: 0.4 and 0.5 s). Loading numba's cached kernel
costs about 0.5-1.5 s once per process (compiling it the first time: about 3 s).

Samples longer than the budget are never truncated: ``oversize="error"`` (default) raises,
``"split"`` cuts them into budget-sized pieces that are packed as separate sequences (the
result then carries ``Span(sample, start, stop)`` per piece), ``"drop"`` leaves them out with
a warning and lists them in ``Packing.dropped``.

>>> bins = pack([5, 3, 8, 2, 6], budget=8)
>>> bins
[[2], [4, 3], [0, 1]]
>>> packing_stats(bins, [5, 3, 8, 2, 6], 8).fill
1.0
"""

from __future__ import annotations

import gc
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from ..errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "Packing",
    "PackingStats",
    "Span",
    "as_lengths",
    "numba_available",
    "oversize_error",
    "pack",
    "pack_arrays",
    "packing_stats",
]

OversizePolicy = Literal["error", "split", "drop"]
Backend = Literal["auto", "numba", "numpy"]

_NUMBA_KERNEL: Any = None  # compiled lazily; False once numba turned out to be missing


# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


class Span(NamedTuple):
    """Tokens ``[start, stop)`` of sample ``sample`` placed in one bin.

    >>> Span(3, 0, 4096).length
    4096
    """

    sample: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Number of tokens in the span.

        >>> Span(0, 10, 25).length
        15
        """
        return self.stop - self.start


@dataclass(frozen=True)
class PackingStats:
    """Fill and waste of a packing (``fill = tokens / (n_bins * budget)``).

    >>> s = packing_stats([[0, 1], [2]], [3, 1, 2], budget=4)
    >>> (s.n_bins, s.tokens, s.fill, s.waste, s.lower_bound_bins)
    (2, 6, 0.75, 0.25, 2)
    """

    n_samples: int
    n_bins: int
    tokens: int
    budget: int
    fill: float
    waste: float
    lower_bound_bins: int
    excess_bins: int
    min_bin_tokens: int
    max_bin_tokens: int
    mean_bin_tokens: float
    bins_under_half: int
    n_split_samples: int = 0
    n_dropped_samples: int = 0

    @property
    def capacity(self) -> int:
        """Token slots provided: ``n_bins * budget``.

        >>> packing_stats([[0]], [3], budget=4).capacity
        4
        """
        return self.n_bins * self.budget

    def __str__(self) -> str:
        extra = ""
        if self.n_split_samples:
            extra += f", {self.n_split_samples} samples split"
        if self.n_dropped_samples:
            extra += f", {self.n_dropped_samples} samples dropped"
        return (
            f"{self.n_samples} samples, {self.tokens} tokens in {self.n_bins} bins of {self.budget} "
            f"(lower bound {self.lower_bound_bins}): fill {100 * self.fill:.3f} %, waste "
            f"{100 * self.waste:.3f} %, bin tokens {self.min_bin_tokens}..{self.max_bin_tokens}"
            f"{extra}"
        )


class Packing(list):
    """The result of :func:`pack`: a ``list[list[int]]`` of sample indices, one list per bin.

    It compares, indexes, iterates and serializes like a plain list of lists. Extra
    attributes:

    - ``budget``: the token budget per bin;
    - ``lengths``: the input lengths (``numpy.int64`` array);
    - ``dropped``: indices left out by ``oversize="drop"`` (empty otherwise);
    - ``split_samples``: indices cut into pieces by ``oversize="split"`` (empty otherwise).
      A split sample's index appears in several bins; :meth:`spans` says which tokens of it
      each bin holds.

    >>> p = pack([3, 10, 2], budget=4, oversize="split")
    >>> list(p)
    [[1], [1], [0], [1, 2]]
    >>> p.spans()[3]
    [Span(sample=1, start=8, stop=10), Span(sample=2, start=0, stop=2)]
    >>> p.split_samples
    (1,)
    """

    budget: int
    lengths: np.ndarray
    dropped: tuple[int, ...]
    _pieces: dict[tuple[int, int], tuple[int, int]]

    def __init__(
        self,
        bins: Sequence[list[int]] = (),
        *,
        budget: int = 1,
        lengths: Any = (),
        dropped: Sequence[int] = (),
        pieces: dict[tuple[int, int], tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(bins)
        self.budget = int(budget)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.dropped = tuple(int(i) for i in dropped)
        self._pieces = dict(pieces or {})

    @property
    def split_samples(self) -> tuple[int, ...]:
        """Indices of the samples that were cut into pieces (sorted).

        >>> pack([2, 2], budget=4).split_samples
        ()
        """
        return tuple(sorted({s for (_, s) in self._pieces}))

    def bin_spans(self, b: int) -> list[Span]:
        """The spans of bin ``b`` (whole samples are ``Span(i, 0, length)``).

        >>> pack([3, 1], budget=4).bin_spans(0)
        [Span(sample=0, start=0, stop=3), Span(sample=1, start=0, stop=1)]
        """
        out = []
        for s in self[b]:
            piece = self._pieces.get((b, s))
            out.append(Span(s, *piece) if piece else Span(s, 0, int(self.lengths[s])))
        return out

    def spans(self) -> list[list[Span]]:
        """All bins as lists of :class:`Span` (covers every token of every kept sample once).

        >>> pack([5], budget=2, oversize="split").spans()
        [[Span(sample=0, start=0, stop=2)], [Span(sample=0, start=2, stop=4)], [Span(sample=0, start=4, stop=5)]]
        """
        return [self.bin_spans(b) for b in range(len(self))]

    def bin_tokens(self) -> np.ndarray:
        """Tokens per bin (``int64`` array).

        >>> pack([3, 1, 2], budget=4).bin_tokens().tolist()
        [4, 2]
        """
        if not self._pieces:
            if not len(self):
                return np.zeros(0, dtype=np.int64)
            flat = np.fromiter((i for b in self for i in b), dtype=np.int64)
            sizes = np.fromiter((len(b) for b in self), dtype=np.int64, count=len(self))
            starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            return np.add.reduceat(self.lengths[flat], starts)
        return np.array([sum(sp.length for sp in self.bin_spans(b)) for b in range(len(self))], dtype=np.int64)

    def stats(self) -> PackingStats:
        """Fill/waste statistics of this packing (see :class:`PackingStats`).

        >>> pack([3, 1, 2], budget=4).stats().fill
        0.75
        """
        return _stats_from_bin_tokens(
            self.bin_tokens(),
            self.budget,
            n_samples=len(self.lengths) - len(self.dropped),
            n_split=len(self.split_samples),
            n_dropped=len(self.dropped),
        )

    def __reduce__(self):  # keep the attributes through pickle / copy
        return (
            _rebuild_packing,
            (list(self), self.budget, self.lengths, self.dropped, self._pieces),
        )


def _rebuild_packing(bins, budget, lengths, dropped, pieces) -> Packing:
    return Packing(bins, budget=budget, lengths=lengths, dropped=dropped, pieces=pieces)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_budget(budget: Any) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise InvalidTypeError(f"budget must be a positive int (tokens per bin), got {budget!r}")
    if budget < 1:
        raise InvalidArgumentError(f"budget must be a positive int (tokens per bin), got {budget}")
    return int(budget)


def as_lengths(lengths: Any) -> np.ndarray:
    """Validate sample lengths and return them as a 1-D ``int64`` array.

    Raises ``InvalidArgumentError`` (a ``ValueError``) naming the first offending sample for zero or negative
    lengths, ``InvalidTypeError`` (a ``TypeError``) for non-integer values.

    >>> as_lengths([3, 1]).tolist()
    [3, 1]
    >>> as_lengths([3, 0])
    Traceback (most recent call last):
    ...
    hf_gradfix.errors.InvalidArgumentError: sample 1 has length 0 (1 sample(s) of length 0 in total): an empty sample has no tokens to pack; filter empty samples out before packing
    """
    return _int_lengths(lengths).astype(np.int64, copy=False)


def _int_lengths(lengths: Any) -> np.ndarray:
    """:func:`as_lengths` without the ``int64`` copy: an integer array keeps its dtype (10M int32 lengths
    would otherwise cost an 80 MB copy per call); floats become ``int64``."""
    if hasattr(lengths, "detach"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"lengths must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "b":
        raise InvalidTypeError("lengths must be integers, got booleans")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            bad = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))[0])
            raise InvalidTypeError(f"lengths must be integers: sample {bad} has length {arr[bad].item()!r}")
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"lengths must be integers, got dtype {arr.dtype}")
    if arr.min() <= 0:
        neg = np.flatnonzero(arr < 0)
        if neg.size:
            i = int(neg[0])
            raise InvalidArgumentError(f"sample {i} has a negative length {int(arr[i])}; lengths are token counts")
        zero = np.flatnonzero(arr == 0)
        i = int(zero[0])
        raise InvalidArgumentError(
            f"sample {i} has length 0 ({zero.size} sample(s) of length 0 in total): an empty sample has "
            "no tokens to pack; filter empty samples out before packing"
        )
    return arr


_SPLIT_FIX = "pass oversize='split' to cut long samples into budget-sized pieces (each trained as a separate sequence)"


def oversize_error(lengths: np.ndarray, budget: int, *, split_fix: str = _SPLIT_FIX) -> InvalidArgumentError | None:
    """The error for samples longer than ``budget`` (``None`` if there are none);
    ``split_fix`` is the first remedy named.

    >>> print(oversize_error(np.array([3, 9, 5]), 4))
    sample 1 has 9 tokens, more than the packing budget of 4 tokens per bin (2 sample(s) exceed it, the longest is sample 1 with 9 tokens). Nothing is truncated silently: pass oversize='split' to cut long samples into budget-sized pieces (each trained as a separate sequence), raise the budget to at least 9, or filter/truncate these samples before packing.
    """
    over = np.flatnonzero(lengths > budget)
    if not over.size:
        return None
    i = int(over[0])
    j = int(over[np.argmax(lengths[over])])
    return InvalidArgumentError(
        f"sample {i} has {int(lengths[i])} tokens, more than the packing budget of {budget} tokens per bin "
        f"({over.size} sample(s) exceed it, the longest is sample {j} with {int(lengths[j])} tokens). "
        f"Nothing is truncated silently: {split_fix}, raise the budget to at least {int(lengths[j])}, or "
        "filter/truncate these samples before packing."
    )


# --------------------------------------------------------------------------------------------
# The two BFD implementations (identical results)
# --------------------------------------------------------------------------------------------


def _bfd_kernel(sorted_len: np.ndarray, budget: int, out_bin: np.ndarray) -> int:
    """Per-item BFD over free-space buckets (a stack of bins per free space) and a max segment
    tree over the buckets. Compiled with numba when available; valid (slow) plain Python too,
    which the tests use as the reference for the numpy implementation.

    Writes the bin of the j-th sorted item to ``out_bin[j]`` and returns the number of bins.
    """
    n = sorted_len.shape[0]
    size = 1
    while size < budget + 1:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.int64)  # leaf size + c holds c while bucket c is non-empty
    head = np.full(budget + 1, -1, dtype=np.int64)  # top of each bucket's stack
    nxt = np.empty(max(n, 1), dtype=np.int64)  # next bin down the stack
    nbins = 0
    for j in range(n):
        L = sorted_len[j]
        if tree[1] >= L:
            i = 1
            while i < size:  # leftmost leaf with value >= L: smallest non-empty free space >= L
                if tree[2 * i] >= L:
                    i = 2 * i
                else:
                    i = 2 * i + 1
            c = i - size
            b = head[c]
            head[c] = nxt[b]
            if head[c] == -1:
                tree[i] = 0
                i //= 2
                while i >= 1:
                    left = tree[2 * i]
                    right = tree[2 * i + 1]
                    tree[i] = left if left >= right else right
                    i //= 2
        else:
            b = nbins
            nbins += 1
            c = budget
        out_bin[j] = b
        r = c - L
        if r > 0:
            nxt[b] = head[r]
            if head[r] == -1:
                i = size + r
                tree[i] = r
                i //= 2
                while i >= 1 and tree[i] < r:
                    tree[i] = r
                    i //= 2
            head[r] = b
    return nbins


def _bfd_numpy(sorted_len: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """Same result as :func:`_bfd_kernel`, placing all items of one length at once.

    BFD with equal items of length L: the smallest free space c >= L takes floor(c / L) of
    them (its bin stays the best fit until its free space drops below L), then the next
    bin; buckets below L are never candidates for this length. So a whole bucket of bins is
    consumed in one numpy step and the Python loop runs per (length, bucket) pair.
    """
    n = int(sorted_len.shape[0])
    out = np.empty(n, dtype=_index_dtype(n))
    if n == 0:
        return out, 0
    buckets: dict[int, list[int]] = {}  # free space -> stack of bins (top = end of list)
    counts = np.zeros(budget + 1, dtype=np.int64)  # bins per free space
    blk = 256  # a second level: bins per block of `blk` free-space values, to skip empty ranges
    blocks = np.zeros(budget // blk + 1, dtype=np.int64)
    nbins = 0
    cuts = (np.flatnonzero(sorted_len[1:] != sorted_len[:-1]) + 1).tolist()  # no n-sized int diff
    starts = [0, *cuts]
    ends = [*cuts, n]
    for s, e, L in zip(starts, ends, sorted_len[starts].tolist()):
        pos = s
        first = L // blk
        for bi in (np.flatnonzero(blocks[first:]) + first).tolist():  # non-empty blocks, ascending
            lo = max(L, bi * blk)
            cand = np.flatnonzero(counts[lo : bi * blk + blk])
            if not cand.size:
                continue
            cand += lo
            q = cand // L
            cap = np.cumsum(counts[cand] * q)
            t = int(np.searchsorted(cap, e - pos))  # first bucket that can take the rest
            for c, qq in zip(cand[:t].tolist(), q[:t].tolist()):  # fully consumed buckets
                lst = buckets.pop(c)
                counts[c] = 0
                blocks[c // blk] -= len(lst)
                lst.reverse()  # pop order
                m = len(lst) * qq
                out[pos : pos + m] = lst if qq == 1 else np.repeat(lst, qq)
                pos += m
                d = c - qq * L
                if d:
                    buckets.setdefault(d, []).extend(lst)
                    counts[d] += len(lst)
                    blocks[d // blk] += len(lst)
            k = e - pos
            if k and t < cand.size:  # partially consumed bucket: the group ends here
                c = int(cand[t])
                qq = int(q[t])
                lst = buckets[c]
                j, rem = divmod(k, qq)
                if j:
                    popped = lst[-j:]
                    del lst[-j:]
                    popped.reverse()
                    out[pos : pos + j * qq] = popped if qq == 1 else np.repeat(popped, qq)
                    pos += j * qq
                    d = c - qq * L
                    if d:
                        buckets.setdefault(d, []).extend(popped)
                        counts[d] += j
                        blocks[d // blk] += j
                if rem:
                    b = lst.pop()
                    out[pos : pos + rem] = b
                    pos += rem
                    d = c - rem * L
                    buckets.setdefault(d, []).append(b)
                    counts[d] += 1
                    blocks[d // blk] += 1
                blocks[c // blk] -= counts[c] - len(lst)
                counts[c] = len(lst)
            if pos == e:
                break
        k = e - pos
        if k:  # open new bins
            qq = budget // L
            j, rem = divmod(k, qq)
            if j:
                ids = np.arange(nbins, nbins + j, dtype=np.int64)
                out[pos : pos + j * qq] = ids if qq == 1 else np.repeat(ids, qq)
                pos += j * qq
                d = budget - qq * L
                if d:
                    buckets.setdefault(d, []).extend(range(nbins, nbins + j))
                    counts[d] += j
                    blocks[d // blk] += j
                nbins += j
            if rem:
                b = nbins
                nbins += 1
                out[pos : pos + rem] = b
                pos += rem
                d = budget - rem * L
                buckets.setdefault(d, []).append(b)
                counts[d] += 1
                blocks[d // blk] += 1
    return out, nbins


def _numba_kernel():
    global _NUMBA_KERNEL
    if _NUMBA_KERNEL is None:
        if os.environ.get("HF_GRADFIX_NO_NUMBA", "").strip() not in ("", "0"):
            _NUMBA_KERNEL = False
        else:
            try:
                import numba
            except ImportError:
                _NUMBA_KERNEL = False
            else:
                try:
                    _NUMBA_KERNEL = numba.njit(cache=True, nogil=True)(_bfd_kernel)
                except Exception:  # pragma: no cover - an unusable numba install
                    _NUMBA_KERNEL = False
    return _NUMBA_KERNEL or None


def numba_available() -> bool:
    """Whether the numba fast path is usable (numba importable, not disabled by
    ``HF_GRADFIX_NO_NUMBA=1``).

    >>> isinstance(numba_available(), bool)
    True
    """
    return _numba_kernel() is not None


def _bfd_sorted(sorted_len: np.ndarray, budget: int, backend: Backend) -> tuple[np.ndarray, int]:
    if backend not in ("auto", "numba", "numpy"):
        raise InvalidArgumentError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    kernel = _numba_kernel() if backend != "numpy" else None
    if backend == "numba" and kernel is None:
        raise ImportError(
            "backend='numba' needs numba (pip install numba; unset HF_GRADFIX_NO_NUMBA); "
            "backend='auto' falls back to numpy"
        )
    if kernel is not None:
        out = np.empty(sorted_len.shape[0], dtype=np.int64)
        args = (np.ascontiguousarray(sorted_len, dtype=np.int64), int(budget), out)
        try:
            return out, int(kernel(*args))
        except Exception as exc:  # e.g. a stale or foreign numba cache file: compile afresh, uncached
            global _NUMBA_KERNEL
            import numba

            _NUMBA_KERNEL = numba.njit(cache=False, nogil=True)(_bfd_kernel)
            try:
                return out, int(_NUMBA_KERNEL(*args))
            except Exception:
                _NUMBA_KERNEL = False
                if backend == "numba":
                    raise
                warnings.warn(f"numba packing kernel failed ({exc!r}); using the numpy fallback", stacklevel=3)
    return _bfd_numpy(sorted_len, budget)


def pack_arrays(lengths: Any, budget: int, *, backend: Backend = "auto") -> tuple[np.ndarray, np.ndarray]:
    """BFD packing in compressed form: ``(items, offsets)``, bin ``b`` holding
    ``items[offsets[b]:offsets[b + 1]]`` (longest first). The fast core of :func:`pack`.

    Every length must be in ``[1, budget]`` (use :func:`pack` for oversize policies).
    ``backend``: ``"auto"`` (numba if importable, else numpy), ``"numba"`` or ``"numpy"``;
    both give the identical result.

    >>> items, offsets = pack_arrays([5, 3, 8, 2, 6], 8)
    >>> items.tolist(), offsets.tolist()
    ([2, 4, 3, 0, 1], [0, 1, 3, 5])
    """
    budget = _check_budget(budget)
    arr = _int_lengths(lengths)
    err = oversize_error(arr, budget)
    if err is not None:
        raise err
    return _pack_csr(arr, budget, backend)


def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


def _pack_csr(
    lengths: np.ndarray, budget: int, backend: Backend, subset: np.ndarray | list[np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_arrays` on validated lengths (every one in ``[1, budget]``). With ``subset``, packs
    ``lengths[subset]`` and returns ``items`` as entries of ``subset`` (the sampler's dataset indices).
    ``subset`` may be handed over in a one-element list, which is emptied: the array is then freed as soon
    as it is no longer needed. ``items`` is ``int32`` below 2**31 samples; offsets ``int64``.

    Lean on memory (10M samples: the lengths plus 3 index arrays of 4 bytes per sample at the peak): the
    two sorts are chunked counting sorts (no n-sized ``int64`` argsort result), the sorted lengths are
    rebuilt from the length counts instead of gathered, subset indices are mapped in place.
    """
    if isinstance(subset, list):
        subset = subset.pop()
    arr = lengths if subset is None else lengths[subset]
    n = int(arr.size)
    idx = _index_dtype(n)
    if n == 0:
        return np.zeros(0, dtype=idx), np.zeros(1, dtype=np.int64)
    if budget < 1 << 20:
        # longest first, ties in index order: a stable counting sort on key = budget - length
        order, counts = _counting_argsort(arr, budget + 1, key_of=lambda c: budget - c.astype(np.int32), dtype=idx)
        del arr  # (our gather is freed here)
        keys = np.flatnonzero(counts)
        sorted_len = np.repeat((budget - keys).astype(np.int32), counts[keys])
    else:
        order = _longest_first(arr, budget).astype(idx)
        sorted_len = arr[order]
        del arr
    if subset is not None:  # map to the caller's indices in place, a chunk at a time
        for a in range(0, n, _CHUNK):
            order[a : a + _CHUNK] = subset[order[a : a + _CHUNK]]
        del subset
    item_bin, nbins = _bfd_sorted(sorted_len, budget, backend)
    del sorted_len
    # bins in opening order, items in placement order: a stable sort by bin, scattering `order`
    items, bin_counts = _counting_argsort(item_bin, nbins, key_of=None, dtype=order.dtype, values=order)
    offsets = np.zeros(nbins + 1, dtype=np.int64)
    np.cumsum(bin_counts, out=offsets[1:])
    return items, offsets


_CHUNK = 1 << 18


def _counting_argsort(
    data: np.ndarray, n_keys: int, *, key_of: Any, dtype: type, values: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Stable argsort of ``key_of(data)`` (keys in ``[0, n_keys)``) as a counting sort in chunks of
    ``_CHUNK``: returns ``(out, counts)`` with ``out`` the indices in sorted order (or ``values`` at those
    indices) as ``dtype``, ``counts[k]`` the number of key ``k``. Identical to
    ``np.argsort(keys, kind="stable")``; the only n-sized array is ``out``."""
    n = int(data.size)
    keys_of = (lambda c: c) if key_of is None else key_of
    pos_dtype = _index_dtype(n)  # positions and counts fit the index dtype: half the tables' memory
    counts = np.zeros(n_keys, dtype=pos_dtype)
    for a in range(0, n, _CHUNK):
        k = keys_of(data[a : a + _CHUNK])
        lo = int(k.min())
        counts[lo : int(k.max()) + 1] += np.bincount(k - lo).astype(pos_dtype)
    starts = np.zeros(n_keys, dtype=pos_dtype)
    np.cumsum(counts[:-1], out=starts[1:])
    out = np.empty(n, dtype=dtype)
    ramp = np.arange(min(n, _CHUNK), dtype=pos_dtype)
    for a in range(0, n, _CHUNK):
        k = keys_of(data[a : a + _CHUNK])
        lo = int(k.min())
        k = k - lo  # chunk-local keys: the per-chunk tables span only this chunk's key range
        if int(k.max()) < 1 << 16:
            k = k.astype(np.uint16)  # numpy's stable sort of 16-bit keys is a radix sort
        o = np.argsort(k, kind="stable")
        c = np.bincount(k).astype(pos_dtype)
        # the element at sorted position i with key v goes to starts[v] + (i - first position of v in the chunk)
        shift = np.cumsum(c, dtype=pos_dtype)
        shift -= c
        window = starts[lo : lo + c.size]
        np.subtract(window, shift, out=shift)
        pos = shift[k[o]]
        pos += ramp[: o.size]
        if values is None:
            o += a
            out[pos] = o
        else:
            out[pos] = values[a : a + _CHUNK][o]
        window += c
    return out, counts


def _longest_first(arr: np.ndarray, budget: int) -> np.ndarray:
    """Indices sorted by length descending, ties in index order (a stable sort; for budgets
    below 2**16 on a uint16 key, which numpy sorts by radix in O(n))."""
    if budget < 1 << 16:
        return np.argsort((budget - arr).astype(np.uint16), kind="stable")
    return np.argsort(-arr, kind="stable")


def _csr_to_lists(items: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    flat = items.tolist()
    off = offsets.tolist()
    # Building ~n/8 small lists triggers the cyclic GC hundreds of times (4x the cost of
    # the slicing itself); none of these objects can form a cycle.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return [flat[a:b] for a, b in zip(off[:-1], off[1:])]
    finally:
        if was_enabled:
            gc.enable()


def pack(
    lengths: Any,
    budget: int,
    *,
    oversize: OversizePolicy = "error",
    backend: Backend = "auto",
) -> Packing:
    """Pack samples into bins of at most ``budget`` tokens (Best-Fit-Decreasing).

    Returns a :class:`Packing`: a ``list[list[int]]`` of sample indices per bin (bins in
    opening order, samples longest first), plus ``spans()`` for split samples and
    ``stats()``. Deterministic: a pure function of ``(lengths, budget, oversize)``.

    ``oversize`` decides what happens to samples longer than ``budget``:

    - ``"error"`` (default): ``ValueError`` naming the sample, its length, the budget and
      the fixes;
    - ``"split"``: cut into pieces ``[0, budget), [budget, 2 budget), ...`` (each full piece
      fills a bin; the remainder is packed like any sample); the sample's index then
      appears in several bins and ``spans()`` gives each piece's token range. Every token is
      kept exactly once;
    - ``"drop"``: leave those samples out, with a ``UserWarning`` naming them, and list
      them in ``Packing.dropped``.

    Zero or negative lengths raise ``ValueError`` (filter empty samples first).

    >>> pack([5, 3, 8, 2, 6], budget=8)
    [[2], [4, 3], [0, 1]]
    >>> pack([5, 3, 8, 2, 6], budget=8).stats().n_bins
    3
    >>> pack([9, 1], budget=4)
    Traceback (most recent call last):
    ...
    hf_gradfix.errors.InvalidArgumentError: sample 0 has 9 tokens, more than the packing budget of 4 tokens per bin (1 sample(s) exceed it, the longest is sample 0 with 9 tokens). Nothing is truncated silently: pass oversize='split' to cut long samples into budget-sized pieces (each trained as a separate sequence), raise the budget to at least 9, or filter/truncate these samples before packing.
    """
    budget = _check_budget(budget)
    if oversize not in ("error", "split", "drop"):
        raise InvalidArgumentError(f"oversize must be 'error', 'split' or 'drop', got {oversize!r}")
    arr = as_lengths(lengths)
    over = np.flatnonzero(arr > budget)
    if not over.size:
        items, offsets = pack_arrays(arr, budget, backend=backend)
        return Packing(_csr_to_lists(items, offsets), budget=budget, lengths=arr)
    if oversize == "error":
        raise oversize_error(arr, budget)  # type: ignore[misc]
    if oversize == "drop":
        keep = np.flatnonzero(arr <= budget)
        shown = ", ".join(f"{int(i)} ({int(arr[i])} tokens)" for i in over[:10])
        more = f" and {over.size - 10} more" if over.size > 10 else ""
        warnings.warn(
            f"pack(oversize='drop'): dropping {over.size} sample(s) longer than the budget of {budget} "
            f"tokens: {shown}{more}. They are listed in Packing.dropped.",
            UserWarning,
            stacklevel=2,
        )
        items, offsets = pack_arrays(arr[keep], budget, backend=backend)
        return Packing(
            _csr_to_lists(keep[items], offsets), budget=budget, lengths=arr, dropped=over.tolist()
        )
    # split: one item per piece; item ids ordered by (sample, start) so ties stay deterministic
    n_pieces = np.where(arr > budget, -(-arr // budget), 1)
    piece_sample = np.repeat(np.arange(arr.size, dtype=np.int64), n_pieces)
    first = np.concatenate(([0], np.cumsum(n_pieces)[:-1]))
    piece_no = np.arange(piece_sample.size, dtype=np.int64) - np.repeat(first, n_pieces)
    piece_start = piece_no * budget
    piece_stop = np.minimum(piece_start + budget, arr[piece_sample])
    items, offsets = pack_arrays(piece_stop - piece_start, budget, backend=backend)
    bins = _csr_to_lists(piece_sample[items], offsets)
    is_split = arr[piece_sample] > budget
    item_bin = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    pieces: dict[tuple[int, int], tuple[int, int]] = {}
    for b, p in zip(item_bin.tolist(), items.tolist()):
        if is_split[p]:
            pieces[(b, int(piece_sample[p]))] = (int(piece_start[p]), int(piece_stop[p]))
    return Packing(bins, budget=budget, lengths=arr, pieces=pieces)


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def _stats_from_bin_tokens(
    bin_tokens: np.ndarray, budget: int, *, n_samples: int, n_split: int = 0, n_dropped: int = 0
) -> PackingStats:
    n_bins = int(bin_tokens.size)
    tokens = int(bin_tokens.sum()) if n_bins else 0
    fill = tokens / (n_bins * budget) if n_bins else 1.0
    return PackingStats(
        n_samples=n_samples,
        n_bins=n_bins,
        tokens=tokens,
        budget=budget,
        fill=fill,
        waste=1.0 - fill,
        lower_bound_bins=math.ceil(tokens / budget),
        excess_bins=n_bins - math.ceil(tokens / budget),
        min_bin_tokens=int(bin_tokens.min()) if n_bins else 0,
        max_bin_tokens=int(bin_tokens.max()) if n_bins else 0,
        mean_bin_tokens=tokens / n_bins if n_bins else 0.0,
        bins_under_half=int(np.count_nonzero(2 * bin_tokens < budget)),
        n_split_samples=n_split,
        n_dropped_samples=n_dropped,
    )


def packing_stats(bins: Sequence[Sequence[int]], lengths: Any, budget: int) -> PackingStats:
    """Fill and waste of ``bins`` (lists of sample indices) for ``lengths`` under ``budget``.

    ``fill = sum of the bins' tokens / (n_bins * budget)``; ``waste = 1 - fill`` is the
    padding share if every bin is padded to the budget. A :class:`Packing` with split
    samples is measured by its spans. Raises ``ValueError`` if a bin exceeds the budget.

    >>> packing_stats([[2], [4, 3], [0, 1]], [5, 3, 8, 2, 6], 8).fill
    1.0
    >>> str(packing_stats([[0], [1]], [3, 2], 4))
    '2 samples, 5 tokens in 2 bins of 4 (lower bound 2): fill 62.500 %, waste 37.500 %, bin tokens 2..3'
    """
    budget = _check_budget(budget)
    if isinstance(bins, Packing) and bins._pieces:
        bin_tokens = bins.bin_tokens()
        n_samples = len(bins.lengths) - len(bins.dropped)
        n_split = len(bins.split_samples)
        n_dropped = len(bins.dropped)
    else:
        arr = as_lengths(lengths)
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        flat = np.fromiter((int(i) for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
        if sizes.size and sizes.min() == 0:
            raise InvalidArgumentError(f"bin {int(np.argmin(sizes))} is empty")
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if sizes.size else sizes
        bin_tokens = np.add.reduceat(arr[flat], starts) if sizes.size else np.zeros(0, np.int64)
        n_samples = int(np.unique(flat).size)
        n_split = 0
        n_dropped = len(bins.dropped) if isinstance(bins, Packing) else 0
    if bin_tokens.size and bin_tokens.max() > budget:
        b = int(np.argmax(bin_tokens))
        raise InvalidArgumentError(f"bin {b} holds {int(bin_tokens[b])} tokens, more than the budget {budget}")
    return _stats_from_bin_tokens(bin_tokens, budget, n_samples=n_samples, n_split=n_split, n_dropped=n_dropped)
