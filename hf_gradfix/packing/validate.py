"""Check a map-style training dataset for packing in one pass, before training, naming the dataset index.

The collator would find a bad row only when it reaches that bin (possibly hours in), numbered by its position in
the bin; an id outside the vocabulary ends in torch's bare ``IndexError`` after a step has trained; labels that are
all -100 train silently at loss 0. :func:`validate_packing_dataset` reads every sample once (vectorized over
Arrow columns for a ``datasets.Dataset``, sample by sample otherwise) and raises :class:`PackedDataError`, one
line naming the dataset index, the column, the value and the fix, for:

- a missing ``input_ids`` column, a null, empty, 2-D, non-integer row;
- ``labels`` / ``attention_mask`` of another length than ``input_ids``; non-integer labels;
- an ``attention_mask`` with zeros (packed samples must be unpadded);
- token ids outside ``[0, vocab_size)``, label ids outside ``[0, label_vocab_size)`` other than ``ignore_index``;
- a ``length`` column that disagrees with ``input_ids`` (it sizes the bins);
- a sample longer than ``token_budget``;
- a sample already packed (several documents back to back, which packing keeps apart): ``seq_lengths`` (TRL's
  ``pack_dataset``) that do not add up to its ``input_ids``, a document of 0 tokens, ``position_ids`` of another
  length.

It warns when no sample has a single target (a label other than ``ignore_index`` after its first token, which
packing always masks). Returns the sample lengths (for the sampler) and target counts.

Imports numpy (and pyarrow, which ``datasets`` brings, for Arrow-backed datasets); no torch.

>>> report = validate_packing_dataset([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}],
...                                   vocab_size=16)
>>> report.lengths.tolist(), report.n_targets
([3, 2], 3)
>>> try:
...     validate_packing_dataset([{"input_ids": [5, 6]}, {"input_ids": [8, 99]}], vocab_size=16)
... except PackedDataError as e:
...     print(e)
train dataset index 1, column 'input_ids': token id 99 is outside the vocabulary [0, 16). Fix: tokenize with the model's own tokenizer, or resize the model's embeddings (model.resize_token_embeddings(len(tokenizer))).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .collator import BOUNDARY_KEYS, PackedBatchError, document_lengths

__all__ = ["DatasetCheck", "PackedDataError", "validate_packing_dataset"]

IGNORE_INDEX = -100
_BLOCK_ROWS = 16_384  # rows per vectorized block (bounds the memory of one block's flattened ids)


class PackedDataError(PackedBatchError):
    """A training sample that cannot be packed; the message names the dataset index, the column and the fix.

    >>> issubclass(PackedDataError, ValueError)
    True
    """


@dataclass(frozen=True)
class DatasetCheck:
    """Outcome of :func:`validate_packing_dataset`: ``lengths[i]`` tokens of sample ``i``; ``n_targets``: labels
    that will be trained on over the whole dataset; ``samples_without_targets``: samples that contribute none.

    >>> DatasetCheck(np.array([3]), 2, 0).n_samples
    1
    """

    lengths: np.ndarray
    n_targets: int
    samples_without_targets: int
    #: documents over the dataset where samples are already packed (``seq_lengths`` / restarted ``position_ids``,
    #: kept apart by the collator); None: one document per sample
    n_documents: int | None = None

    @property
    def n_samples(self) -> int:
        """Number of samples checked.

        >>> DatasetCheck(np.array([3, 4]), 5, 0).n_samples
        2
        """
        return int(self.lengths.size)


_VOCAB_FIX = "tokenize with the model's own tokenizer, or resize the model's embeddings (model.resize_token_embeddings(len(tokenizer)))"
_FIXES = {
    "missing": "tokenize the dataset first (every sample needs 'input_ids'), or drop the bad rows",
    "empty": "drop empty samples before packing (e.g. dataset.filter(lambda s: len(s['input_ids']) > 0))",
    "2d": "store one unpadded sample per row as a flat list of ids (do not batch or nest them)",
    "dtype": "store integer token ids (cast the column, e.g. dataset.cast_column(name, Sequence(Value('int64'))))",
    "labels_len": "labels must be unshifted and aligned with input_ids, one per token (the model shifts them); use -100 for tokens without a target",
    "mask_len": "give one attention_mask entry per token, or drop the column",
    "mask_zero": "packed samples must be unpadded: strip the padding (or tokenize with padding=False) and drop attention_mask",
    "labels_vocab": "label ids must be token ids of the model's vocabulary, or -100 for no target",
    "length_col": "recompute the 'length' column from input_ids (it sizes the packed rows), or drop it",
    "budget": "raise packing.token_budget to at least the longest sample, or filter/truncate long samples before packing",
    "seq_lengths": "give the length of every document of the sample, back to back, adding up to its input_ids (as TRL's pack_dataset writes them), or drop the column",
    "position_ids": "give one position per token (restarting at every document of an already packed sample), or drop the column",
    "sequence_label": "packing concatenates samples into one row, which leaves no place for a label per sample (a "
                      "sequence-level head): train this dataset unpacked (remove packing.enabled)",
}


class _Problem(Exception):
    def __init__(self, index: int, column: str, what: str, fix: str) -> None:
        super().__init__(what)
        self.index, self.column, self.what, self.fix = index, column, what, fix


def _error(p: _Problem, name: str) -> PackedDataError:
    return PackedDataError(f"{name} index {p.index}, column '{p.column}': {p.what}. Fix: {p.fix}.")


def validate_packing_dataset(
    dataset: Any,
    *,
    vocab_size: int | None = None,
    label_vocab_size: int | None = None,
    token_budget: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    name: str = "train dataset",
) -> DatasetCheck:
    """One pass over a map-style dataset; raise :class:`PackedDataError` at the first bad sample (see module).

    Args:
        dataset: a ``datasets.Dataset`` (read column-wise from Arrow) or any sequence of sample dicts.
        vocab_size: input embedding rows (ids must be ``< vocab_size``); ``None``: not checked.
        label_vocab_size: output vocabulary (default ``vocab_size``).
        token_budget: samples longer than this are an error; ``None``: not checked.
        ignore_index: the label meaning "no target".
        name: how messages name the dataset.

    >>> validate_packing_dataset([{"input_ids": [1, 2], "attention_mask": [1, 0]}])
    Traceback (most recent call last):
    ...
    hf_gradfix.packing.validate.PackedDataError: train dataset index 0, column 'attention_mask': has a 0 at token 1 (padding). Fix: packed samples must be unpadded: strip the padding (or tokenize with padding=False) and drop attention_mask.
    """
    label_vocab_size = vocab_size if label_vocab_size is None else label_vocab_size
    checker = _Checker(vocab_size, label_vocab_size, token_budget, ignore_index)
    try:
        if getattr(dataset, "column_names", None) is not None and hasattr(dataset, "with_format"):
            check = checker.arrow(dataset)
        else:
            check = checker.rows(dataset)
    except _Problem as p:
        raise _error(p, name) from None
    if check.n_samples and check.n_targets == 0:
        warnings.warn(
            f"{name}: none of its {check.n_samples} samples has a single target (every label after a sample's first "
            f"token is {ignore_index}): training would run at loss 0 and learn nothing. Fix: check the label masking "
            "(e.g. a completion-only mask that also masks the completion).",
            UserWarning,
            stacklevel=2,
        )
    return check


class _Checker:
    def __init__(self, vocab: int | None, label_vocab: int | None, budget: int | None, ignore: int) -> None:
        self.vocab, self.label_vocab, self.budget, self.ignore = vocab, label_vocab, budget, ignore

    # ------------------------------------------------------------------ shared, vectorized over a block
    def _ids(self, values: np.ndarray, offsets: np.ndarray, base: int, column: str) -> None:
        if self.vocab is None or not values.size:
            return
        bad = (values < 0) | (values >= self.vocab)
        if bad.any():
            pos = int(np.argmax(bad))
            row = int(np.searchsorted(offsets, pos, side="right") - 1)
            raise _Problem(base + row, column, f"token id {int(values[pos])} is outside the vocabulary [0, {self.vocab})", _VOCAB_FIX)

    def _labels(self, values: np.ndarray, offsets: np.ndarray, base: int, doc_starts: np.ndarray | None = None) -> np.ndarray:
        """Targets per row (labels after the first token that are not ignore_index); checks label ids."""
        n_rows = offsets.size - 1
        real = values != self.ignore
        if self.label_vocab is not None:
            bad = real & ((values < 0) | (values >= self.label_vocab))
            if bad.any():
                pos = int(np.argmax(bad))
                row = int(np.searchsorted(offsets, pos, side="right") - 1)
                raise _Problem(
                    base + row, "labels",
                    f"label id {int(values[pos])} at token {pos - int(offsets[row])} is neither {self.ignore} nor in the vocabulary [0, {self.label_vocab})",
                    _FIXES["labels_vocab"],
                )
        lengths = np.diff(offsets)
        starts = offsets[:-1][lengths > 0]
        real[starts] = False  # packing masks every sample's first label
        if doc_starts is not None:
            real[doc_starts] = False  # and every document's of an already packed sample
        rows = np.repeat(np.arange(n_rows), lengths)
        return np.bincount(rows[real], minlength=n_rows)

    def _lengths(self, lengths: np.ndarray, base: int) -> None:
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            raise _Problem(base + int(empty[0]), "input_ids", "is empty (0 tokens)", _FIXES["empty"])
        if self.budget is not None:
            over = np.flatnonzero(lengths > self.budget)
            if over.size:
                i = int(over[0])
                raise _Problem(
                    base + i, "input_ids",
                    f"has {int(lengths[i])} tokens, more than packing.token_budget={self.budget} ({over.size} such sample(s) in this block, the longest {int(lengths[over].max())})",
                    _FIXES["budget"],
                )

    # ------------------------------------------------------------------ datasets.Dataset (Arrow)
    def arrow(self, dataset: Any) -> DatasetCheck:
        import pyarrow as pa

        columns = list(dataset.column_names)
        if "input_ids" not in columns:
            raise _Problem(0, "input_ids", f"no such column (columns: {columns})", _FIXES["missing"])
        table = dataset.with_format("arrow")
        n = len(dataset)
        names = [c for c in ("input_ids", "labels", "attention_mask", "length", "seq_lengths", "position_ids") if c in columns]
        schema = table[0:1].schema if n else None  # one row: the column types (same for every block)
        for column in names:
            if column == "length" or schema is None:
                continue
            col_type = schema.field(column).type
            if not (pa.types.is_list(col_type) or pa.types.is_large_list(col_type) or pa.types.is_fixed_size_list(col_type)):
                if column == "labels" and (pa.types.is_integer(col_type) or pa.types.is_floating(col_type)):
                    raise _Problem(0, column, f"holds one {col_type} value per sample, not one per token",
                                   _FIXES["sequence_label"])
                raise _Problem(0, column, f"holds {col_type} values, not a list of token ids per sample", _FIXES["2d"] if column == "input_ids" else _FIXES["dtype"])
            value_type = col_type.value_type
            if pa.types.is_list(value_type) or pa.types.is_large_list(value_type) or pa.types.is_fixed_size_list(value_type):
                raise _Problem(_first_nonempty(table[0:min(n, _BLOCK_ROWS)].column(column).combine_chunks()), column,
                               f"is 2-D ({col_type}): each row must be one flat sample", _FIXES["2d"])
            if not pa.types.is_integer(value_type) and not (column == "attention_mask" and pa.types.is_boolean(value_type)):
                raise _Problem(_first_nonempty(table[0:min(n, _BLOCK_ROWS)].column(column).combine_chunks()), column,
                               f"holds {value_type} values, not integer ids", _FIXES["dtype"])
        n_targets = 0
        without = 0
        all_lengths = np.empty(n, dtype=np.int64)
        # A shuffled/selected dataset reads its rows through an index mapping; gathering them in random order is
        # slow (55 s per 1M rows), so read them in storage order and map positions back to dataset indices.
        index_map = None
        data, idx_table = getattr(dataset, "data", None), getattr(dataset, "_indices", None)
        if idx_table is not None and hasattr(getattr(data, "table", None), "take"):
            rows = idx_table.column(0).to_numpy().astype(np.int64)
            index_map = np.argsort(rows, kind="stable")  # iteration position -> dataset index
            storage_rows = rows[index_map]
        try:
            self._arrow_blocks(table, data, storage_rows if index_map is not None else None, names, n, all_lengths)
        except _Problem as p:
            if index_map is not None:
                p.index = int(index_map[p.index])
            raise
        n_targets, without, n_documents = self._totals
        if index_map is not None:
            ordered = np.empty_like(all_lengths)
            ordered[index_map] = all_lengths
            all_lengths = ordered
        return DatasetCheck(all_lengths, n_targets, without, n_documents)

    def _documents(self, arrays: dict, offsets: np.ndarray, lengths: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Already packed samples: the flat start of every document and the documents per row (None: one per row)."""
        n_rows = lengths.size
        if "seq_lengths" in arrays:
            col = arrays["seq_lengths"]
            counts = col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
            values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            rows = np.repeat(np.arange(n_rows), counts)
            bad = np.flatnonzero(values < 1)
            if bad.size:
                raise _Problem(base + int(rows[bad[0]]), "seq_lengths", f"holds a document of {int(values[bad[0]])} tokens",
                               _FIXES["seq_lengths"])
            sums = np.bincount(rows, weights=values, minlength=n_rows).astype(np.int64)
            bad = np.flatnonzero(sums != lengths)
            if bad.size:
                i = int(bad[0])
                raise _Problem(base + i, "seq_lengths", f"adds up to {int(sums[i])} tokens but input_ids has {int(lengths[i])}",
                               _FIXES["seq_lengths"])
            # the documents tile the rows, so their flat starts are the running sum of their lengths
            return np.cumsum(values) - values, counts
        if "position_ids" in arrays:
            col = arrays["position_ids"]
            col_lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(col_lengths != lengths)
            if bad.size:
                i = int(bad[0])
                raise _Problem(base + i, "position_ids", f"has {col_lengths[i]} entries but input_ids has {lengths[i]}",
                               _FIXES["position_ids"])
            pos = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            restart = np.zeros(pos.size, dtype=bool)
            restart[1:] = np.diff(pos) != 1  # transformers' rule (a row's first token below)
            restart[offsets[:-1][lengths > 0]] = True
            starts = np.flatnonzero(restart)
            counts = np.bincount(np.searchsorted(offsets, starts, side="right") - 1, minlength=n_rows)
            return starts, counts.astype(np.int64)
        return None

    def _arrow_blocks(self, table: Any, data: Any, storage_rows: np.ndarray | None, names: list[str], n: int, all_lengths: np.ndarray) -> None:
        n_targets = without = 0
        n_documents: int | None = None
        for base in range(0, n, _BLOCK_ROWS):
            stop = min(n, base + _BLOCK_ROWS)
            # one block of rows at a time: memory bounded by the block
            block = table[base:stop] if storage_rows is None else data.table.take(storage_rows[base:stop])
            arrays = {c: block.column(c).combine_chunks() for c in names}
            for column in names:
                if arrays[column].null_count:
                    i = int(np.flatnonzero(arrays[column].is_null().to_numpy(zero_copy_only=False))[0])
                    raise _Problem(base + i, column, "is missing (null)", _FIXES["missing"])
            ids = arrays["input_ids"]
            lengths = ids.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
            all_lengths[base:stop] = lengths
            self._lengths(lengths, base)
            offsets = np.zeros(lengths.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            self._ids(ids.flatten().to_numpy(zero_copy_only=False), offsets, base, "input_ids")
            if "length" in arrays:
                given = arrays["length"].to_numpy(zero_copy_only=False)
                bad = np.flatnonzero(given != lengths)
                if bad.size:
                    i = int(bad[0])
                    raise _Problem(base + i, "length", f"says {given[i]} tokens but input_ids has {lengths[i]}", _FIXES["length_col"])
            documents = self._documents(arrays, offsets, lengths, base)
            doc_starts, per_row = documents if documents is not None else (None, np.ones(lengths.size, dtype=np.int64))
            if documents is not None:
                n_documents = (n_documents or 0) + int(per_row.sum())
            elif n_documents is not None:
                n_documents += int(lengths.size)
            for column in ("labels", "attention_mask"):
                if column not in arrays:
                    continue
                col = arrays[column]
                col_lengths = col.value_lengths().to_numpy(zero_copy_only=False)
                bad = np.flatnonzero(col_lengths != lengths)
                if bad.size:
                    i = int(bad[0])
                    raise _Problem(
                        base + i, column, f"has {col_lengths[i]} entries but input_ids has {lengths[i]}",
                        _FIXES["labels_len" if column == "labels" else "mask_len"],
                    )
                values = col.flatten().to_numpy(zero_copy_only=False)
                if column == "attention_mask":
                    zero = np.flatnonzero(values == 0)
                    if zero.size:
                        row = int(np.searchsorted(offsets, zero[0], side="right") - 1)
                        raise _Problem(base + row, column, f"has a 0 at token {int(zero[0] - offsets[row])} (padding)", _FIXES["mask_zero"])
                else:
                    targets = self._labels(values.astype(np.int64, copy=False), offsets, base, doc_starts)
                    n_targets += int(targets.sum())
                    without += int((targets == 0).sum())
            if "labels" not in arrays:  # the collator trains on input_ids: every token after each document's first
                n_targets += int((lengths - per_row).sum())
                without += int((lengths <= per_row).sum())
        self._totals = (n_targets, without, n_documents)

    # ------------------------------------------------------------------ any map-style dataset
    def rows(self, dataset: Any) -> DatasetCheck:
        n = len(dataset)
        lengths = np.empty(n, dtype=np.int64)
        n_targets = without = 0
        n_documents: int | None = None
        for i in range(n):
            sample = dataset[i]
            if not isinstance(sample, Mapping) or "input_ids" not in sample:
                keys = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
                raise _Problem(i, "input_ids", f"no 'input_ids' in the sample ({keys})", _FIXES["missing"])
            ids = self._row(sample["input_ids"], i, "input_ids")
            k = ids.size
            lengths[i] = k
            self._lengths(lengths[i : i + 1], i)
            offsets = np.array([0, k])
            self._ids(ids, offsets, i, "input_ids")
            if sample.get("length") is not None and int(sample["length"]) != k:
                raise _Problem(i, "length", f"says {int(sample['length'])} tokens but input_ids has {k}", _FIXES["length_col"])
            mask = sample.get("attention_mask")
            if mask is not None:
                m = self._row(mask, i, "attention_mask", allow_bool=True)
                if m.size != k:
                    raise _Problem(i, "attention_mask", f"has {m.size} entries but input_ids has {k}", _FIXES["mask_len"])
                zero = np.flatnonzero(m == 0)
                if zero.size:
                    raise _Problem(i, "attention_mask", f"has a 0 at token {int(zero[0])} (padding)", _FIXES["mask_zero"])
            docs = [k]
            if k and any(sample.get(c) is not None for c in BOUNDARY_KEYS):
                try:
                    docs = document_lengths(sample, k, "")
                except PackedBatchError as e:
                    column = "seq_lengths" if sample.get("seq_lengths") is not None else "position_ids"
                    raise _Problem(i, column, str(e).split(": ", 1)[-1].split("; ")[0], _FIXES[column]) from None
                n_documents = (n_documents or i) + len(docs)
            elif n_documents is not None:
                n_documents += 1
            labels = sample.get("labels")
            if labels is None:
                t = max(k - len(docs), 0)
            else:
                lab = self._row(labels, i, "labels")
                if lab.size != k:
                    raise _Problem(i, "labels", f"has {lab.size} entries but input_ids has {k}", _FIXES["labels_len"])
                t = int(self._labels(lab, offsets, i, np.cumsum(docs) - np.asarray(docs) if len(docs) > 1 else None)[0])
            n_targets += t
            without += t == 0
        return DatasetCheck(lengths, n_targets, int(without), n_documents)

    @staticmethod
    def _row(value: Any, i: int, column: str, allow_bool: bool = False) -> np.ndarray:
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        try:
            a = np.asarray(value)
        except (TypeError, ValueError) as e:  # ragged nesting
            raise _Problem(i, column, f"is not a flat list of integers ({e})", _FIXES["2d"]) from None
        if a.ndim == 0 and column == "labels":
            raise _Problem(i, column, f"holds one {a.dtype} value per sample, not one per token", _FIXES["sequence_label"])
        if a.ndim != 1:
            raise _Problem(i, column, f"has shape {a.shape}: each sample must be one flat sequence", _FIXES["2d"])
        if a.size and not (a.dtype.kind in "iu" or (allow_bool and a.dtype.kind == "b")):
            raise _Problem(i, column, f"holds {a.dtype} values, not integer ids", _FIXES["dtype"])
        return a.astype(np.int64, copy=False) if a.size else np.zeros(0, dtype=np.int64)


def _first_nonempty(arr: Any) -> int:
    lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
    nz = np.flatnonzero(np.nan_to_num(lengths.astype(float)) > 0)
    return int(nz[0]) if nz.size else 0
