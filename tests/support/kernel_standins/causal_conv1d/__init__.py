"""Stand-in for causal-conv1d (Dao-AILab) in pure PyTorch: same signatures, ``seq_idx`` honoured (see README.md).

``causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
final_states_out=None, activation=None)``: ``x`` [batch, dim, seqlen], ``weight`` [dim, width], ``seq_idx`` int32
[batch, seqlen]; the output at position t sums only inputs of the same sequence (``seq_idx`` equal). As in the real
kernel, ``seq_idx`` needs the channel-last layout (``x.stride(1) == 1``) and no initial states.
"""

import os

import torch
import torch.nn.functional as F

CALLS = {"causal_conv1d_fn": 0, "with_seq_idx": 0}


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    CALLS["causal_conv1d_fn"] += 1
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    if seq_idx is not None:
        CALLS["with_seq_idx"] += 1
        if x.stride(1) != 1:
            raise RuntimeError("seq_idx is only supported for channel last layout")
        if initial_states is not None or return_final_states:
            raise RuntimeError("initial_states / return_final_states are not supported with seq_idx")
        if seq_idx.dtype != torch.int32 or tuple(seq_idx.shape) != (batch, seqlen):
            raise RuntimeError("seq_idx must be int32 of shape (batch, seqlen)")
    if os.environ.get("HF_GRADFIX_STANDIN_IGNORE_SEQ_IDX") == "1":
        seq_idx = None
    if seq_idx is not None and os.environ.get("HF_GRADFIX_STANDIN_MISREAD_SEQ_IDX") == "1":
        x = x * (seq_idx == 0)[:, None, :]  # read as a padding mask: nothing leaks, but the values are wrong
    out = torch.zeros_like(x, dtype=torch.float32)
    xf = x.float()
    for lag in range(width):  # out[t] += w[width-1-lag] * x[t-lag], where t-lag is in the same sequence
        shifted = F.pad(xf, (lag, 0))[:, :, :seqlen]
        term = shifted * weight[:, width - 1 - lag].float()[None, :, None]
        if seq_idx is not None and lag:
            same = F.pad(seq_idx, (lag, 0), value=-1)[:, :seqlen] == seq_idx
            term = term * same[:, None, :]
        out = out + term
    if bias is not None:
        out = out + bias.float()[None, :, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """One decoding step (generation only; training never calls it)."""
    dim, width = weight.shape
    squeeze = x.dim() == 2
    x = x.unsqueeze(-1) if squeeze else x
    seqlen = x.shape[-1]
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(full[:, :, -conv_state.shape[-1]:])
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -seqlen:]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out
