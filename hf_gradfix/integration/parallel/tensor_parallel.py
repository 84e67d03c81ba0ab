"""transformers' tensor-parallel style ``replicated_with_grad_allreduce``, corrected for gradient accumulation.

The one change hf_gradfix makes to a model instance rather than a function: :func:`fix_partial_grad_allreduce`
replaces the forward that style installs (it all-reduces the *accumulated* gradient, wrong under gradient
accumulation); checked against the transformers structure it was written for, idempotent, and undone by
:func:`restore_partial_grad_allreduce`. Called by the ND-parallel setup (:mod:`.nd`); apart from ``patch()``
(:mod:`hf_gradfix.integration.patching`), which the trainer layer imports, so the parallel glue does not import it back.
"""

from __future__ import annotations

from typing import Any

from ...errors import PatchError

__all__ = ["fix_partial_grad_allreduce", "restore_partial_grad_allreduce"]


#: the forward transformers 5.x's ``ReplicatedWithGradAllReduce.install_forward`` puts on a module, and the names its
#: closure holds (checked: another structure is a loud PatchError, not a silent no-op)
_TP_FORWARD_QUALNAME = "ReplicatedWithGradAllReduce.install_forward.<locals>.tp_forward"
_TP_FORWARD_CELLS = {"module", "original_forward", "is_already_hooked", "_all_reduce_grad"}
_ORIGINAL_ATTR = "_hf_gradfix_replaced_forward"


def _cells(fn) -> dict[str, Any]:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ()))))


def fix_partial_grad_allreduce(model: Any) -> list[str]:
    """Make transformers' ``replicated_with_grad_allreduce`` tensor-parallel style exact under gradient accumulation.

    That style (transformers 5.x, e.g. Qwen3 / Qwen3-MoE's per-head ``q_norm`` / ``k_norm``: a replicated weight
    whose gradient each tp rank holds for its own heads only) all-reduces ``param.grad`` over tp in a
    ``register_post_accumulate_grad_hook``, i.e. the gradient accumulated so far: with gradient accumulation the
    earlier micro-batches of a window, already summed, are summed tp times again (measured 1.4-1.5x at tp 2, GA 2;
    stock the same). The replacement all-reduces each backward's *incoming* gradient before it is accumulated
    (a tensor hook on the parameter): the sum over tp of every micro-batch once, the same collectives as before.
    Returns the names of the modules changed (already changed ones included: idempotent).

    >>> import torch
    >>> fix_partial_grad_allreduce(torch.nn.Linear(2, 2))   # no such module: nothing to change
    []
    """
    changed = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is None:
            continue
        if getattr(forward, _ORIGINAL_ATTR, None) is not None:
            changed.append(name)
            continue
        if getattr(forward, "__qualname__", "") != _TP_FORWARD_QUALNAME:
            continue
        cells = _cells(forward)
        mesh = _cells(cells["_all_reduce_grad"]).get("mesh") if "_all_reduce_grad" in cells else None
        if not _TP_FORWARD_CELLS <= set(cells) or mesh is None or cells["module"] is not module:
            raise PatchError(
                f"hf_gradfix: {name}: transformers' ReplicatedWithGradAllReduce forward has a structure hf_gradfix does "
                f"not know (closure {sorted(cells)}; written for transformers 5.x with {sorted(_TP_FORWARD_CELLS)}). "
                "Fix: gradient_accumulation_steps=1 with tp, or install a tested transformers."
            )
        if cells["is_already_hooked"]:
            raise PatchError(
                f"hf_gradfix: {name}: transformers already registered its accumulated-gradient all-reduce (a training "
                "forward ran before hf_gradfix set the trainer up). Fix: build the Trainer before running the model "
                "with gradients, or gradient_accumulation_steps=1 with tp."
            )
        module.forward = _incoming_grad_allreduce_forward(module, cells["original_forward"], mesh.get_group(), forward)
        changed.append(name)
    return changed


def _incoming_grad_allreduce_forward(module, original_forward, group, replaced):
    import torch
    import torch.distributed as dist

    hooked: dict[str, Any] = {}
    active = {"on": True}  # restore_partial_grad_allreduce turns the attached hooks off (stock's own come back)

    def all_reduce_incoming(grad):
        if not active["on"]:
            return None
        grad = grad.clone()  # the engine's buffer may be shared; the sum over tp goes into .grad, not into it
        dist.all_reduce(grad, group=group)
        return grad

    def tp_forward(*args, **kwargs):
        # hooks attached at the first forward with gradients, as transformers does (loading replaces the parameters;
        # FSDP2 swaps in its unsharded ones): by identity, so a new parameter object gets its hook
        if torch.is_grad_enabled():
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(pname) is not param:
                    param.register_hook(all_reduce_incoming)
                    hooked[pname] = param
        return original_forward(*args, **kwargs)

    setattr(tp_forward, _ORIGINAL_ATTR, replaced)
    tp_forward._hf_gradfix_active = active
    return tp_forward


def restore_partial_grad_allreduce(model: Any) -> int:
    """Put transformers' own forward back on every module :func:`fix_partial_grad_allreduce` changed; the hooks it
    attached stop acting (transformers attaches its own at the next forward). Returns how many.

    >>> import torch
    >>> restore_partial_grad_allreduce(torch.nn.Linear(2, 2))
    0
    """
    restored = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        original = getattr(forward, _ORIGINAL_ATTR, None)
        if original is not None:
            forward._hf_gradfix_active["on"] = False
            module.forward = original
            restored += 1
    return restored
