"""Context parallelism over packed rows: documents split over the cp ranks, none ever attending to another.

torch's ring attention (:mod:`hf_gradfix.parallel.context`) is causal over the whole row, so packed documents
would see each other. Here the packed row is handled the way torch's FlexAttention CP does it (torchtitan's
document-masked CP), with every step done on the FULL row before the split:

* the documents are read from the restarted ``position_ids`` (or ``cu_seq_lens``), the labels shifted on the full
  row (``shift_labels``; the target that would cross a document boundary is -100) and the document ids and
  global positions kept for the mask;
* every document is right-padded to a multiple of ``2 x cp`` (pad tokens are ignored targets after the document's
  last token: causal attention never lets a real token see them), and torch's document-aware load balancer
  (``_PerDocumentHeadTailLoadBalancer``: each document cut into ``2 x cp`` chunks, rank r gets chunks r and
  ``2cp-1-r`` of EVERY document) permutes the row; rank r keeps the r-th contiguous slice of the permuted row;
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
           "masked_pairs_per_rank", "PACKED_DROPPED"]

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


@dataclass
class PackedLayout:
    """A packed batch laid out for context parallelism: per-document padded, balanced, ready to shard."""

    cp: int
    length: int  # padded row length, a multiple of 2 x cp
    doc_lengths: list[list[int]]  # padded document lengths per row (each a multiple of 2 x cp)
    padded: dict[str, torch.Tensor]  # full padded rows (original order): input_ids, labels, shift_labels, position_ids
    doc: torch.Tensor  # [B, L] document id of each padded token
    indices: torch.Tensor  # [B, L] load-balance permutation (torch's per-document head-tail)
    real: torch.Tensor | None = None  # [B, L] int64: 1 = a token of a document, 0 = a pad the layout added

    @classmethod
    def build(cls, inputs: Mapping[str, Any], cp: int, pad_token_id: int = 0) -> "PackedLayout":
        """Read the documents of a packed batch, shift the labels and pad every document, all on the full rows."""
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
        padded_lengths = [[n + (-n) % multiple for _, n in docs] for docs in per_row]
        total = max(sum(p) for p in padded_lengths)
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
            if at < total:  # the row's tail: one more document of pads (its own, so no real token sees it)
                tail = total - at
                for key, value in out.items():
                    value[b, at:] = torch.arange(tail, device=value.device) if key == "position_ids" else fill[key]
                new_doc[b, at:] = len(lengths)
                lengths.append(tail)
            doc_lengths.append(lengths)
        indices = load_balance_indices(doc_lengths, cp, ids.device)
        return cls(cp=cp, length=total, doc_lengths=doc_lengths, padded=out, doc=new_doc, indices=indices, real=real)

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


def masked_pairs_per_rank(doc_lengths: list[int], cp: int, balancer: str, block: int = 0) -> list[int]:
    """Attention work per cp rank for one packed row of documents (lengths multiples of ``2 x cp``): the number of
    (query, key) pairs the document-causal mask allows, or with ``block`` > 0 the number of ``block x block``
    score blocks with at least one allowed pair (what a block-sparse kernel computes). ``balancer``:
    ``"none"`` (contiguous split), ``"head_tail"`` (torch's whole-row head-tail), ``"per_document"`` (torch's
    per-document head-tail regrouped by rank, what training uses), ``"per_document_torch_order"`` (its order as
    torch 2.13 ships it). The row length must be a multiple of ``2 x cp`` (and of ``cp x block``).

    >>> masked_pairs_per_rank([8], 2, "none"), masked_pairs_per_rank([8], 2, "per_document")
    ([10, 26], [18, 18])
    """
    length = sum(doc_lengths)
    if balancer == "none":
        indices = torch.arange(length)[None]
    elif balancer == "per_document":
        indices = load_balance_indices([doc_lengths], cp)
    elif balancer == "per_document_torch_order":
        indices = load_balance_indices([doc_lengths], cp, by_rank=False)
    elif balancer == "head_tail":
        indices = load_balance_indices([[length]], cp)
    else:
        raise ValueError(f"balancer {balancer!r}: one of none, head_tail, per_document")
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
