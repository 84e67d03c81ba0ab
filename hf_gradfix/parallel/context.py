"""Context parallelism (CP) for causal LMs: the batch preparation that keeps the loss exact, and the CP block.

torch's ``context_parallel`` splits the sequence dim of the given buffers over the ``cp`` ranks (head-tail
load balanced: rank r gets chunks r and 2*cp-1-r) and runs SDPA as ring attention. What must happen around it
for the loss to equal one process on the full sequence (measured: labels shifted after the split are 0.19 off;
RoPE without global ``position_ids`` 3.4e-4):

* labels shifted on the FULL sequence (``shift_labels``: ``labels[:, 1:]`` plus one -100), so the target of
  the last token of a shard is the first token of the next shard; targets counted before the split;
* ``position_ids`` of the full sequence, split with the tokens;
* the sequence length a multiple of ``2 x cp`` (the load balancer's chunks): right-padded with ignored targets,
  which a causal attention never lets earlier tokens see;
* attention causal and nothing else: the 2-D padding mask must be right padding (dropped: it only hides pads
  that come after every real token), and inside the block every SDPA call is made ``is_causal=True`` without a
  mask (ring attention takes no mask); a call that asks for non-causal attention raises.

Pure torch: no transformers, no accelerate.

>>> import torch
>>> batch = {"input_ids": torch.arange(5)[None] + 10, "labels": torch.tensor([[-100, 11, 12, 13, 14]])}
>>> out, buffers, dims = prepare_batch(batch, cp=2, pad_token_id=0)
>>> out["input_ids"].tolist(), out["shift_labels"].tolist(), out["position_ids"].tolist()
([[10, 11, 12, 13, 14, 0, 0, 0]], [[11, 12, 13, 14, -100, -100, -100, -100]], [[0, 1, 2, 3, 4, 5, 6, 7]])
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from ..errors import HfGradfixError

__all__ = ["ContextParallelError", "prepare_batch", "context_parallel_block", "SEQ_KEYS"]

IGNORE_INDEX = -100
#: batch entries with a sequence dim that CP splits (everything else of shape [batch, seq] is refused)
SEQ_KEYS = ("input_ids", "labels", "shift_labels", "position_ids")


class ContextParallelError(HfGradfixError, ValueError):
    """A batch or model that context parallelism cannot run exactly; the message says why and what to do."""


def _right_padded(mask: torch.Tensor) -> bool:
    """Each row is ones then zeros (right padding, or none)."""
    m = mask.to(torch.int64)
    if not bool(((m == 0) | (m == 1)).all()):
        return False
    return bool((m[:, 1:] <= m[:, :-1]).all()) if m.shape[1] > 1 else True


def prepare_batch(
    inputs: Mapping[str, Any], cp: int, pad_token_id: int = 0
) -> tuple[dict[str, Any], list[torch.Tensor], list[int]]:
    """The batch CP must split, and the buffers to hand to ``context_parallel`` (with their sequence dims).

    Returns a new dict (the caller's tensors are not modified): ``shift_labels`` built from the full ``labels``,
    ``position_ids`` added (or checked to be ``0..L-1`` per row: packed rows are refused), the length right-padded
    to a multiple of ``2 * cp``, the ``attention_mask`` checked to be right padding and dropped.
    """
    out = dict(inputs)
    ids = out.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ContextParallelError(
            "hf_gradfix parallel.cp: context parallelism needs `input_ids` of shape [batch, seq] in every batch "
            f"(got {type(ids).__name__}); inputs_embeds-only batches are not supported."
        )
    rows, length = ids.shape
    if "cu_seq_lens_q" in out or "cu_seqlens" in out:
        raise ContextParallelError(_PACKING)
    mask = out.pop("attention_mask", None)
    if torch.is_tensor(mask):
        if mask.dim() != 2:
            raise ContextParallelError(
                f"hf_gradfix parallel.cp: a {mask.dim()}-D attention_mask (custom or non-causal masking) cannot run "
                "under context parallelism: ring attention is causal-only. Fix: pass a 2-D padding mask or none."
            )
        if not _right_padded(mask):
            raise ContextParallelError(
                "hf_gradfix parallel.cp: the attention_mask is not right padding (left padding, or holes inside a "
                "row): ring attention is causal-only and cannot hide tokens that come before real ones. Fix: "
                "tokenizer.padding_side = 'right' (and no packing)."
            )
    positions = out.get("position_ids")
    expected = torch.arange(length, device=ids.device).expand(rows, -1)
    if positions is not None:
        if not torch.equal(positions.to(expected.device), expected.to(positions.dtype)):
            raise ContextParallelError(_PACKING)
    labels = out.get("labels")
    if torch.is_tensor(labels) and "shift_labels" not in out:
        if labels.shape != ids.shape:
            raise ContextParallelError(
                f"hf_gradfix parallel.cp: labels of shape {tuple(labels.shape)} for input_ids {tuple(ids.shape)}: "
                "context parallelism supports token-level causal LM labels only."
            )
        # shifted on the FULL sequence, before the split: the last token of a shard predicts the next shard's first
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    out["position_ids"] = expected.clone() if positions is None else positions
    for key, value in out.items():
        if key not in SEQ_KEYS and torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (rows, length):
            raise ContextParallelError(
                f"hf_gradfix parallel.cp: batch entry {key!r} has the sequence dim, and hf_gradfix does not know how "
                "to split it under context parallelism. Fix: drop it from the batch (remove_unused_columns)."
            )
    multiple = 2 * cp
    extra = (-length) % multiple
    if extra:
        fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}
        for key in SEQ_KEYS:
            value = out.get(key)
            if not torch.is_tensor(value):
                continue
            if key == "position_ids":
                tail = torch.arange(length, length + extra, device=value.device, dtype=value.dtype).expand(rows, -1)
                out[key] = torch.cat([value, tail], dim=1)
            else:
                out[key] = torch.nn.functional.pad(value, (0, extra), value=fill[key])
    else:
        for key in SEQ_KEYS:  # context_parallel splits in place: never the caller's tensors
            if torch.is_tensor(out.get(key)):
                out[key] = out[key].clone()
    buffers = [out[k] for k in SEQ_KEYS if torch.is_tensor(out.get(k))]
    return out, buffers, [1] * len(buffers)


_PACKING = (
    "hf_gradfix parallel.cp: packed rows (position_ids that restart, or cu_seq_lens) cannot run under context "
    "parallelism: torch's ring attention is causal over the whole row, so packed documents would attend to each "
    "other. Fix: disable packing (packing.enabled: false) or set parallel.cp: 1."
)


def _causal_sdpa(ring_sdpa):
    """Every SDPA call inside the block: causal, no mask (ring attention supports nothing else)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is None and not is_causal:
            raise ContextParallelError(
                "hf_gradfix parallel.cp: an attention layer asked for non-causal attention (is_causal=False, no mask); "
                "ring attention under context parallelism is causal-only. Fix: set parallel.cp: 1 for this model."
            )
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped KV heads: expand them (exact), ring takes equal heads
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        # a mask here is the model's causal (or padding-after-the-end) mask, rebuilt on local shapes: dropped
        return ring_sdpa(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale)

    return sdpa


@contextlib.contextmanager
def context_parallel_block(
    mesh, buffers: list[torch.Tensor], seq_dims: list[int], *, float64: bool = False
) -> Iterator[None]:
    """torch's ``context_parallel`` on ``mesh`` (the cp sub-mesh): splits ``buffers`` in place (not restored),
    runs every SDPA call as causal ring attention; on a CPU mesh the CPU kernel's ring handler is registered for
    the duration (:mod:`hf_gradfix.parallel.cpu_ring_attention`). ``float64``: keep torch's ring merge in fp64."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from ..torch_private import private

    cp_attention = private("torch.distributed.tensor.experimental._context_parallel", "_attention",
                           feature="context parallelism (parallel.cp > 1)")

    from . import cpu_ring_attention

    on_cpu = mesh.device_type == "cpu"
    was_registered = cpu_ring_attention.registered()
    if on_cpu:
        cpu_ring_attention.register()
    options = cp_attention._cp_options
    saved_f32 = options.convert_to_f32
    if float64:
        options.convert_to_f32 = False  # otherwise the merge of the ring's partial results drops to fp32
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)):
            ring_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _causal_sdpa(ring_sdpa)
            try:
                yield
            finally:
                # torch restores the original on exit by looking its own wrapper up: put that back first
                F.scaled_dot_product_attention = ring_sdpa
    finally:
        options.convert_to_f32 = saved_f32
        if on_cpu and not was_registered:
            cpu_ring_attention.unregister()
