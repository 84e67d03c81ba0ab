"""The documents a run's data declares, for ``hf-gradfix verify``'s ground truth (issue 50 item 1).

Verify's ground truth runs every sequence of a recorded micro-batch alone, cut where the batch itself says
(restarted ``position_ids``). A batch that trained several documents as ONE sequence says nothing of them: rows that
TRL's ``SFTConfig(packing=True)`` packed (a ``seq_lengths`` column), or a dataset packed offline with restarted
``position_ids``, collated by a collator that ignores those boundaries, reached the model as one document each, and
verify, cutting where the batch says, called that run EXACT.

So during verify's run the train loader's ``collate_fn`` is wrapped (:func:`declare_documents`): each batch it builds
carries, under :data:`KEY`, the documents its samples declare (TRL's ``seq_lengths``, restarted ``position_ids``;
read here on their own, not through the collator whose batches are checked), with a fingerprint of every sample's tokens; verify's
``training_step`` takes the key out before the step (the model never sees it) and keeps it in the recorded batch.
:func:`declared_cuts` places the samples in the recorded rows (in collation order, each checked by its fingerprint)
and returns where their documents begin; the ground truth cuts there too, so a run that mixed documents differs from
it (NOT EXACT), and the reference ``documents_merged`` (the sequences as the batch cut them) names the bug.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import torch

__all__ = ["KEY", "declare_documents", "declared_cuts", "pop_declared"]

#: the batch key carrying the declared documents: int64 ``[documents, 4]`` = (sample, length, the sample's first
#: token id, the sum of its token ids)
KEY = "hf_gradfix_declared_documents"


def _samples(features: Any) -> list[Mapping]:
    """The sample dicts a collate_fn was given, in order (a bin, a list of bins, a stream's one-bin list)."""
    if isinstance(features, Mapping):
        return [features] if "input_ids" in features else []
    if isinstance(features, Sequence) and not isinstance(features, (str, bytes)):
        return [s for f in features for s in _samples(f)]
    return []


def declared(features: Any) -> torch.Tensor | None:
    """The :data:`KEY` tensor for the samples of one collate call; None where they cannot be read (no ``input_ids``,
    padded samples: the recorded rows would not line up).

    >>> declared([{"input_ids": [5, 6, 7, 8], "seq_lengths": [1, 3]}, {"input_ids": [9]}]).tolist()
    [[0, 1, 5, 26], [0, 3, 5, 26], [1, 1, 9, 9]]
    """
    rows = []
    samples = _samples(features)
    if not samples:
        return None
    for i, sample in enumerate(samples):
        try:
            ids = torch.as_tensor(sample["input_ids"]).reshape(-1).long()
        except (TypeError, ValueError, RuntimeError):
            return None
        mask = sample.get("attention_mask")
        if ids.numel() == 0 or (mask is not None and not bool((torch.as_tensor(mask) != 0).all())):
            return None
        lengths = _document_lengths(sample, int(ids.numel()))
        rows += [[i, n, int(ids[0]), int(ids.sum())] for n in lengths]
    return torch.tensor(rows, dtype=torch.long)


def _document_lengths(sample: Mapping, n: int) -> list[int]:
    """What a sample declares, read here on its own (the ground truth does not share the collator's reading): TRL's
    ``seq_lengths``, else a new document wherever its ``position_ids`` do not go up by one, else one document; a
    declaration that does not fit the sample is no declaration."""
    given = sample.get("seq_lengths")
    if given is not None:
        try:
            lengths = [int(x) for x in torch.as_tensor(given).reshape(-1).tolist()]
        except (TypeError, ValueError, RuntimeError):
            return [n]
        return lengths if lengths and min(lengths) > 0 and sum(lengths) == n else [n]
    pos = sample.get("position_ids")
    if pos is not None:
        try:
            p = torch.as_tensor(pos).reshape(-1).long()
        except (TypeError, ValueError, RuntimeError):
            return [n]
        if p.numel() == n and n > 1:
            starts = [0] + (torch.nonzero(p[1:] - p[:-1] != 1).flatten() + 1).tolist() + [n]
            return [b - a for a, b in zip(starts[:-1], starts[1:])]
    return [n]


class _Declaring:
    """A collate_fn that adds :data:`KEY` to the batches of the one it wraps (picklable for loader workers)."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, features: Any) -> Any:
        batch = self.collate_fn(features)
        if isinstance(batch, Mapping) and torch.is_tensor(batch.get("input_ids")):
            docs = declared(features)
            if docs is not None:
                batch[KEY] = docs
        return batch


@contextlib.contextmanager
def declare_documents(trainer: Any) -> Iterator[None]:
    """While verify's run trains: the train loader the trainer builds gets its ``collate_fn`` wrapped. A loader
    that dispatches batches from one process (accelerate's ``DataLoaderDispatcher``) is left as it is: the
    documents are then read from the batches alone, as before."""
    had = "get_train_dataloader" in trainer.__dict__
    previous = trainer.__dict__.get("get_train_dataloader")
    inner = trainer.get_train_dataloader

    def get_train_dataloader(*args: Any, **kwargs: Any) -> Any:
        loader = inner(*args, **kwargs)
        # accelerate's DataLoaderShard iterates the torch DataLoader it holds (and reads its attributes through it)
        base = getattr(loader, "base_dataloader", loader)
        collate = getattr(base, "collate_fn", None)
        if callable(collate) and not isinstance(collate, _Declaring) and "Dispatcher" not in type(loader).__name__:
            base.collate_fn = _Declaring(collate)
        return loader

    trainer.get_train_dataloader = get_train_dataloader
    try:
        yield
    finally:
        if had:
            trainer.get_train_dataloader = previous
        else:
            trainer.__dict__.pop("get_train_dataloader", None)


def pop_declared(inputs: Any) -> None:
    """Take :data:`KEY` out of a batch before the model sees it (the recorded copy keeps it)."""
    if isinstance(inputs, Mapping) and KEY in inputs:
        inputs.pop(KEY)


def declared_cuts(batch: Mapping[str, Any], keep: list[torch.Tensor]) -> list[list[int]] | None:
    """Per row, the positions (among the row's kept tokens, ``keep[r]``) where a declared document begins; None
    where the batch carries no declaration or its samples cannot be placed in its rows (their tokens are not where
    collation order puts them).

    >>> b = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 0]]), KEY: declared([{"input_ids": [5, 6, 7, 8], "seq_lengths":
    ...      [1, 3]}, {"input_ids": [9]}])}
    >>> declared_cuts(b, [torch.ones(6, dtype=torch.bool)])
    [[0, 1, 4]]
    """
    docs = batch.get(KEY)
    ids = batch.get("input_ids")
    if not torch.is_tensor(docs) or not torch.is_tensor(ids) or ids.dim() != 2 or docs.dim() != 2:
        return None
    rows = [ids[r][keep[r]] for r in range(ids.shape[0])]
    cuts: list[list[int]] = [[] for _ in rows]
    r, at = 0, 0
    for s in docs[:, 0].unique(sorted=True).tolist():
        mine = docs[docs[:, 0] == s]
        total, first, checksum = int(mine[:, 1].sum()), int(mine[0, 2]), int(mine[0, 3])
        for _ in range(2):  # here, else at the start of the next row (one sample per padded row)
            span = rows[r][at:at + total] if r < len(rows) else None
            if span is not None and span.numel() == total and int(span[0]) == first and int(span.sum()) == checksum:
                break
            r, at = r + 1, 0
        else:
            return None
        for n in mine[:, 1].tolist():
            cuts[r].append(at)
            at += int(n)
    return cuts
