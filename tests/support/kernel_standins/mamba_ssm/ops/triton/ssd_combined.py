"""Stand-in for mamba-ssm's Mamba-2 scan (``mamba_ssm.ops.triton.ssd_combined``) in pure PyTorch: same signatures,
``seq_idx`` honoured (the state restarts wherever it changes), see ../../../README.md.

The recurrence, per head h of group g(h), token by token:

    dt = clamp(softplus(dt + dt_bias)) ;  S <- exp(dt * A_h) S + dt * x_t (x) B_t ;  y_t = S C_t + D_h x_t

``mamba_split_conv1d_scan_combined`` is the fused training path: split ``zxbcdt`` into z | xBC | dt, causal
convolution of xBC (the causal_conv1d stand-in, with ``seq_idx``) and SiLU, the scan, the gated RMSNorm
(``norm_before_gate``), the output projection.
"""

import torch
import torch.nn.functional as F

CALLS = {"mamba_chunk_scan_combined": 0, "mamba_split_conv1d_scan_combined": 0, "with_seq_idx": 0}


def _scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, seq_idx, initial_states):
    # x: [b, l, h, p]; dt: [b, l, h]; A: [h]; B, C: [b, l, g, n]; D: [h] or [h, p]; z: [b, l, h, p] or None
    batch, seqlen, heads, headdim = x.shape
    groups, dstate = B.shape[-2:]
    rep = heads // groups
    xf, dtf, Bf, Cf = x.float(), dt.float(), B.float(), C.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = Bf.repeat_interleave(rep, dim=2)  # [b, l, h, n]
    Ch = Cf.repeat_interleave(rep, dim=2)
    state = (initial_states.float().clone() if initial_states is not None
             else torch.zeros(batch, heads, headdim, dstate, device=x.device))
    outs = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None, None, None]
            state = state * same
        decay = torch.exp(dtf[:, t] * A.float())[:, :, None, None]
        state = state * decay + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (state * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + xf[:, t] * (D.float()[:, None] if D.dim() == 1 else D.float())
        outs.append(y)
    out = torch.stack(outs, 1)
    if z is not None:
        out = out * F.silu(z.float())
    return out.to(x.dtype), state


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    CALLS["mamba_chunk_scan_combined"] += 1
    if seq_idx is not None:
        CALLS["with_seq_idx"] += 1
    if return_varlen_states:
        raise NotImplementedError("the stand-in does not return varlen states")
    out, state = _scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, seq_idx, initial_states)
    return (out, state.to(x.dtype)) if return_final_states else out


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    from causal_conv1d import causal_conv1d_fn

    CALLS["mamba_split_conv1d_scan_combined"] += 1
    if seq_idx is not None:
        CALLS["with_seq_idx"] += 1
    if D.dim() == 1:
        heads = D.shape[0]
    else:
        heads, headdim = D.shape
    batch, seqlen, _ = zxbcdt.shape
    dim = heads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - heads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, heads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, seqlen, heads, headdim)
    B = B.reshape(batch, seqlen, ngroups, dstate)
    C = C.reshape(batch, seqlen, ngroups, dstate)
    zh = z.reshape(batch, seqlen, heads, headdim)
    out, state = _scan(x, dt, A, B, C, D, zh if rmsnorm_weight is None else None, dt_bias, True, dt_limit, seq_idx,
                       initial_states)
    out = out.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        y = out.float()
        if not norm_before_gate:
            y = y * F.silu(z.float())
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + rmsnorm_eps) * rmsnorm_weight.float()
        if norm_before_gate:
            y = y * F.silu(z.float())
        out = y.to(zxbcdt.dtype)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, state) if return_final_states else out
