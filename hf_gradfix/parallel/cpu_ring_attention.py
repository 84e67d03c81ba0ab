"""Ring attention for the CPU SDPA kernel, so that torch's own ``context_parallel`` runs on CPU / gloo.

torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) turns
``F.scaled_dot_product_attention`` into a DTensor call sharded on the sequence dim; the DTensor dispatcher
then routes the attention kernel to torch's ring code (``_templated_ring_attention`` and its backward). That
routing table and the Shard(2) sharding rules cover the CUDA flash / efficient / cuDNN kernels only, so on CPU
the step fails with::

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
    sharding strategy registered.

The ring code itself is device-agnostic. :func:`register` adds, for the CPU kernel and its backward,
(a) an op strategy with two choices, all-Replicate or all-Shard(2) (the sequence dim of
``[batch, heads, seq, dim]``), and (b) a handler in torch's CP custom-op table that runs torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU kernel. Nothing else of
torch's CP changes: the head-tail load balancer, all-gather / all-to-all rotation and the merge are torch's.

**Private torch APIs** (``torch.distributed.tensor._ops.utils``, ``DTensor._op_dispatcher``,
``torch.distributed.tensor.experimental._context_parallel._attention``): written for and tested on torch
2.13 and 2.14; :func:`register` refuses other versions with one line (``HF_GRADFIX_ALLOW_UNTESTED=1`` to try anyway).
Idempotent, reversible (:func:`unregister`). On CUDA nothing of this is needed (torch's own handlers run).

>>> from hf_gradfix.parallel import cpu_ring_attention as cra
>>> cra.register(); cra.registered()
True
>>> cra.unregister(); cra.registered()
False
"""

from __future__ import annotations

import os

import torch

from ..errors import HfGradfixError, UsageError

__all__ = ["register", "unregister", "registered", "TESTED_TORCH", "UnsupportedTorchError"]

#: torch versions whose private CP internals this module was written against (``major.minor`` prefixes).
TESTED_TORCH = ("2.13", "2.14")  # 2.14.1: the whole CP suite passes (issue 20)
ALLOW_UNTESTED_ENV = "HF_GRADFIX_ALLOW_UNTESTED"
_SEQ_DIM = 2

_saved: dict | None = None  # what register() replaced, for unregister(); None: not registered


class UnsupportedTorchError(HfGradfixError, RuntimeError):
    """The installed torch is not one the CPU ring-attention registration was written for."""


def _check_version() -> None:
    version = torch.__version__.split("+")[0]
    if not any(version == v or version.startswith(v + ".") for v in TESTED_TORCH) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedTorchError(
            f"hf_gradfix context parallelism on CPU registers the CPU SDPA kernel on torch's private _context_parallel "
            f"APIs, written for torch {' / '.join(TESTED_TORCH)}, not {torch.__version__}: install torch "
            f"{TESTED_TORCH[-1]}, run CP on CUDA (torch's own kernels), or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
        )


def _ops():
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _forward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args()
    # placements: [output, logsumexp, query, key, value]; logsumexp is [batch, heads, seq]: seq is dim 2 too
    choices = [[Replicate()] * 5, [Shard(_SEQ_DIM)] * 5]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, choices, input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    # [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp]
    choices = [[Replicate()] * 9, [Shard(_SEQ_DIM)] * 9]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, choices, input_index=3)


def _ring_handler(op_call, args, kwargs):
    """torch's ``_sdpa_handler`` for the CPU kernel: unwrap the DTensors, run torch's ring on the local shards."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    forward, backward = _ops()
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise UsageError("hf_gradfix CPU ring attention: q, k, v must all be sharded on the sequence dim (Shard(2))")
    group = info.compute_mesh.get_group()
    local = dict(info.local_kwargs)
    if op_call == forward:
        query, key, value, *rest = info.local_args
        dropout_p = rest[0] if rest else local.pop("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else local.pop("is_causal", False)
        result = cp._templated_ring_attention(
            group, _SEQ_DIM, forward, query=query, key=key, value=value, is_causal=is_causal, dropout_p=dropout_p, **local
        )
        result = tuple(result[:2])
    elif op_call == backward:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = info.local_args
        result = cp._templated_ring_attention_backward(
            group, _SEQ_DIM, backward, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, **local,
        )
        result = tuple(result[:3])
    else:  # pragma: no cover - only the two ops above are registered
        raise NotImplementedError(str(op_call))
    return dispatcher.wrap(result, sharding.output_spec)


def registered() -> bool:
    """Whether :func:`register` is in force."""
    return _saved is not None


def register() -> None:
    """Make torch's ``context_parallel`` handle the CPU SDPA kernel (idempotent; see the module docstring)."""
    global _saved
    if _saved is not None:
        return
    _check_version()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    propagator = DTensor._op_dispatcher.sharding_propagator
    forward, backward = _ops()
    saved: dict = {"strategy": {}, "schema": {}, "custom": {}}
    for op in (forward, backward):
        saved["strategy"][op] = propagator.op_strategy_funcs.get(op)
        saved["schema"][op] = propagator.op_to_schema_info.get(op)
        saved["custom"][op] = cp.custom_ops.get(op)
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    # is_causal (arg 4 forward, 7 backward) changes the kernel's result: part of the sharding cache key
    register_op_strategy(forward, schema_info=RuntimeSchemaInfo(3))(_forward_strategy)
    register_op_strategy(backward, schema_info=RuntimeSchemaInfo(6))(_backward_strategy)
    # torch's CP copies this table into the DTensor dispatcher each time a context_parallel block is entered
    cp.custom_ops[forward] = _ring_handler
    cp.custom_ops[backward] = _ring_handler
    _saved = saved


def unregister() -> None:
    """Undo :func:`register` (restores what it replaced; a no-op when not registered)."""
    global _saved
    if _saved is None:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    propagator = DTensor._op_dispatcher.sharding_propagator
    for op in _ops():
        for table, key in ((propagator.op_strategy_funcs, "strategy"), (propagator.op_to_schema_info, "schema"), (cp.custom_ops, "custom")):
            old = _saved[key][op]
            if old is None:
                table.pop(op, None)
            else:
                table[op] = old
    _saved = None
