"""Context parallelism over packed rows: documents split over the cp ranks, none ever attending to another.

torch's ring attention (:mod:`hf_gradfix.parallel.context`) is causal over the whole row, so packed documents
would see each other. Here the packed row is handled the way torch's FlexAttention CP does it (torchtitan's
document-masked CP), with every step done on the FULL row before the split:

* the documents are read from the restarted ``position_ids`` (or ``cu_seq_lens``), the labels shifted on the full
  row (``shift_labels``; the target that would cross a document boundary is -100) and the document ids and
  global positions kept for the mask;
* ``balance="per_document"`` (the default): every document is right-padded to a multiple of ``2 x cp`` (pad
  tokens are ignored targets after the document's last token: causal attention never lets a real token see them),
  and torch's document-aware load balancer (``_PerDocumentHeadTailLoadBalancer``: each document cut into ``2 x cp``
  chunks, rank r gets chunks r and ``2cp-1-r`` of EVERY document) permutes the row; rank r keeps the r-th
  contiguous slice of the permuted row;
* ``balance="long_documents"`` (:func:`long_document_indices`): only the documents longer than ``threshold`` tokens
  are padded and cut head-tail like that; the others stay whole and unpadded and are dealt to the rank with the
  least attention work (greedy, longest first, cost ``n (n + 1) / 2`` allowed pairs) that has room for them in an
  equal slice length (one that fits nowhere whole is cut in contiguous pieces over the ranks' room); each rank's
  slice is then filled to that length with pad tokens that are each their own one-token document (ignored targets,
  seen by nothing but themselves), so a row gains fewer pads and fewer partly masked blocks;
* attention (every ``F.scaled_dot_product_attention`` call inside the block) all-gathers keys and values over
  the cp group (autograd: the gradients are all-reduced back onto their rank's slice) and attends the local
  queries to the whole row with the document-causal mask rewritten to the permuted order: query i of rank r may
  see key j iff both are in the same document and ``global(i) >= global(j)``. The mask the model builds itself
  (from the local, permuted ``position_ids``) is dropped.

Why not torch's FlexAttention kernel: on CPU torch 2.13 refuses its backward ("FlexAttention does not support
backward on CPU. Please set the input requires_grad to False or use another device."), so the mask is applied
through SDPA (a dense boolean mask of ``local x full`` per row: memory ``L^2 / cp`` bits per row). The
decomposition (balancer, all-gather, rewritten mask) is the one torch's ``_ContextParallel`` FLEX style uses.

Pure torch: no transformers, no accelerate.

>>> import torch
>>> batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 6]]), "labels": torch.tensor([[-100, 2, 3, -100, 5, 6]]),
...          "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
>>> layout = PackedLayout.build(batch, cp=2, pad_token_id=0)
>>> layout.doc_lengths, layout.length
([[4, 4]], 8)
>>> layout.shard(batch_key="input_ids", rank=0).tolist(), layout.shard(batch_key="input_ids", rank=1).tolist()
([[1, 0, 4, 0]], [[2, 3, 5, 6]])
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from .context import ContextParallelError

__all__ = ["PackedLayout", "is_packed", "packed_attention_block", "document_ids", "load_balance_indices",
           "deal_documents", "long_document_indices", "masked_pairs_per_rank", "BALANCERS", "PACKED_DROPPED"]

IGNORE_INDEX = -100
PACKED_DROPPED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")


def is_packed(inputs: Mapping[str, Any]) -> bool:
    """The batch holds packed rows: ``cu_seq_lens`` or ``position_ids`` that restart inside a row."""
    if any(k in inputs for k in ("cu_seq_lens_q", "cu_seqlens")):
        return True
    positions = inputs.get("position_ids")
    if not torch.is_tensor(positions) or positions.dim() != 2 or positions.shape[1] < 2:
        return False
    return bool((torch.diff(positions, dim=-1) != 1).any())


def document_ids(position_ids: torch.Tensor, cu_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] int64: the index of the document each token belongs to, within its row (transformers' rule: a new
    document wherever the positions do not go up by one; ``cu_seq_lens`` boundaries too, for one-row batches).

    >>> document_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
    [[0, 0, 0, 1, 1, 2]]
    """
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    starts[:, 0] = True
    if cu_seq_lens is not None and position_ids.shape[0] == 1:
        bounds = cu_seq_lens.to(torch.long)
        bounds = bounds[(bounds > 0) & (bounds < position_ids.shape[1])]
        starts[0, bounds] = True
    return starts.to(torch.long).cumsum(-1) - 1


def load_balance_indices(doc_lengths: list[list[int]], cp: int, device: Any = "cpu", *, by_rank: bool = True) -> torch.Tensor:
    """[B, L] permutation of each row (every document length a multiple of ``2 x cp``): position p of the permuted
    row holds token ``indices[b, p]`` of the original row; rank r keeps the r-th contiguous ``L / cp`` slice.

    Built from torch's ``_PerDocumentHeadTailLoadBalancer``, whose indices (torch 2.13) list each document's chunks
    rank by rank (document 0: rank 0's head and tail, rank 1's, ...; then document 1): split into contiguous
    shards as torch's own ``_context_parallel_shard`` does, that hands whole documents to a rank, unlike the
    balance its docstring draws. ``by_rank`` (default) regroups them so that rank r gets its head and tail chunk of
    EVERY document (the docstring's layout); ``by_rank=False`` is torch's order as shipped (for the benchmark).

    >>> load_balance_indices([[4, 4]], 2, by_rank=False).tolist(), load_balance_indices([[4, 4]], 2).tolist()
    ([[0, 3, 1, 2, 4, 7, 5, 6]], [[0, 3, 4, 7, 1, 2, 5, 6]])
    """
    from ..torch_private import private

    balancer = private("torch.distributed.tensor.experimental._attention", "_PerDocumentHeadTailLoadBalancer",
                       feature="context parallelism with packing (parallel.cp > 1, packing.enabled)")
    indices = balancer(doc_lengths, cp, device)._generate_indices(restore=False).to(torch.long)
    if not by_rank:
        return indices
    rows = []
    for b, lengths in enumerate(doc_lengths):
        per_doc = torch.split(indices[b], lengths)  # each: rank 0's two chunks, rank 1's, ...
        parts = [p.reshape(cp, -1) for p in per_doc]
        rows.append(torch.cat([part[r] for r in range(cp) for part in parts]))
    return torch.stack(rows)


#: ``PackedLayout.build(balance=...)`` / ``parallel.cp_balance``: how a packed row is laid out over the cp ranks
BALANCERS = ("per_document", "long_documents")


def _pairs(n: int) -> int:
    """Allowed (query, key) pairs of a causal document of ``n`` tokens: its attention work on any masked kernel."""
    return n * (n + 1) // 2


def _split(doc_lengths: list[int], cp: int, threshold: int | None) -> list[bool]:
    """Which documents of a row ``long_documents`` cuts head-tail: longer than ``threshold`` or than the row's share
    (the row's own share, not a wider capacity: longer than that, whole on one rank, it would outweigh the others)."""
    share = -(-sum(doc_lengths) // cp)
    limit = share if threshold is None else min(threshold, share)
    return [n > limit for n in doc_lengths]


def deal_documents(doc_lengths: list[int], cp: int, threshold: int | None = None, capacity: int = 0
                   ) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """One packed row, ``long_documents`` balance: (each document's laid-out length, the ``(start, end)`` ranges of
    the laid-out row each rank holds, in row order).

    A document longer than ``threshold`` tokens, or longer than a rank's share of the row ``ceil(tokens / cp)``
    (``threshold=None``: only those), is padded to a multiple of ``2 x cp`` and cut into ``2 x cp`` chunks, rank r
    taking chunks r and ``2cp-1-r`` (equal work on every rank). The other documents stay whole and unpadded;
    longest first, each goes to the rank with the least attention work (``n (n + 1) / 2`` pairs, the split
    documents' chunks counted) among those with room for it under ``capacity`` tokens (at least the row's share,
    ``ceil(laid-out tokens / cp)``); one that fits no rank's remaining room is cut in contiguous pieces over the
    ranks' room, so no slice exceeds ``capacity``.

    >>> deal_documents([10, 3, 2, 2], cp=2, threshold=4)  # 10 is split (padded to 12), the rest dealt whole
    ([12, 3, 2, 2], [[(0, 3), (9, 12), (12, 15)], [(3, 6), (6, 9), (15, 17), (17, 19)]])
    """
    multiple = 2 * cp
    split = _split(doc_lengths, cp, threshold)
    laid = [n + (-n) % multiple if cut else n for n, cut in zip(doc_lengths, split)]
    starts = [0]
    for n in laid[:-1]:
        starts.append(starts[-1] + n)
    capacity = max(capacity, -(-sum(laid) // cp))
    tokens, work = [0] * cp, [0] * cp
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for d in (d for d in range(len(laid)) if split[d]):
        chunk = laid[d] // multiple
        for r in range(cp):
            for c in (r, multiple - 1 - r):
                ranges[r].append((starts[d] + c * chunk, starts[d] + (c + 1) * chunk))
                # chunk c's queries see the c earlier chunks of their document and their own causal triangle
                work[r] += c * chunk * chunk + _pairs(chunk)
            tokens[r] += 2 * chunk
    for d in sorted((d for d in range(len(laid)) if not split[d]), key=lambda d: (-laid[d], d)):
        n = laid[d]
        room = [r for r in range(cp) if tokens[r] + n <= capacity]
        if room:
            rank = min(room, key=lambda r: (work[r], tokens[r], r))
            ranges[rank].append((starts[d], starts[d] + n))
            tokens[rank] += n
            work[rank] += _pairs(n)
            continue
        # no rank has room for it whole: cut in contiguous pieces over the ranks' remaining room (cp x capacity >= the
        # row's tokens, so it fits), the later pieces (more keys to see) to the lighter ranks; a slice that grew
        # instead would pad every other rank up to it
        done = 0
        for rank in sorted(range(cp), key=lambda r: (-work[r], r)):
            take = min(capacity - tokens[rank], n - done)
            if take > 0:
                ranges[rank].append((starts[d] + done, starts[d] + done + take))
                tokens[rank] += take
                work[rank] += _pairs(done + take) - _pairs(done)
                done += take
    return laid, [sorted(r) for r in ranges]


def long_document_indices(doc_lengths: list[list[int]], cp: int, threshold: int | None = None, device: Any = "cpu", *,
                          multiple: int = 1, length: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    """``long_documents`` balance of a batch of packed rows: (per row, the laid-out lengths: each document's
    (:func:`deal_documents`) then one entry of 1 per pad token of the row's tail; the [B, L] permutation, position p
    of the permuted row holding token ``indices[b, p]`` of the laid-out row, rank r keeping the r-th ``L / cp``).

    Every row gets the same slice length S: the widest row's share ``ceil(laid-out tokens / cp)``, rounded up to a
    multiple of ``multiple`` (and ``cp x S >= length``); no rank of any row holds more. The pads that fill each
    rank's slice to S come from the row's tail (after its documents), each rank's pads contiguous, at the end of its
    slice.

    >>> laid, indices = long_document_indices([[10, 3, 2, 2]], cp=2, threshold=4)
    >>> laid, indices.tolist()
    ([[12, 3, 2, 2, 1]], [[0, 1, 2, 9, 10, 11, 12, 13, 14, 19, 3, 4, 5, 6, 7, 8, 15, 16, 17, 18]])
    """
    # the capacity every row may fill: the widest row's share (a longer slice in one row pads the others anyway)
    laid_tokens = [sum(n + (-n) % (2 * cp) if cut else n for n, cut in zip(lengths, _split(lengths, cp, threshold)))
                   for lengths in doc_lengths]
    capacity = max([-(-n // cp) for n in laid_tokens] + [-(-length // cp)])
    capacity += (-capacity) % multiple
    deals = [deal_documents(lengths, cp, threshold, capacity) for lengths in doc_lengths]
    slice_length = max([capacity] + [sum(e - s for s, e in r) for _, ranges in deals for r in ranges])
    slice_length += (-slice_length) % multiple
    total = cp * slice_length
    laid_rows, rows = [], []
    for laid, ranges in deals:
        at = sum(laid)
        parts = []
        for r in range(cp):
            held = sum(e - s for s, e in ranges[r])
            parts += [torch.arange(s, e) for s, e in ranges[r]] + [torch.arange(at, at + slice_length - held)]
            at += slice_length - held
        rows.append(torch.cat(parts))
        laid_rows.append(laid + [1] * (total - sum(laid)))
    return laid_rows, torch.stack(rows).to(device)


@dataclass
class PackedLayout:
    """A packed batch laid out for context parallelism: documents padded where the balance cuts them, the row
    permuted by the balance, ready to shard (rank r keeps the r-th ``length / cp`` of the permuted row)."""

    cp: int
    length: int  # padded row length, a multiple of 2 x cp (per_document) or of cp (long_documents)
    # per row, the laid-out length of each document, then of the tail's pad documents (per_document: one, the tail;
    # long_documents: one entry of 1 per pad); entry d is document id d
    doc_lengths: list[list[int]]
    padded: dict[str, torch.Tensor]  # full padded rows (original order): input_ids, labels, shift_labels, position_ids
    doc: torch.Tensor  # [B, L] document id of each padded token
    indices: torch.Tensor  # [B, L] load-balance permutation of the padded rows
    real: torch.Tensor | None = None  # [B, L] int64: 1 = a token of a document, 0 = a pad the layout added
    balance: str = "per_document"  # one of BALANCERS

    @classmethod
    def build(cls, inputs: Mapping[str, Any], cp: int, pad_token_id: int = 0, *, balance: str = "per_document",
              threshold: int | None = None) -> "PackedLayout":
        """Read the documents of a packed batch, shift the labels, pad and permute the rows by ``balance`` (one of
        :data:`BALANCERS`; ``threshold``: ``long_documents`` splits the documents longer than this many tokens, and
        always those longer than a rank's share of the row; None: only those), all on the full rows.

        >>> batch = {"input_ids": torch.arange(1, 11)[None], "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 0, 1]])}
        >>> layout = PackedLayout.build(batch, cp=2, balance="long_documents", threshold=4)
        >>> layout.doc_lengths, layout.shard("input_ids", 0).tolist(), layout.shard("input_ids", 1).tolist()
        ([[8, 2, 2]], [[1, 2, 0, 0, 7, 8]], [[3, 4, 5, 6, 9, 10]])
        """
        if balance not in BALANCERS:
            raise ContextParallelError(f"hf_gradfix parallel.cp_balance: {balance!r} is not one of {BALANCERS}.")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
            raise ContextParallelError(f"hf_gradfix parallel.cp_balance_threshold: {threshold!r}; a number of tokens "
                                       ">= 1 (documents longer than it are split over the cp ranks).")
        ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
        if not torch.is_tensor(ids) or ids.dim() != 2:
            raise ContextParallelError(
                "hf_gradfix parallel.cp with packing: packed batches need `input_ids` of shape [batch, seq] "
                f"(got {type(ids).__name__})."
            )
        if not torch.is_tensor(positions) or positions.shape != ids.shape:
            raise ContextParallelError(
                "hf_gradfix parallel.cp with packing: packed rows need `position_ids` of the same shape as input_ids "
                "(restarting at every document); use hf_gradfix's packing collator."
            )
        mask = inputs.get("attention_mask")
        if torch.is_tensor(mask) and not bool(mask.bool().all()):
            raise ContextParallelError(
                "hf_gradfix parallel.cp with packing: a packed batch with zeros in its attention_mask; the documents "
                "are read from position_ids. Fix: drop the attention_mask (hf_gradfix's packing collator has none)."
            )
        cu = inputs.get("cu_seq_lens_q", inputs.get("cu_seqlens"))
        doc = document_ids(positions, cu if torch.is_tensor(cu) else None)
        rows, length = ids.shape
        labels = inputs.get("labels")
        if torch.is_tensor(labels) and labels.shape != ids.shape:
            raise ContextParallelError(
                f"hf_gradfix parallel.cp with packing: labels of shape {tuple(labels.shape)} for input_ids "
                f"{tuple(ids.shape)}: token-level causal LM labels only."
            )
        shift = inputs.get("shift_labels")
        if not torch.is_tensor(shift) and torch.is_tensor(labels):
            shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if torch.is_tensor(shift):  # no target across a document boundary (the next token is another document's)
            crosses = torch.nn.functional.pad(doc[:, 1:] != doc[:, :-1], (0, 1), value=True)
            shift = shift.masked_fill(crosses, IGNORE_INDEX)
        multiple = 2 * cp
        per_row: list[list[tuple[int, int]]] = []  # (start, length) of each document
        for b in range(rows):
            counts = torch.bincount(doc[b]).tolist()
            starts = [0]
            for c in counts[:-1]:
                starts.append(starts[-1] + c)
            per_row.append(list(zip(starts, counts)))
        if balance == "per_document":
            padded_lengths = [[n + (-n) % multiple for _, n in docs] for docs in per_row]
            total = max(sum(p) for p in padded_lengths)
        else:
            laid, indices = long_document_indices([[n for _, n in docs] for docs in per_row], cp, threshold,
                                                  ids.device)
            padded_lengths = [lengths[:len(docs)] for lengths, docs in zip(laid, per_row)]
            total = indices.shape[1]
        source = {"input_ids": ids, "position_ids": positions}
        if torch.is_tensor(labels):
            source["labels"] = labels
        if torch.is_tensor(shift):
            source["shift_labels"] = shift
        fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}
        out = {k: torch.empty(rows, total, dtype=v.dtype, device=v.device) for k, v in source.items()}
        new_doc = torch.empty(rows, total, dtype=torch.long, device=ids.device)
        real = torch.zeros(rows, total, dtype=torch.long, device=ids.device)
        doc_lengths: list[list[int]] = []
        for b in range(rows):
            at, lengths = 0, []
            for d, ((start, n), padded) in enumerate(zip(per_row[b], padded_lengths[b])):
                for key, value in source.items():
                    out[key][b, at:at + n] = value[b, start:start + n]
                    if key == "position_ids":  # pads continue the document's positions (after its last token)
                        base = value[b, start + n - 1] + 1
                        out[key][b, at + n:at + padded] = base + torch.arange(padded - n, device=value.device)
                    else:
                        out[key][b, at + n:at + padded] = fill[key]
                new_doc[b, at:at + padded] = d
                real[b, at:at + n] = 1
                at += padded
                lengths.append(padded)
            tail = total - at
            if tail and balance == "per_document":  # one more document of pads, after every real token: none sees it
                for key, value in out.items():
                    value[b, at:] = torch.arange(tail, device=value.device) if key == "position_ids" else fill[key]
                new_doc[b, at:] = len(lengths)
                lengths.append(tail)
            elif tail:  # long_documents: these pads fill every rank's slice, each its own one-token document (as one
                # document, a pad on one rank would attend to the pads on the others: work for nothing)
                for key, value in out.items():
                    value[b, at:] = 0 if key == "position_ids" else fill[key]
                new_doc[b, at:] = len(lengths) + torch.arange(tail, device=ids.device)
                lengths += [1] * tail
            doc_lengths.append(lengths)
        if balance == "per_document":
            indices = load_balance_indices(doc_lengths, cp, ids.device)
        return cls(cp=cp, length=total, doc_lengths=doc_lengths, padded=out, doc=new_doc, indices=indices, real=real,
                   balance=balance)

    def local_positions(self, rank: int) -> torch.Tensor:
        """[B, L/cp] the original (padded-row) index of each token rank ``rank`` holds."""
        shard = self.length // self.cp
        return self.indices[:, rank * shard:(rank + 1) * shard]

    def shard(self, batch_key: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the permuted padded row of ``batch_key``."""
        return torch.gather(self.padded[batch_key], 1, self.local_positions(rank).to(self.padded[batch_key].device))

    def shard_real(self, rank: int) -> torch.Tensor:
        """[B, L/cp] int64: which tokens of rank ``rank``'s slice are document tokens (1) or the layout's pads (0)."""
        return torch.gather(self.real, 1, self.local_positions(rank).to(self.real.device))

    def permuted(self, batch_key: str) -> torch.Tensor:
        """The whole permuted padded row of ``batch_key`` (every rank's slice, in rank order)."""
        return torch.gather(self.padded[batch_key], 1, self.indices.to(self.padded[batch_key].device))

    def full_mask(self) -> torch.Tensor:
        """[B, 1, L, L]: :meth:`mask` for one process holding every rank's slice (the guard's probe)."""
        return torch.cat([self.mask(r) for r in range(self.cp)], dim=2)

    def mask(self, rank: int) -> torch.Tensor:
        """[B, 1, L/cp, L] bool: local query i may attend gathered key j (same document, causal in the ORIGINAL
        order). The gathered keys come in the permuted order (rank 0's slice, then rank 1's, ...)."""
        q = self.local_positions(rank)
        kv = self.indices
        doc_q, doc_kv = torch.gather(self.doc, 1, q), torch.gather(self.doc, 1, kv)
        return ((doc_q[:, :, None] == doc_kv[:, None, :]) & (q[:, :, None] >= kv[:, None, :]))[:, None]


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (the sequence dim of [B, H, S, D]) over ``group``; backward: all-reduce, keep own."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        import torch.distributed as dist

        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=2)[rank].contiguous(), None


def _document_sdpa(sdpa, mask: torch.Tensor, group, calls: list[int]):
    """Every SDPA call inside the block: keys/values gathered over the cp group, the document mask applied."""

    # SDPA turns a boolean mask into an additive one of the query's dtype on every call and saves THAT for its
    # backward: [B, 1, L/cp, L] x 4 bytes per layer (measured on torch 2.13 CPU). Converting once (as torch does:
    # 0 where allowed, -inf elsewhere) and passing the same tensor to every layer makes autograd save one shared
    # storage instead of one per layer; the numbers are the same.
    additive: dict[tuple, torch.Tensor] = {}

    def additive_mask(dtype: torch.dtype, device: Any) -> torch.Tensor:
        key = (dtype, str(device))
        if key not in additive:
            additive[key] = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
                ~mask.to(device), float("-inf"))
        return additive[key]

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is None and not is_causal:
            raise ContextParallelError(
                "hf_gradfix parallel.cp with packing: an attention layer asked for non-causal attention "
                "(is_causal=False, no mask); packed CP attention is document-causal only. Fix: parallel.cp: 1."
            )
        local = mask.shape[-2] if group is not None else mask.shape[-1]
        if query.shape[-2] != mask.shape[-2] or key.shape[-2] != local or query.shape[0] != mask.shape[0]:
            raise ContextParallelError(
                f"hf_gradfix parallel.cp with packing: an attention call of shape q{tuple(query.shape)} "
                f"k{tuple(key.shape)} does not match this rank's packed shard ({mask.shape[-2]} of {mask.shape[-1]} "
                "tokens): the model attends over something other than its input sequence. Fix: parallel.cp: 1."
            )
        calls[0] += 1
        if key.shape[-3] != query.shape[-3]:  # grouped KV heads: expanded (exact); the gather is then per head
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        if group is not None:  # None: one process holding every shard (the guard's probe)
            key, value = _GatherSeq.apply(key, group), _GatherSeq.apply(value, group)
        # the model's own mask (built from the local, permuted positions) is dropped: this one is global
        return sdpa(query, key, value, attn_mask=additive_mask(query.dtype, query.device), dropout_p=dropout_p,
                    is_causal=False, scale=scale)

    return attention


@contextlib.contextmanager
def packed_attention_block(mask: torch.Tensor, group, calls: list[int] | None = None) -> Iterator[None]:
    """Inside: ``F.scaled_dot_product_attention`` is the document-masked all-gather attention for this rank
    (``mask`` from :meth:`PackedLayout.mask`, ``group`` the cp process group; ``None``: one process holding every
    slice, with :meth:`PackedLayout.full_mask`). ``calls[0]`` counts the calls."""
    import torch.nn.functional as F

    calls = calls if calls is not None else [0]
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _document_sdpa(original, mask, group, calls)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def masked_pairs_per_rank(doc_lengths: list[int], cp: int, balancer: str, block: int = 0,
                          threshold: int | None = None) -> list[int]:
    """Attention work per cp rank for one packed row of documents: the number of (query, key) pairs the
    document-causal mask allows, or with ``block`` > 0 the number of ``block x block`` score blocks with at least one
    allowed pair (what a block-sparse kernel computes). ``balancer``: ``"none"`` (contiguous split),
    ``"head_tail"`` (torch's whole-row head-tail), ``"per_document"`` (torch's per-document head-tail regrouped by
    rank, the default of training), ``"per_document_torch_order"`` (its order as torch 2.13 ships it): the lengths
    are the laid-out row (multiples of ``2 x cp``, the row a multiple of ``cp x block``); ``"long_documents"``: the
    lengths are the documents as packed, laid out here (:func:`long_document_indices`, documents longer than
    ``threshold`` split, slices a multiple of ``block``; its tail pads are one-token documents).

    >>> masked_pairs_per_rank([8], 2, "none"), masked_pairs_per_rank([8], 2, "per_document")
    ([10, 26], [18, 18])
    >>> masked_pairs_per_rank([6, 3, 3], 2, "long_documents", threshold=4)  # 6 split, the two 3s dealt whole
    [24, 24]
    """
    if balancer == "long_documents":
        laid, indices = long_document_indices([doc_lengths], cp, threshold, multiple=max(block, 1))
        doc_lengths = laid[0]
    elif balancer == "none":
        indices = torch.arange(sum(doc_lengths))[None]
    elif balancer == "per_document":
        indices = load_balance_indices([doc_lengths], cp)
    elif balancer == "per_document_torch_order":
        indices = load_balance_indices([doc_lengths], cp, by_rank=False)
    elif balancer == "head_tail":
        indices = load_balance_indices([[sum(doc_lengths)]], cp)
    else:
        raise ValueError(f"balancer {balancer!r}: one of none, head_tail, per_document, per_document_torch_order, "
                         "long_documents")
    length = sum(doc_lengths)
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    starts = torch.repeat_interleave(torch.tensor([0] + doc_lengths[:-1]).cumsum(0), torch.tensor(doc_lengths))
    allowed_keys = torch.arange(length) - starts + 1  # a query sees its document's tokens up to itself
    shard = length // cp
    work = []
    for rank in range(cp):
        q = indices[0, rank * shard:(rank + 1) * shard]
        if not block:
            work.append(int(allowed_keys[q].sum()))
            continue
        # key block j (of the gathered keys, in the permuted order) has an allowed pair with query q iff the
        # earliest token of q's document in block j comes at or before q
        kv = indices[0].reshape(length // block, block)
        first = torch.full((length // block, len(doc_lengths)), length, dtype=torch.long)
        first.scatter_reduce_(1, doc[kv], kv, reduce="amin")
        allowed = first[:, doc[q]] <= q[None, :]  # [key blocks, local queries]
        blocks = allowed.reshape(length // block, shard // block, block).any(dim=2)
        work.append(int(blocks.sum()))
    return work
