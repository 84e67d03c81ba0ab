"""Attention paths for padding-free packing: FlashAttention 2 where flash-attn is installed, else torch's own varlen
FlashAttention kernel (``torch.nn.attention.varlen.varlen_attn``, no package needed), else a pure-PyTorch reference.

:func:`reference_flash_attn_varlen_func` has the semantics of ``flash_attn.flash_attn_varlen_func`` (flash-attn
2.x): sequences concatenated along the first axis and delimited by int32 ``cu_seqlens``; causal masking aligned
to the bottom-right corner of each sequence's score matrix; ``window_size=(left, right)`` local attention;
``softcap`` (``softcap * tanh(score / softcap)`` after scaling); ALiBi; grouped-query attention (query head
``h`` reads key/value head ``h // (H / H_kv)``); ``softmax_scale`` (default ``1/sqrt(head_dim)``); query rows
with no visible key give zeros. It is slow (a Python loop over sequences, fp32 math) and meant for CPU CI.

:func:`reference_varlen_attention_forward` wraps it exactly the way transformers' ``flash_attention_forward``
wraps the real kernel (same dispatch order: 2-D padding mask -> unpad; ``cu_seq_lens_q/k`` + ``max_length_q/k``
-> varlen over the flattened ``B*T`` stream; packed ``position_ids`` at batch size 1 -> boundaries from the
positions; otherwise dense causal attention per row; ``sliding_window`` -> ``window_size=(w-1, w-1)`` when the
key length exceeds ``w``). :func:`register_reference_varlen_attention` registers it with
``transformers.AttentionInterface`` and copies the ``flash_attention_2`` mask function into
``AttentionMaskInterface``, under a name that contains ``"flash"`` (so models take their FlashAttention code
path: no 4-D mask, kwargs passed through) but does not match ``^flash_attention_\\d$`` (which would trigger the
flash-attn package and device checks).

:func:`torch_varlen_attention_forward` is the same dispatch around :func:`torch_flash_attn_varlen_func`, which maps
flash-attn's arguments onto torch's kernel (CUDA, fp16/bf16, torch >= 2.11) and computes what that kernel lacks
(softcapping, dropout, fp32...) on the reference kernel; :func:`register_torch_varlen_attention` registers it as
:data:`TORCH_VARLEN_ATTENTION`. :func:`select_varlen_attention` picks flash-attn 2, then torch's kernel, then the
reference.

transformers 5.x treats every attention name that contains ``"flash"`` and is not ``flash_attention_<N>`` as a
hub kernel when a model is *built* with it (``from_pretrained(..., attn_implementation=NAME)`` raises
"Could not find the currently requested flash attention implementation"); build the model with ``sdpa`` and
switch with :func:`set_attention_implementation`, which works on transformers 4.57 and 5.x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError, InvalidTypeError
from ..torch_private import varlen_attention

logger = logging.getLogger("hf_gradfix")

__all__ = [
    "REFERENCE_VARLEN_ATTENTION",
    "reference_flash_attn_varlen_func",
    "reference_varlen_attention_forward",
    "register_reference_varlen_attention",
    "unregister_reference_varlen_attention",
    "select_varlen_attention",
    "choose_varlen_attention",
    "TORCH_VARLEN_ATTENTION",
    "TorchVarlenKernel",
    "torch_varlen_kernel",
    "use_torch_varlen_kernel",
    "reference_varlen_attn",
    "torch_flash_attn_varlen_func",
    "torch_varlen_attention_forward",
    "register_torch_varlen_attention",
    "torch_varlen_counts",
    "reset_torch_varlen_counts",
    "set_attention_implementation",
    "use_attention_implementation",
    "reference_branch_counts",
    "reset_reference_branch_counts",
]

REFERENCE_VARLEN_ATTENTION = "flash_varlen_reference"
#: torch's own varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``), registered like the reference.
TORCH_VARLEN_ATTENTION = "flash_varlen_torch"

# How often each dispatch branch of reference_varlen_attention_forward ran (one count per layer call).
_BRANCH_COUNTS: Counter[str] = Counter()
_REGISTERED: set[str] = set()


def reference_branch_counts() -> dict[str, int]:
    """How many attention calls took each branch of :func:`reference_varlen_attention_forward` since the last reset.

    Keys: ``"padding_mask"``, ``"cu_seq_lens"``, ``"position_ids"``, ``"dense"``.

    >>> reset_reference_branch_counts(); reference_branch_counts()
    {}
    """
    return dict(_BRANCH_COUNTS)


def reset_reference_branch_counts() -> None:
    """Zero the counters read by :func:`reference_branch_counts`.

    >>> reset_reference_branch_counts()
    """
    _BRANCH_COUNTS.clear()


# ------------------------------------------------------------------------------------------ the kernel
def _check_cu_seqlens(cu: torch.Tensor, total: int, max_seqlen: int | None, name: str) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise InvalidArgumentError(f"{name} must be a 1-D tensor with at least 2 entries")
    if cu.dtype != torch.int32:
        raise InvalidArgumentError(f"{name} must be int32 (as flash_attn_varlen_func requires), got {cu.dtype}")
    vals = [int(x) for x in cu.tolist()]
    if vals[0] != 0:
        raise InvalidArgumentError(f"{name} must start at 0, got {vals[0]}")
    if vals[-1] != total:
        raise InvalidArgumentError(f"{name} must end at the number of tokens ({total}), got {vals[-1]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise InvalidArgumentError(f"{name} must be non-decreasing, got {vals}")
    longest = max(b - a for a, b in zip(vals, vals[1:]))
    if max_seqlen is not None and int(max_seqlen) < longest:
        raise InvalidArgumentError(f"max_seqlen for {name} is {int(max_seqlen)} but the longest sequence has {longest} tokens")
    return vals


def reference_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """Pure-PyTorch ``flash_attn_varlen_func`` (flash-attn 2.x semantics) for CPU tests.

    Args:
        q: ``(total_q, H, D)``; k: ``(total_k, H_kv, D)``; v: ``(total_k, H_kv, D_v)``; ``H % H_kv == 0``.
        cu_seqlens_q / cu_seqlens_k: int32 ``(n + 1,)`` cumulative lengths from 0 to ``total_q`` / ``total_k``.
        max_seqlen_q / max_seqlen_k: must be >= the longest sequence (validated; not needed otherwise).
        causal: key ``j`` visible to query ``i`` of a sequence iff ``j <= i + len_k - len_q`` (bottom-right).
        window_size: ``(left, right)``; keys in ``[i + len_k - len_q - left, i + len_k - len_q + right]``;
            -1 is unbounded.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (after scaling).
        alibi_slopes: ``(H,)`` or ``(n, H)``; adds ``-slope * |i + len_k - len_q - j|``.
        s_aux: optional ``(H,)`` attention-sink logits (an extra softmax column that is dropped; the FA3/vLLM
            ``s_aux`` semantics; flash-attn 2 has no sinks).

    Returns the output ``(total_q, H, D_v)`` in ``q.dtype`` (math in fp32, or fp64 for fp64 inputs); with
    ``return_attn_probs``, the tuple ``(out, softmax_lse (H, total_q), None)``. ``deterministic`` is accepted and
    ignored (the reference is deterministic).

    >>> q = torch.randn(5, 4, 8); k = torch.randn(5, 2, 8); v = torch.randn(5, 2, 8)
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> out = reference_flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)
    >>> out.shape
    torch.Size([5, 4, 8])
    >>> torch.allclose(out[0], v[0].repeat_interleave(2, dim=0))  # first token of a sequence sees only itself
    True
    """
    if block_table is not None:
        raise NotImplementedError("reference_flash_attn_varlen_func: paged KV (block_table) is not supported")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise InvalidArgumentError(
            f"q, k, v must be (total_tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n_heads, n_kv = q.shape[1], k.shape[1]
    if v.shape[1] != n_kv or k.shape[0] != v.shape[0] or q.shape[2] != k.shape[2]:
        raise InvalidArgumentError(f"inconsistent k/v shapes {tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}")
    if n_heads % n_kv != 0:
        raise InvalidArgumentError(f"number of query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})")
    cq = _check_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    ck = _check_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    if len(cq) != len(ck):
        raise InvalidArgumentError(f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = n_heads // n_kv
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for half inputs, as flash-attn accumulates
    outs, lses = [], []
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        qs = q[q0:q1].to(acc)
        ks, vs = k[k0:k1].to(acc), v[k0:k1].to(acc)
        if group > 1:
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # (H, lq, lk)
        if softcap and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(lq, device=q.device).unsqueeze(1)
        j = torch.arange(lk, device=q.device).unsqueeze(0)
        rel = j - (i + lk - lq)  # 0 on the bottom-right diagonal
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[s]
            scores = scores - slopes.to(acc).view(-1, 1, 1) * rel.abs().to(scores.dtype)
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= rel <= right
        if left >= 0:
            allowed &= rel >= -left
        scores = scores.masked_fill(~allowed, float("-inf"))
        if s_aux is not None:
            sink = s_aux.to(acc).view(-1, 1, 1).expand(n_heads, lq, 1)
            full = torch.cat([scores, sink], dim=-1)
            lse = torch.logsumexp(full, dim=-1)
            probs = torch.softmax(full, dim=-1)[..., :-1]
        else:
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.softmax(scores, dim=-1)
        # A query row that sees no key (possible with windows or len_q > len_k) yields 0, as in flash-attn.
        probs = torch.where(allowed.any(-1).view(1, lq, 1), probs, torch.zeros_like(probs))
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p, training=True)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        lses.append(lse)
    if outs:
        out = torch.cat(outs, dim=0).to(q.dtype)
    else:
        out = q.new_zeros(0, n_heads, v.shape[-1])
    if return_attn_probs:
        lse_all = torch.cat(lses, dim=-1) if lses else q.new_zeros(n_heads, 0, dtype=torch.float32)
        return out, lse_all, None
    return out


# ------------------------------------------------------------------------------------------ the interface fn
def _is_packed_sequence(position_ids: torch.Tensor | None, batch_size: int) -> bool:
    """transformers' rule (modeling_flash_attention_utils._is_packed_sequence): B == 1 and not one arange."""
    if position_ids is None or batch_size != 1 or position_ids.shape[-1] == 1:
        return False
    increasing = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((increasing - position_ids).abs().sum() != 0)


def _cu_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence boundaries from packed positions, by the installed transformers' own function when available."""
    try:
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu, _), (max_len, _) = prepare_fa_kwargs_from_position_ids(position_ids)
        return cu, int(max_len)
    except ImportError:  # pragma: no cover - very old transformers
        flat = position_ids.reshape(-1)
        starts = (flat == flat.min()).nonzero().view(-1).to(torch.int32)
        cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)])
        return cu, int(cu.diff().max())


def reference_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: transformers' ``flash_attention_forward`` around the reference kernel.

    ``query`` is ``(B, H, L_q, D)``, ``key``/``value`` ``(B, H_kv, L_k, D)`` (the layout models hand to every
    attention function); returns ``((B, L_q, H, D_v), None)``. Dispatch, as in
    ``transformers.modeling_flash_attention_utils._flash_attention_forward``:

    1. a 2-D padding ``attention_mask`` (what the ``flash_attention_2`` mask function returns when there is
       padding) -> unpad, varlen, pad back (the whole unpadded row is ONE sequence);
    2. ``cu_seq_lens_q/k`` and ``max_length_q/k`` all given -> varlen over the flattened ``B*L`` stream;
    3. ``position_ids`` that are not a single ``arange`` at batch size 1 -> boundaries where the position equals
       its minimum (transformers' own ``prepare_fa_kwargs_from_position_ids``);
    4. otherwise dense attention, causal over each whole row.

    Counts the branch taken (:func:`reference_branch_counts`). :func:`torch_varlen_attention_forward` is the same
    dispatch around torch's own FlashAttention kernel.

    >>> import types
    >>> mod = types.SimpleNamespace(is_causal=True, training=False)
    >>> q = torch.randn(1, 4, 5, 8); kv = torch.randn(1, 2, 5, 8)
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> out, _ = reference_varlen_attention_forward(mod, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
    ...                                             max_length_q=3, max_length_k=3)
    >>> out.shape
    torch.Size([1, 5, 4, 8])
    """
    return _varlen_attention_forward(
        reference_flash_attn_varlen_func, module, query, key, value, attention_mask, dropout, scaling, sliding_window,
        softcap, is_causal, s_aux, **kwargs
    )


def _varlen_attention_forward(
    kernel: Callable[..., torch.Tensor],
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``flash_attention_forward`` dispatch around ``kernel`` (``flash_attn_varlen_func``'s signature)."""
    if kwargs.get("block_table") is not None or kwargs.get("cache") is not None:
        raise NotImplementedError("varlen attention: paged attention / continuous batching not supported")
    batch, _, q_len, _ = query.shape
    if any(d == 0 for d in query.shape):
        raise InvalidArgumentError("reference varlen attention: query has a zero dimension")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q = query.transpose(1, 2)  # (B, L_q, H, D)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    k_len = k.shape[1]
    # transformers: window_size=(w-1, w-1) only when the key length exceeds the window
    window = (-1, -1)
    if sliding_window is not None and k_len > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    fa_kwargs = dict(
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=softcap if softcap is not None else 0.0,
        s_aux=s_aux,
    )
    n_heads, d_v = q.shape[2], v.shape[-1]

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise InvalidArgumentError(
                f"reference varlen attention got a {attention_mask.dim()}-D attention_mask; the flash path expects a "
                "2-D padding mask (is the flash_attention_2 mask function registered for this name?)"
            )
        _BRANCH_COUNTS["padding_mask"] += 1
        mask = attention_mask.bool()
        if k_len > mask.shape[-1]:  # static cache longer than the mask
            k, v, k_len = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]], mask.shape[-1]
        lens_k = mask.sum(-1, dtype=torch.int32)
        cu_k = F.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
        idx_k = mask.reshape(-1).nonzero().view(-1)
        kf = k.reshape(-1, *k.shape[2:])[idx_k]
        vf = v.reshape(-1, *v.shape[2:])[idx_k]
        if q_len == k_len:
            q_mask = mask
        elif q_len == 1:  # decoding: every row's query is kept
            q_mask = torch.ones(batch, 1, dtype=torch.bool, device=q.device)
        else:  # left padding assumed, as in transformers
            q_mask = mask[:, -q_len:]
        lens_q = q_mask.sum(-1, dtype=torch.int32)
        cu_q = F.pad(torch.cumsum(lens_q, 0, dtype=torch.int32), (1, 0))
        idx_q = q_mask.reshape(-1).nonzero().view(-1)
        qf = q.reshape(-1, *q.shape[2:])[idx_q]
        out_f = kernel(
            qf, kf, vf, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), **fa_kwargs
        )
        out = out_f.new_zeros(batch * q_len, n_heads, d_v)
        out[idx_q] = out_f
        return out.view(batch, q_len, n_heads, d_v), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        _BRANCH_COUNTS["cu_seq_lens"] += 1
        qf, kf, vf = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        out = kernel(qf, kf, vf, cu_q, cu_k, max_q, max_k, **fa_kwargs)
        return out.view(batch, -1, n_heads, d_v), None

    position_ids = kwargs.get("position_ids")
    if _is_packed_sequence(position_ids, batch):
        _BRANCH_COUNTS["position_ids"] += 1
        cu, max_len = _cu_from_position_ids(position_ids)
        qf, kf, vf = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        out = kernel(qf, kf, vf, cu, cu, max_len, max_len, **fa_kwargs)
        return out.view(batch, -1, n_heads, d_v), None

    _BRANCH_COUNTS["dense"] += 1
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q_len
    cu_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * k_len
    qf, kf, vf = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    out = kernel(qf, kf, vf, cu_q, cu_k, q_len, k_len, **fa_kwargs)
    return out.view(batch, q_len, n_heads, d_v), None


# ------------------------------------------------------------------------------------------ torch's own kernel
@dataclasses.dataclass(frozen=True)
class TorchVarlenKernel:
    """torch's varlen FlashAttention kernel as :func:`torch_flash_attn_varlen_func` calls it.

    ``fn`` has the signature of ``torch.nn.attention.varlen.varlen_attn`` (``(q, k, v, cu_seq_q, cu_seq_k, max_q,
    max_k, *, scale, window_size[, enable_gqa])``, window ``(left, right)`` with ``right = 0`` for causal);
    ``enable_gqa``: it takes that keyword (else key/value heads are repeated to the query heads first);
    ``device_types`` / ``dtypes`` / ``max_head_dim``: what it runs (other inputs take the reference kernel).
    """

    fn: Callable[..., torch.Tensor]
    enable_gqa: bool
    device_types: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    max_head_dim: int = 256


_KERNEL_OVERRIDE: list[TorchVarlenKernel] = []  # tests substitute a kernel here (use_torch_varlen_kernel)
# Calls of torch_flash_attn_varlen_func: "kernel", or the reason the reference kernel ran instead.
_TORCH_COUNTS: Counter[str] = Counter()
_WARNED: set[str] = set()


def torch_varlen_kernel() -> TorchVarlenKernel | None:
    """torch's ``varlen_attn`` where this torch has the keywords packing needs (``torch_private.varlen_attention``),
    or the kernel a test substituted; ``None`` otherwise.

    >>> kernel = torch_varlen_kernel()
    >>> kernel is None or kernel.device_types == ("cuda",)
    True
    """
    if _KERNEL_OVERRIDE:
        return _KERNEL_OVERRIDE[-1]
    found = varlen_attention()
    return TorchVarlenKernel(found.fn, found.enable_gqa) if found.fn is not None else None


@contextlib.contextmanager
def use_torch_varlen_kernel(kernel: TorchVarlenKernel) -> Iterator[TorchVarlenKernel]:
    """Run :func:`torch_flash_attn_varlen_func` on ``kernel`` inside the block (tests: a CPU stand-in with
    ``varlen_attn``'s signature, to check the argument mapping without CUDA).

    >>> k = TorchVarlenKernel(reference_varlen_attn, enable_gqa=True, device_types=("cpu",))
    >>> with use_torch_varlen_kernel(k):
    ...     torch_varlen_kernel() is k
    True
    """
    _KERNEL_OVERRIDE.append(kernel)
    try:
        yield kernel
    finally:
        _KERNEL_OVERRIDE.remove(kernel)


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``'s semantics on the reference kernel (any device and dtype): a
    stand-in for tests. Like torch, it refuses different query and key/value head counts without ``enable_gqa``.

    >>> q = torch.randn(5, 2, 8); kv = torch.randn(5, 2, 8); cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> torch.equal(reference_varlen_attn(q, kv, kv, cu, cu, 3, 3, window_size=(-1, 0)),
    ...             reference_flash_attn_varlen_func(q, kv, kv, cu, cu, 3, 3, causal=True))
    True
    """
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise InvalidArgumentError(
            f"Expect query and key/value to have the same number of heads but got Hq={query.shape[1]} and "
            f"Hkv={key.shape[1]}. Try setting enable_gqa=True for GQA."
        )
    return reference_flash_attn_varlen_func(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                                            window_size=tuple(window_size))


def _torch_kernel_cannot(kernel: TorchVarlenKernel | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         dropout_p: float, softcap: float, alibi_slopes: Any, block_table: Any, s_aux: Any,
                         return_attn_probs: bool) -> str | None:
    """Why torch's kernel cannot compute this call exactly (``None``: it can). What it lacks, the reference does."""
    if kernel is None:
        return varlen_attention().why
    if q.device.type not in kernel.device_types:
        return f"{q.device.type} tensors (the kernel runs on {'/'.join(kernel.device_types)})"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in kernel.dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in kernel.dtypes)
        return f"{q.dtype} inputs (the kernel takes {names}: train in bf16/fp16 or with mixed precision)"
    if q.shape[-1] > kernel.max_head_dim or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return f"head_dim {q.shape[-1]} (the kernel takes multiples of 8 up to {kernel.max_head_dim})"
    if softcap and softcap > 0:
        return "attention logit softcapping (torch's varlen kernel has no softcap; flash-attn 2 has)"
    if dropout_p and dropout_p > 0:
        return "attention dropout (torch's varlen kernel has none)"
    if alibi_slopes is not None:
        return "ALiBi slopes"
    if s_aux is not None:
        return "attention sinks (s_aux)"
    if block_table is not None:
        return "paged key/value (block_table)"
    if return_attn_probs:
        return "return_attn_probs"
    return None


def torch_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` (flash-attn 2.x semantics) on torch's own FlashAttention kernel
    (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.11, CUDA, fp16/bf16): no flash-attn package needed.

    The mapping: ``softmax_scale`` -> ``scale``; ``causal`` and ``window_size=(left, right)`` -> ``window_size=
    (left, 0)`` (torch's kernel is flash-attn 2's, causal bottom-right aligned, so this is the same mask);
    grouped-query heads -> ``enable_gqa`` (or, where torch lacks it, key/value heads repeated to the query heads).
    What the kernel cannot compute exactly (softcapping, dropout, ALiBi, sinks, fp32 inputs, CPU tensors, head
    dims it lacks) runs on :func:`reference_flash_attn_varlen_func` instead, with one warning per reason: slower,
    never different. Counts in :func:`torch_varlen_counts`.
    """
    kernel = torch_varlen_kernel()
    why = _torch_kernel_cannot(kernel, q, k, v, dropout_p, softcap, alibi_slopes, block_table, s_aux,
                               return_attn_probs)
    if why is not None:
        _TORCH_COUNTS[why] += 1
        if why not in _WARNED:
            _WARNED.add(why)
            logger.warning("hf_gradfix packing: torch's varlen FlashAttention cannot compute %s; those attention calls "
                           "run on the exact pure-PyTorch reference kernel instead (slower).", why)
        return reference_flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs,
            block_table=block_table, s_aux=s_aux,
        )
    assert kernel is not None
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    max_q = int(max_seqlen_q) if max_seqlen_q is not None else int(cu_q.diff().max())
    max_k = int(max_seqlen_k) if max_seqlen_k is not None else int(cu_k.diff().max())
    options: dict[str, Any] = dict(scale=softmax_scale, window_size=(left, right))
    if k.shape[1] != q.shape[1]:
        if kernel.enable_gqa:
            options["enable_gqa"] = True
        else:  # torch 2.11: no enable_gqa; the repeat is exact (a copy of K/V per query-head group)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    _TORCH_COUNTS["kernel"] += 1
    return kernel.fn(q, k, v, cu_q, cu_k, max_q, max_k, **options)


def torch_varlen_counts() -> dict[str, int]:
    """Calls of :func:`torch_flash_attn_varlen_func` since the last reset: ``"kernel"`` (torch's kernel ran), or
    the reason the reference kernel ran instead.

    >>> reset_torch_varlen_counts(); torch_varlen_counts()
    {}
    """
    return dict(_TORCH_COUNTS)


def reset_torch_varlen_counts() -> None:
    """Zero the counters of :func:`torch_varlen_counts` (and show each fallback warning again)."""
    _TORCH_COUNTS.clear()
    _WARNED.clear()


def torch_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: :func:`reference_varlen_attention_forward`'s dispatch (transformers'
    ``flash_attention_forward``) around :func:`torch_flash_attn_varlen_func`.

    Under autocast, fp32 query/key/value (RoPE's fp32 cos/sin promote the query) are cast to the autocast dtype
    first, as transformers' flash-attn path does (``fa_peft_integration_check``).
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and torch.float32 in (query.dtype, key.dtype, value.dtype):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return _varlen_attention_forward(
        torch_flash_attn_varlen_func, module, query, key, value, attention_mask, dropout, scaling, sliding_window,
        softcap, is_causal, s_aux, **kwargs
    )


# ------------------------------------------------------------------------------------------ registration
_OUR_FUNCTIONS = (reference_varlen_attention_forward, torch_varlen_attention_forward)


def _interfaces() -> tuple[Any, Any]:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    return AttentionInterface, (AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or "flash" not in name:
        raise InvalidArgumentError(
            f"attention name {name!r} must contain 'flash' so models take their FlashAttention code path"
        )
    if re.search(r"^flash_attention_\d$", name):
        raise InvalidArgumentError(f"attention name {name!r} is reserved for the flash-attn packages (package/device checks)")
    if "/" in name or ":" in name or "|" in name:
        raise InvalidArgumentError(f"attention name {name!r} looks like a hub kernel or paged name; use a plain identifier")


def _register(name: str, function: Callable[..., Any]) -> str:
    _check_name(name)
    attn_iface, (mask_iface, all_masks) = _interfaces()
    existing = attn_iface._global_mapping.get(name)
    if existing is not None and existing is not function:
        raise InvalidArgumentError(f"attention name {name!r} is already registered to {existing!r}")
    attn_iface.register(name, function)
    # As transformers' hub-kernel integration does: the flash mask function returns None without padding and the
    # 2-D padding mask otherwise (never a 4-D mask the kernel could not use).
    mask_iface.register(name, all_masks["flash_attention_2"])
    _REGISTERED.add(name)
    return name


def register_reference_varlen_attention(name: str = REFERENCE_VARLEN_ATTENTION) -> str:
    """Register :func:`reference_varlen_attention_forward` (and the ``flash_attention_2`` mask function) globally.

    Idempotent; returns ``name``. Raises ``ValueError`` for a name without ``"flash"``, a reserved
    ``flash_attention_<N>`` name, or a name already registered to another function. Switch a model to it with
    :func:`set_attention_implementation` (works on transformers 4.57 and 5.x).

    >>> name = register_reference_varlen_attention()
    >>> name, register_reference_varlen_attention() == name
    ('flash_varlen_reference', True)
    >>> from transformers import AttentionInterface
    >>> AttentionInterface._global_mapping[name] is reference_varlen_attention_forward
    True
    """
    return _register(name, reference_varlen_attention_forward)


def register_torch_varlen_attention(name: str = TORCH_VARLEN_ATTENTION) -> str:
    """Register :func:`torch_varlen_attention_forward` (torch's own varlen FlashAttention, no flash-attn package)
    and the ``flash_attention_2`` mask function, as :func:`register_reference_varlen_attention` does. Registering
    needs no GPU; calls the kernel cannot serve (CPU, fp32...) run on the reference kernel.

    >>> register_torch_varlen_attention()
    'flash_varlen_torch'
    """
    return _register(name, torch_varlen_attention_forward)


def unregister_reference_varlen_attention(name: str = REFERENCE_VARLEN_ATTENTION) -> bool:
    """Remove a name registered by :func:`register_reference_varlen_attention` (or
    :func:`register_torch_varlen_attention`); ``True`` if it was registered.

    transformers' interfaces have no public unregister; this removes the entries from their global mappings
    (only if they are the ones this module registered).

    >>> _ = register_reference_varlen_attention("flash_varlen_doctest")
    >>> unregister_reference_varlen_attention("flash_varlen_doctest")
    True
    >>> unregister_reference_varlen_attention("flash_varlen_doctest")
    False
    """
    attn_iface, (mask_iface, _) = _interfaces()
    if attn_iface._global_mapping.get(name) not in _OUR_FUNCTIONS:
        return False
    attn_iface._global_mapping.pop(name, None)
    mask_iface._global_mapping.pop(name, None)
    _REGISTERED.discard(name)
    return True


def _flash_attn_2_usable(device: torch.device | str | None) -> bool:
    if device is not None and torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:  # pragma: no cover
        return False
    return bool(is_flash_attn_2_available())


def _torch_varlen_usable(device: torch.device | str | None) -> bool:
    """torch's varlen kernel exists here and the CUDA device can run FlashAttention (compute capability >= 8.0)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available() or torch_varlen_kernel() is None:
        return False
    index = torch.device(device).index if device is not None else None
    return torch.cuda.get_device_capability(index)[0] >= 8


def choose_varlen_attention(*, flash_attn_2: bool, torch_varlen: bool) -> str:
    """The order of preference: flash-attn 2 where it is usable, else torch's own varlen FlashAttention, else the
    pure-PyTorch reference (CPU, or a GPU without either).

    >>> choose_varlen_attention(flash_attn_2=True, torch_varlen=True)
    'flash_attention_2'
    >>> choose_varlen_attention(flash_attn_2=False, torch_varlen=True)
    'flash_varlen_torch'
    >>> choose_varlen_attention(flash_attn_2=False, torch_varlen=False)
    'flash_varlen_reference'
    """
    if flash_attn_2:
        return "flash_attention_2"
    return TORCH_VARLEN_ATTENTION if torch_varlen else REFERENCE_VARLEN_ATTENTION


def select_varlen_attention(device: torch.device | str | None = None) -> str:
    """The attention implementation for packed (varlen) training here (:func:`choose_varlen_attention`):
    ``"flash_attention_2"`` if flash-attn is installed and CUDA is available (and ``device``, if given, is a CUDA
    device); else :data:`TORCH_VARLEN_ATTENTION` where torch has its own varlen FlashAttention and the GPU runs it;
    else :data:`REFERENCE_VARLEN_ATTENTION`. The two names are registered on the way.

    >>> select_varlen_attention("cpu")
    'flash_varlen_reference'
    """
    name = choose_varlen_attention(flash_attn_2=_flash_attn_2_usable(device), torch_varlen=_torch_varlen_usable(device))
    if name == TORCH_VARLEN_ATTENTION:
        return register_torch_varlen_attention()
    if name == REFERENCE_VARLEN_ATTENTION:
        return register_reference_varlen_attention()
    return name


def _set_on_every_config(model: torch.nn.Module, config: Any, attn_implementation: str) -> None:
    """Write ``_attn_implementation`` on the model's config and on every sub-module's own config."""
    config._attn_implementation = attn_implementation
    for sub in model.modules():
        sub_cfg = getattr(sub, "config", None)
        if sub_cfg is not None and sub_cfg is not config and hasattr(sub_cfg, "_attn_implementation"):
            sub_cfg._attn_implementation = attn_implementation


def set_attention_implementation(model: torch.nn.Module, attn_implementation: str) -> str:
    """Switch ``model`` (and its sub-configs) to ``attn_implementation``; return the previous implementation.

    Names registered by :func:`register_reference_varlen_attention` are set on the config directly (transformers
    5.x would otherwise look them up as hub kernels); other names go through ``model.set_attn_implementation``
    and its checks (e.g. ``flash_attention_2`` needs flash-attn and CUDA).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                   num_key_value_heads=1, vocab_size=32)
    >>> model = LlamaForCausalLM(cfg)
    >>> previous = set_attention_implementation(model, register_reference_varlen_attention())
    >>> model.config._attn_implementation
    'flash_varlen_reference'
    >>> _ = set_attention_implementation(model, previous)
    """
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidTypeError(f"{type(model).__name__} has no .config: not a transformers model")
    previous = config._attn_implementation
    if attn_implementation == previous:
        return previous
    if attn_implementation in _REGISTERED:
        _set_on_every_config(model, config, attn_implementation)
        return previous
    if previous in _REGISTERED:
        # Leaving a custom name: set it directly as well (it was valid before the switch to the custom name).
        if attn_implementation in ("eager", "sdpa") or not hasattr(model, "set_attn_implementation"):
            _set_on_every_config(model, config, attn_implementation)
            return previous
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn_implementation)
    else:  # pragma: no cover - very old transformers
        config._attn_implementation = attn_implementation
    return previous


@contextlib.contextmanager
def use_attention_implementation(model: torch.nn.Module, attn_implementation: str | None) -> Iterator[str]:
    """Context manager: run with ``attn_implementation`` (``None``: keep the current one), then restore.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                   num_key_value_heads=1, vocab_size=32, attn_implementation="sdpa")
    >>> model = LlamaForCausalLM(cfg)
    >>> with use_attention_implementation(model, "eager") as impl:
    ...     impl, model.config._attn_implementation
    ('eager', 'eager')
    >>> model.config._attn_implementation
    'sdpa'
    """
    if attn_implementation is None:
        yield model.config._attn_implementation
        return
    previous = set_attention_implementation(model, attn_implementation)
    try:
        yield attn_implementation
    finally:
        set_attention_implementation(model, previous)
