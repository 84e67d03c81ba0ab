"""Padding-free collation of packed bins, and a per-batch validator.

A *bin* is a list of samples (dicts with ``input_ids`` and optional ``labels``) whose tokens are trained
together without any sequence seeing another. :class:`PackedCollator` turns bins into model inputs:

- ``mode="varlen"`` (default; FlashAttention 2/3, the reference varlen attention, and also sdpa/eager):
  ONE row (batch size 1) with the sequences back to back, ``position_ids`` restarted at every sequence,
  int32 ``cu_seq_lens_q``/``cu_seq_lens_k`` and Python-int ``max_length_q``/``max_length_k``.
  FlashAttention reads the boundaries from ``cu_seq_lens``; sdpa/eager from the restarted ``position_ids``
  (``transformers.masking_utils.find_packed_sequence_indices``).
- ``mode="rows"`` (sdpa/eager): one row per bin, each row's tail padded as its *own* position-restarted
  segment (pad id, labels -100), no ``cu_seq_lens``. The O(L^2) attention mask stays per row.

Never an ``attention_mask`` (on sdpa/eager any mask, even all ones, switches packed-sequence detection off and
lets sequences attend to each other), and labels are -100 at every sequence start (the first token of a
sequence must not be a target of the last token of the previous one), on top of the user's own -100s.

The model must also run with ``use_cache=False``: a cache created inside ``forward`` disables packed detection
on sdpa/eager as well (see :mod:`hf_gradfix.packing.guard`).

This module only needs torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from ..errors import HfGradfixError, InvalidArgumentError

__all__ = ["BOUNDARY_KEYS", "PackedBatchError", "PackedCollator", "check_packed_batch", "document_lengths",
           "host_copies"]

IGNORE_INDEX = -100

_SampleT = Mapping[str, Any]


class PackedBatchError(HfGradfixError, ValueError):
    """A sample, bin or packed batch that cannot be trained on without mixing sequences or targets.

    >>> issubclass(PackedBatchError, ValueError)
    True
    """


def _as_1d_long(value: Any, what: str) -> torch.Tensor:
    """Convert a list / tuple / numpy array / tensor of token ids to a 1-D int64 CPU tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, (list, tuple)) and len(value) == 0:
        return torch.zeros(0, dtype=torch.long)
    else:
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise PackedBatchError(
                f"{what}: expected a sequence of integer token ids, got {type(value).__name__} ({e})"
            ) from e
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise PackedBatchError(f"{what}: expected integer token ids, got dtype {t.dtype}")
    if t.dim() != 1:
        raise PackedBatchError(
            f"{what}: expected a 1-D sequence of token ids (one unpadded sample), got shape {tuple(t.shape)}"
        )
    return t.to(device="cpu", dtype=torch.long)


def _split_bins(samples: Any) -> list[list[_SampleT]]:
    """Normalize the collator input to a list of bins (a flat list of samples is one bin)."""
    if isinstance(samples, Mapping):
        raise PackedBatchError(
            "PackedCollator expects a list of samples (one bin) or a list of bins, got a single dict; wrap it in a list"
        )
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise PackedBatchError(f"PackedCollator expects a list of samples or of bins, got {type(samples).__name__}")
    if len(samples) == 0:
        raise PackedBatchError("PackedCollator got an empty batch (no samples)")
    if all(isinstance(s, Mapping) for s in samples):
        return [list(samples)]
    if all(isinstance(b, Sequence) and not isinstance(b, (str, bytes, Mapping)) for b in samples):
        bins = [list(b) for b in samples]
        for i, b in enumerate(bins):
            if len(b) == 0:
                raise PackedBatchError(f"bin {i} is empty (no samples)")
            for j, s in enumerate(b):
                if not isinstance(s, Mapping):
                    raise PackedBatchError(
                        f"bin {i}, sample {j}: expected a dict with 'input_ids', got {type(s).__name__}"
                    )
        return bins
    raise PackedBatchError(
        "PackedCollator expects either a list of sample dicts (one bin) or a list of lists of sample dicts "
        "(several bins); got a mixture"
    )


#: The keys by which a sample says it already holds several documents (see :func:`document_lengths`).
BOUNDARY_KEYS = ("seq_lengths", "position_ids")


def document_lengths(sample: _SampleT, n: int, where: str = "sample") -> list[int]:
    """The lengths of the documents one sample of ``n`` tokens holds back to back: TRL's ``seq_lengths`` (what its
    ``pack_dataset`` writes, and what its collator turns into restarted positions), else its own ``position_ids``
    where they restart (transformers' rule: a new document wherever ``diff != 1``), else one document.

    >>> document_lengths({"seq_lengths": [3, 2]}, 5), document_lengths({"position_ids": [0, 1, 0, 1, 2]}, 5)
    ([3, 2], [2, 3])
    >>> document_lengths({"input_ids": [1, 2, 3]}, 3)
    [3]
    >>> document_lengths({"seq_lengths": [3, 3]}, 5)
    Traceback (most recent call last):
    ...
    hf_gradfix.packing.collator.PackedBatchError: sample: seq_lengths [3, 3] sum to 6 tokens but input_ids has 5; each entry is the length of one document of the sample, back to back (as TRL's pack_dataset writes them)
    """
    given = sample.get("seq_lengths")
    if given is not None:
        lengths = _as_1d_long(given, f"{where} seq_lengths").tolist()
        if not lengths or min(lengths) < 1 or sum(lengths) != n:
            raise PackedBatchError(
                f"{where}: seq_lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''} sum to {sum(lengths)} tokens "
                f"but input_ids has {n}; each entry is the length of one document of the sample, back to back (as "
                "TRL's pack_dataset writes them)"
            )
        return lengths
    pos = sample.get("position_ids")
    if pos is not None:
        p = _as_1d_long(pos, f"{where} position_ids")
        if p.numel() != n:
            raise PackedBatchError(f"{where}: position_ids have {p.numel()} entries but input_ids have {n}")
        if n > 1:
            starts = [0] + ((p[1:] - p[:-1]) != 1).nonzero().flatten().add(1).tolist() + [n]
            return [b - a for a, b in zip(starts[:-1], starts[1:])]
    return [n]


class PackedCollator:
    """Collate packed bins into padding-free model inputs (usable as ``Trainer``/``DataLoader`` ``collate_fn``).

    Args:
        mode: ``"varlen"`` (one row, batch size 1, with ``cu_seq_lens_q/k`` and ``max_length_q/k``; several bins
            given at once are flattened into that one row) or ``"rows"`` (one row per bin, padded to the longest
            row, no ``cu_seq_lens``; for sdpa/eager only).
        max_tokens: token budget per bin; a bin over it raises :class:`PackedBatchError` (``None``: no check).
        pad_token_id: input id used for padding (``rows`` mode, and ``pad_to_multiple_of``).
        label_pad_id: label written at sequence starts and on padding (the loss's ``ignore_index``).
        position_ids_start: first position of every sequence (0; RoBERTa-style models use ``padding_idx + 1``).
        pad_to_multiple_of: pad the row length up to a multiple of this; in ``varlen`` mode the padding is one
            extra sequence (positions restarted, labels ``label_pad_id``, included in ``cu_seq_lens``).
        return_seq_idx: also return int32 ``seq_idx`` (index of the sequence each token belongs to, per row), used
            by Mamba-type layers.

    Each sample is a dict with ``input_ids`` (list, tuple, 1-D tensor or array of ints) and optional ``labels``
    (same length; -100 entries are kept; default: ``input_ids``). An ``attention_mask`` in a sample must be all
    ones (samples are unpadded). A sample that is already packed, several documents back to back, says so by
    ``seq_lengths`` (TRL's ``pack_dataset``, ``SFTConfig(packing=True)``) or by restarted ``position_ids``
    (:func:`document_lengths`): each of its documents becomes a sequence of its own. Other keys are ignored.
    Outputs are int64 ``input_ids``/``labels``/``position_ids`` of shape [rows, T], never an ``attention_mask``.

    >>> collate = PackedCollator()
    >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]])
    >>> batch["labels"].tolist()
    [[-100, 6, 7, -100, 9]]
    >>> batch["cu_seq_lens_q"].tolist(), batch["cu_seq_lens_q"].dtype, batch["max_length_q"]
    ([0, 3, 5], torch.int32, 3)
    >>> rows = PackedCollator(mode="rows", pad_token_id=0)([[{"input_ids": [1, 2, 3]}], [{"input_ids": [4]}]])
    >>> rows["input_ids"].tolist(), rows["position_ids"].tolist()
    ([[1, 2, 3], [4, 0, 0]], [[0, 1, 2], [0, 0, 1]])
    >>> trl_row = {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]}   # already packed: two documents
    >>> collate([trl_row])["position_ids"].tolist(), collate([trl_row])["cu_seq_lens_q"].tolist()
    ([[0, 1, 0, 1, 2]], [0, 2, 5])
    """

    def __init__(
        self,
        mode: Literal["varlen", "rows"] = "varlen",
        *,
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        label_pad_id: int = IGNORE_INDEX,
        position_ids_start: int = 0,
        pad_to_multiple_of: int | None = None,
        return_seq_idx: bool = False,
    ) -> None:
        if mode not in ("varlen", "rows"):
            raise InvalidArgumentError(f"PackedCollator: mode must be 'varlen' or 'rows', got {mode!r}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise InvalidArgumentError(f"PackedCollator: max_tokens must be a positive int or None, got {max_tokens!r}")
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int)
                                               or pad_to_multiple_of < 1):
            raise InvalidArgumentError(
                f"PackedCollator: pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}"
            )
        for key, value in (("pad_token_id", pad_token_id), ("label_pad_id", label_pad_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"PackedCollator: {key} must be an int, got {value!r}")
        if pad_token_id < 0:
            raise InvalidArgumentError(f"PackedCollator: pad_token_id must be a token id >= 0, got {pad_token_id!r}")
        if isinstance(position_ids_start, bool) or not isinstance(position_ids_start, int) or position_ids_start < 0:
            raise InvalidArgumentError(
                f"PackedCollator: position_ids_start must be a non-negative int, got {position_ids_start!r}"
            )
        self.mode = mode
        self.max_tokens = max_tokens
        self.pad_token_id = int(pad_token_id)
        self.label_pad_id = int(label_pad_id)
        self.position_ids_start = position_ids_start
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_seq_idx = return_seq_idx

    def __repr__(self) -> str:
        return (
            f"PackedCollator(mode={self.mode!r}, max_tokens={self.max_tokens}, pad_token_id={self.pad_token_id}, "
            f"label_pad_id={self.label_pad_id}, position_ids_start={self.position_ids_start}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of}, return_seq_idx={self.return_seq_idx})"
        )

    # ------------------------------------------------------------------ samples
    def _sample(self, sample: _SampleT, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if "input_ids" not in sample:
            raise PackedBatchError(f"{where}: no 'input_ids' key (keys: {sorted(sample)})")
        ids = _as_1d_long(sample["input_ids"], f"{where} input_ids")
        n = ids.numel()
        if n == 0:
            raise PackedBatchError(f"{where}: empty sample (0 input_ids); drop empty samples before packing")
        if bool((ids < 0).any()):
            at = int((ids < 0).nonzero()[0])
            raise PackedBatchError(f"{where}: input_ids[{at}] = {int(ids[at])}: a token id must be >= 0 (the embedding "
                                   "would index from the end, or fail on a GPU)")
        labels_in = sample.get("labels")
        if labels_in is None:
            labels = ids.clone()
        else:
            labels = _as_1d_long(labels_in, f"{where} labels").clone()
            if labels.numel() != n:
                raise PackedBatchError(
                    f"{where}: labels have {labels.numel()} entries but input_ids have {n}; labels must be "
                    "unshifted and aligned with input_ids (the model shifts them)"
                )
            bad = (labels < 0) & (labels != self.label_pad_id)
            if bool(bad.any()):
                at = int(bad.nonzero()[0])
                raise PackedBatchError(f"{where}: labels[{at}] = {int(labels[at])}: a label is a token id >= 0 or the "
                                       f"ignore index {self.label_pad_id} (cross-entropy would fail or train on it)")
        mask = sample.get("attention_mask")
        if mask is not None:
            m = torch.as_tensor(mask)
            if m.numel() != n or not bool((m.reshape(-1) != 0).all()):
                raise PackedBatchError(
                    f"{where}: attention_mask has zeros or a different length than input_ids; packed samples must "
                    "be unpadded (strip the padding before packing)"
                )
        # The first token of every sequence must never be a target: after the model's internal shift it would be
        # predicted from the previous sequence's last token. So for every document of an already packed sample.
        pieces = []
        at = 0
        for length in document_lengths(sample, n, where):
            piece = labels[at:at + length].clone()
            piece[0] = self.label_pad_id
            pieces.append((ids[at:at + length], piece))
            at += length
        return pieces

    def _bin(self, bin_samples: list[_SampleT], b: int, n_bins: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seqs = []
        for j, s in enumerate(bin_samples):
            where = f"sample {j}" if n_bins == 1 else f"bin {b}, sample {j}"
            seqs.extend(self._sample(s, where))
        total = sum(ids.numel() for ids, _ in seqs)
        if self.max_tokens is not None and total > self.max_tokens:
            lengths = [ids.numel() for ids, _ in seqs]
            raise PackedBatchError(
                f"bin {b} holds {total} tokens, over the token budget max_tokens={self.max_tokens} "
                f"(sample lengths {lengths}); pack with the same budget or raise max_tokens"
            )
        return seqs

    def _positions(self, length: int) -> torch.Tensor:
        return torch.arange(self.position_ids_start, self.position_ids_start + length, dtype=torch.long)

    def _pad_len(self, length: int) -> int:
        m = self.pad_to_multiple_of
        return 0 if m is None else (-length) % m

    # ------------------------------------------------------------------ call
    def __call__(self, samples: Sequence[_SampleT] | Sequence[Sequence[_SampleT]]) -> dict[str, Any]:
        """Collate one bin (a list of samples) or several bins (a list of lists of samples).

        >>> PackedCollator()([{"input_ids": [1, 2]}, {"input_ids": [3]}])["cu_seq_lens_k"].tolist()
        [0, 2, 3]
        """
        bins = _split_bins(samples)
        packed = [self._bin(b, i, len(bins)) for i, b in enumerate(bins)]
        if self.mode == "varlen":
            return self._varlen([seq for b in packed for seq in b])
        return self._rows(packed)

    def _varlen(self, seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        ids = [s[0] for s in seqs]
        labels = [s[1] for s in seqs]
        lengths = [t.numel() for t in ids]
        pad = self._pad_len(sum(lengths))
        if pad:
            # One extra sequence: restarted positions, nothing to predict; FA sees it as its own segment too.
            ids.append(torch.full((pad,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((pad,), self.label_pad_id, dtype=torch.long))
            lengths.append(pad)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        max_len = int(max(lengths))
        batch: dict[str, Any] = {
            "input_ids": torch.cat(ids).unsqueeze(0),
            "labels": torch.cat(labels).unsqueeze(0),
            "position_ids": torch.cat([self._positions(n) for n in lengths]).unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(),
            "max_length_q": max_len,
            "max_length_k": max_len,
        }
        if self.return_seq_idx:
            batch["seq_idx"] = torch.repeat_interleave(
                torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
            ).unsqueeze(0)
        return batch

    def _rows(self, packed: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, Any]:
        row_lens = [sum(ids.numel() for ids, _ in b) for b in packed]
        width = max(row_lens)
        width += self._pad_len(width)
        n_rows = len(packed)
        input_ids = torch.full((n_rows, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n_rows, width), self.label_pad_id, dtype=torch.long)
        position_ids = torch.empty((n_rows, width), dtype=torch.long)
        seq_idx = torch.empty((n_rows, width), dtype=torch.int32)
        for r, b in enumerate(packed):
            off = 0
            for k, (ids, lab) in enumerate(b):
                n = ids.numel()
                input_ids[r, off : off + n] = ids
                labels[r, off : off + n] = lab
                position_ids[r, off : off + n] = self._positions(n)
                seq_idx[r, off : off + n] = k
                off += n
            if off < width:
                # The tail padding is its own sequence with restarted positions: transformers'
                # find_packed_sequence_indices opens a new segment wherever diff(position_ids) != 1, and
                # start - (start + n_last - 1) = 1 - n_last != 1 always, so no real token attends to padding
                # (causality already guarantees it) and padding never extends the last sequence. Restarting
                # (rather than continuing) also keeps absolute-position models inside their position table.
                position_ids[r, off:] = self._positions(width - off)
                seq_idx[r, off:] = len(b)
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if self.return_seq_idx:
            batch["seq_idx"] = seq_idx
        return batch


# ---------------------------------------------------------------------- validator
def _segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, T]: True where a new sequence starts, by transformers' rule (diff of positions != 1)."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    starts[:, 0] = True  # every row starts a sequence
    return starts


_CHECKED_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "labels", "shift_labels")


def host_copies(batches: list) -> list:
    """The batches with the integer tensors :func:`check_packed_batch` reads (positions, ``cu_seq_lens``, labels)
    brought to the host in ONE transfer for all of them (one device-to-host sync per window instead of several per
    micro-batch); other values are the batch's own. Tensors on several devices are left as they are.

    >>> b = PackedCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    >>> [c["labels"].tolist() == b["labels"].tolist() for c in host_copies([b, b])]
    [True, True]
    """
    parts, where = [], []
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            continue
        for key in _CHECKED_KEYS:
            v = batch.get(key)
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool and v.numel():
                parts.append(v)
                where.append((i, key))
    out = [dict(b) if isinstance(b, Mapping) else b for b in batches]
    if not parts or len({p.device for p in parts}) != 1:
        return out
    flat = torch.cat([p.detach().reshape(-1).to(torch.int64) for p in parts]).to("cpu")  # the one sync
    for (i, key), p, chunk in zip(where, parts, flat.split([p.numel() for p in parts])):
        out[i][key] = chunk.reshape(p.shape).to(p.dtype)
    return out


def check_packed_batch(batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> None:
    """Raise :class:`PackedBatchError` if a packed batch could mix sequences or targets; return ``None`` if fine.

    Checks: no ``attention_mask``, ``past_key_values`` or ``use_cache=True``; 2-D ``input_ids`` with matching
    2-D integer ``position_ids`` (mRoPE: ``[4, rows, T]``, whose row 0, the text positions, is checked) (and
    ``labels``); with ``cu_seq_lens_q/k``: batch size 1, 1-D int32, equal,
    from 0 to T and strictly increasing, ``position_ids`` restarted exactly at those boundaries, and Python-int
    ``max_length_q/k`` equal to the longest sequence; labels ``ignore_index`` at every sequence start (the
    boundaries are read from ``cu_seq_lens`` if present, else from ``position_ids`` the way transformers does).

    >>> good = PackedCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    >>> check_packed_batch(good)
    >>> bad = dict(good, attention_mask=torch.ones_like(good["input_ids"]))
    >>> try:
    ...     check_packed_batch(bad)
    ... except PackedBatchError as e:
    ...     print(str(e).split(":")[0])
    packed batch has an attention_mask
    """
    if not isinstance(batch, Mapping):
        raise PackedBatchError(f"packed batch must be a dict, got {type(batch).__name__}")
    if batch.get("attention_mask") is not None:
        raise PackedBatchError(
            "packed batch has an attention_mask: on sdpa/eager any mask (even all ones) switches off "
            "transformers' packed-sequence detection so sequences attend to each other, and a 0 in it merges "
            "sequences on FlashAttention; drop it (boundaries come from position_ids / cu_seq_lens)"
        )
    if batch.get("past_key_values") is not None:
        raise PackedBatchError("packed batch carries past_key_values: a cache disables packed-sequence detection")
    if batch.get("use_cache") is True:
        raise PackedBatchError(
            "packed batch sets use_cache=True: a cache built inside forward disables packed-sequence detection "
            "on sdpa/eager; use use_cache=False"
        )
    if "input_ids" not in batch or not isinstance(batch["input_ids"], torch.Tensor):
        raise PackedBatchError("packed batch has no input_ids tensor")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise PackedBatchError(f"input_ids must be 2-D [batch, tokens], got shape {tuple(input_ids.shape)}")
    n_rows, T = input_ids.shape
    position_ids = batch.get("position_ids")
    if not isinstance(position_ids, torch.Tensor):
        raise PackedBatchError(
            "packed batch has no position_ids: without restarted positions sdpa/eager attend across sequences "
            "and absolute-position models see wrong positions"
        )
    if position_ids.dim() == 3 and tuple(position_ids.shape[1:]) == (n_rows, T):
        # mRoPE: [4, rows, T] = the text positions (what the packed mask and FlashAttention read) + the 3 rope rows
        if position_ids.shape[0] != 4:
            raise PackedBatchError(
                f"position_ids of shape {tuple(position_ids.shape)}: {position_ids.shape[0]}-row mRoPE positions do "
                "not isolate packed documents (transformers builds the packed mask only from row 0 of a 4-row "
                "[4, rows, T] tensor); prepend the per-document text positions (MultimodalPackedCollator does)"
            )
        position_ids = position_ids[0]
    if position_ids.dim() != 2 or tuple(position_ids.shape) != (n_rows, T):
        raise PackedBatchError(
            f"position_ids must have the shape of input_ids {(n_rows, T)} (or [4, {n_rows}, {T}] for mRoPE: text "
            f"positions + 3 rope rows), got {tuple(position_ids.shape)}"
        )
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise PackedBatchError(f"position_ids must be integers, got {position_ids.dtype}")
    labels = batch.get("labels")
    if labels is not None and (not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (n_rows, T)):
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise PackedBatchError(f"labels must be a tensor of the shape of input_ids {(n_rows, T)}, got {shape}")

    pos = position_ids.detach().to("cpu", torch.long)
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise PackedBatchError("packed batch has only one of cu_seq_lens_q / cu_seq_lens_k; give both")
        if n_rows != 1:
            raise PackedBatchError(
                f"cu_seq_lens with batch size {n_rows}: FlashAttention indexes cu_seq_lens into the flattened "
                "batch*tokens stream, so a varlen batch must be ONE row; use mode='rows' (no cu_seq_lens) for "
                "several rows on sdpa/eager"
            )
        for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1:
                raise PackedBatchError(f"{name} must be a 1-D tensor")
            if cu.dtype != torch.int32:
                raise PackedBatchError(f"{name} must be int32 (flash_attn_varlen_func's dtype), got {cu.dtype}")
        if not torch.equal(cu_q.cpu(), cu_k.cpu()):
            raise PackedBatchError("cu_seq_lens_q and cu_seq_lens_k differ (packed self-attention needs them equal)")
        cu = cu_q.detach().to("cpu", torch.long)
        if cu.numel() < 2:
            raise PackedBatchError(f"cu_seq_lens_q needs at least 2 entries (0 and T), got {cu.tolist()}")
        if int(cu[0]) != 0:
            raise PackedBatchError(f"cu_seq_lens_q must start at 0, got {int(cu[0])}")
        if int(cu[-1]) != T:
            raise PackedBatchError(f"cu_seq_lens_q must end at the number of tokens T={T}, got {int(cu[-1])}")
        lens = torch.diff(cu)
        if not bool((lens > 0).all()):
            raise PackedBatchError(f"cu_seq_lens_q must be strictly increasing, got {cu.tolist()}")
        max_len = int(lens.max())
        for name in ("max_length_q", "max_length_k"):
            v = batch.get(name)
            if v is None:
                raise PackedBatchError(f"packed batch has cu_seq_lens but no {name}")
            if isinstance(v, bool) or not isinstance(v, int):
                raise PackedBatchError(
                    f"{name} must be a Python int (a tensor breaks torch.compile and costs a sync), got "
                    f"{type(v).__name__}"
                )
            if v != max_len:
                raise PackedBatchError(f"{name}={v} but the longest sequence in cu_seq_lens_q is {max_len}")
        starts = torch.zeros(T, dtype=torch.bool)
        starts[cu[:-1]] = True
        seg_start = torch.repeat_interleave(cu[:-1], lens)
        expected = torch.arange(T) - seg_start + pos[0, 0]
        if not torch.equal(pos[0], expected):
            bad = int((pos[0] != expected).nonzero()[0])
            raise PackedBatchError(
                f"position_ids do not restart exactly at the cu_seq_lens boundaries (first mismatch at token {bad}: "
                f"got {int(pos[0, bad])}, expected {int(expected[bad])})"
            )
        starts = starts.unsqueeze(0)
    else:
        starts = _segment_starts(pos)
    if labels is not None:
        lab = labels.detach().to("cpu")
        at_start = lab[starts]
        if not bool((at_start == ignore_index).all()):
            idx = starts.nonzero()[(at_start != ignore_index).nonzero()[0, 0]].tolist()
            raise PackedBatchError(
                f"labels must be {ignore_index} at every sequence start (row {idx[0]}, token {idx[1]} has label "
                f"{int(lab[idx[0], idx[1]])}): otherwise the previous sequence's last token is trained to "
                "predict the next sequence's first token"
            )
