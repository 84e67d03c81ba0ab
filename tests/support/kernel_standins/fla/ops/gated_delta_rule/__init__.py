"""Stand-in for flash-linear-attention's gated delta rule in pure PyTorch: same signatures, ``cu_seqlens`` honoured
(see ../../../README.md). The recurrence, token by token and per sequence of ``cu_seqlens``:

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (q_t * scale)

``q``, ``k`` [B, T, H, K]; ``v`` [B, T, HV, V] (HV a multiple of H: each q/k head serves HV / H value heads);
``g``, ``beta`` [B, T, HV]. With ``cu_seqlens`` (int offsets into T) the batch must be 1, as in fla, and the state
restarts from ``initial_state`` (or zero) at every offset.
"""

import torch

CALLS = {"chunk_gated_delta_rule": 0, "with_cu_seqlens": 0}


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _recurrence(q, k, v, g, beta, scale, state):
    # q, k: [H, T, K]; v: [H, T, V]; g, beta: [H, T]; state: [H, K, V] (float32)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", state, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[:, t] * scale))
    return torch.stack(outs, 1), state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    CALLS["chunk_gated_delta_rule"] += 1
    batch, seqlen, heads, dk = k.shape
    hv, dv = v.shape[-2:]
    if hv != heads:
        q = q.repeat_interleave(hv // heads, dim=2)
        k = k.repeat_interleave(hv // heads, dim=2)
    if scale is None:
        scale = dk ** -0.5
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if cu_seqlens is not None:
        CALLS["with_cu_seqlens"] += 1
        if batch != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`.")
        bounds = [(int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
        segments = [(0, a, b) for a, b in bounds]
    else:
        segments = [(r, 0, seqlen) for r in range(batch)]
    out = torch.zeros(batch, seqlen, hv, dv, dtype=torch.float32, device=v.device)
    finals = []
    for n, (r, a, b) in enumerate(segments):
        init = initial_state[n if cu_seqlens is not None else r].float() if initial_state is not None else \
            torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device)
        o, state = _recurrence(q[r, a:b].transpose(0, 1), k[r, a:b].transpose(0, 1), v[r, a:b].transpose(0, 1),
                               g[r, a:b].transpose(0, 1), beta[r, a:b].transpose(0, 1), scale, init)
        out[r, a:b] = o.transpose(0, 1)
        finals.append(state)
    final = torch.stack(finals).to(dtype) if output_final_state else None
    return out.to(dtype), final


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
