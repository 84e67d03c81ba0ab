"""``patch()`` / ``unpatch()``: the one place where hf_gradfix changes third-party code.

Exactly one function is replaced: ``transformers.Trainer.__init__``, wrapped so that every trainer
built afterwards (any subclass, e.g. TRL's ``SFTTrainer``) is fixed by :func:`trainer_fix.install`.
The replacement is version-checked (:mod:`.versions`), idempotent (a second ``patch()`` only updates
the configuration) and reversible (``unpatch()`` puts the original function object back). Around the original
``__init__`` it lets a model expert-parallel at load time pass transformers' ``save_only_model`` check (hf_gradfix
writes that model's resumable checkpoints, :mod:`.checkpoint`): the arguments are changed for ``__init__`` only.  When
``unpatch()`` cannot restore (another library wrapped ``Trainer.__init__`` after us), it raises
:class:`~hf_gradfix.errors.PatchError` and the bookkeeping stays true: ``is_patched()`` is still True
(our wrapper is still called) and a second ``patch()`` does not wrap again.

One change is made to a model instance rather than a function: :func:`fix_partial_grad_allreduce` replaces the
forward that transformers' tensor-parallel style ``replicated_with_grad_allreduce`` installs (it all-reduces the
*accumulated* gradient, wrong under gradient accumulation); checked against the transformers structure it was written
for, idempotent, and undone by :func:`restore_partial_grad_allreduce`.

Settings from several places (``$HF_GRADFIX_CONFIG`` / the launch file, ``patch(config)``,
``GradFixCallback(config)``) combine by one rule (:mod:`hf_gradfix.config.sources`): each sets the keys it names,
the others keep theirs, and a key two of them set to different values is refused in one line naming both.
"""

from __future__ import annotations

import functools
import warnings
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ..config import GradFixConfig
from ..config.sources import SettingsSource, combine, env_source, label_for, source_of
from ..errors import PatchError
from .versions import check_supported, warn_if_untested

logger = logging.getLogger("hf_gradfix")

_LOCK = threading.Lock()


@dataclass
class _ActivePatch:
    owner: type
    attr: str
    original: Any
    replacement: Any


_active: list[_ActivePatch] = []
_config: GradFixConfig | None = None
_source: SettingsSource | None = None  # what patch(config) itself set
_settings_from: str = "defaults"


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`.

    >>> import hf_gradfix
    >>> hf_gradfix.is_patched()
    False
    """
    return bool(_active)


def patch(config: GradFixConfig | dict | str | None = None) -> GradFixConfig:
    """Fix every ``transformers.Trainer`` created from now on. Call it once, before building the trainer.

    ``config``: a :class:`~hf_gradfix.GradFixConfig`, a dict, a YAML path (its ``hf_gradfix:`` section),
    or None (``$HF_GRADFIX_CONFIG`` if set, else the defaults). Returns the configuration in force.

    >>> import hf_gradfix
    >>> cfg = hf_gradfix.patch()          # every Trainer built after this normalizes exactly
    >>> cfg.loss.enabled
    True
    >>> hf_gradfix.unpatch()              # back to stock transformers
    """
    global _config, _source, _settings_from
    check_supported()
    warn_if_untested()  # once per process: the versions CI did not test, and how to install those it did
    source = source_of(config, label_for(config, "patch"))
    resolved, settings_from = combine([env_source(), source])
    with _LOCK:
        _config, _source, _settings_from = resolved, source, settings_from
        if _active:
            return resolved  # idempotent: already installed, configuration updated
        from transformers import Trainer

        original_init = Trainer.__init__

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            from .checkpoint import init_allows_ep_checkpoints

            try:
                bound = _init_signature(original_init).bind_partial(self, *args, **kwargs).arguments
            except TypeError:  # transformers raises its own error for these arguments
                bound = {}
            # an expert-parallel model sharded at load time: hf_gradfix writes its resumable checkpoints (checkpoint.py)
            with init_allows_ep_checkpoints(bound.get("model"), bound.get("args")):
                original_init(self, *args, **kwargs)
            # Only the outermost __init__ call installs (a subclass's __init__ may run more code after
            # super().__init__; install only swaps the class and attaches state, so order does not matter). A
            # GradFixCallback given to the constructor installed first, with patch()'s settings combined into its own.
            state = fix_trainer(self, _config, source="patch()", settings_from=_settings_from)
            from .nonfinite import attach

            attach(self, state.config)
            from .deepspeed import attach as attach_deepspeed

            attach_deepspeed(self, state.config)
            from .rl_packing import attach as attach_rl_packing

            attach_rl_packing(self, state.config)

        __init__._hf_gradfix_patched = True
        Trainer.__init__ = __init__
        _active.append(_ActivePatch(Trainer, "__init__", original_init, __init__))
    _warn_if_trainers_exist(Trainer)
    return resolved


@functools.lru_cache(maxsize=4)
def _init_signature(init):
    import inspect

    return inspect.signature(init)


def _warn_if_trainers_exist(trainer_cls: type) -> None:
    """patch() fixes Trainers built from now on: one warning when some were built before it (they stay stock)."""
    import gc

    from .state import state_of

    def unfixed_trainers():
        # `cls in type(o).__mro__`, not issubclass: some objects' metaclasses make issubclass slow (seconds with TRL)
        return [o for o in gc.get_objects() if trainer_cls in type(o).__mro__ and state_of(o) is None]

    earlier = unfixed_trainers()
    if earlier:  # only Trainers still in use, not ones awaiting collection (a collection costs up to a second)
        del earlier
        gc.collect()
        earlier = unfixed_trainers()
    if earlier:
        warnings.warn(
            f"hf_gradfix.patch() was called after {len(earlier)} Trainer(s) ({type(earlier[0]).__name__}) were "
            "built; those stay stock transformers (patch() fixes Trainers built after it). Call hf_gradfix.patch() "
            "before building the Trainer, or add GradFixCallback() to it at construction.",
            stacklevel=3,
        )


def unpatch() -> None:
    """Restore every function :func:`patch` replaced (the original objects). Safe to call twice.

    Trainers built while patched stay fixed; use ``hf_gradfix.integration.trainer_fix.uninstall`` on one.

    >>> import hf_gradfix
    >>> hf_gradfix.unpatch()
    """
    global _config, _source, _settings_from
    with _LOCK:
        while _active:
            item = _active[-1]
            current = item.owner.__dict__.get(item.attr)
            if current is not item.replacement:
                # Nothing is changed: our wrapper is still called (inside the other library's), so the
                # bookkeeping stays true (is_patched() is True, patch() does not wrap a second time).
                raise PatchError(
                    f"{item.owner.__name__}.{item.attr} was replaced by someone else after hf_gradfix.patch(); "
                    "refusing to overwrite it, hf_gradfix stays patched (is_patched() is True). Unpatch that "
                    "library first, then call hf_gradfix.unpatch() again."
                )
            setattr(item.owner, item.attr, item.original)
            _active.pop()
        _config, _source, _settings_from = None, None, "defaults"
    from .explained_warnings import forget_all

    forget_all()  # the explanations added to third-party warnings (explained_warnings.py)


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in a:
            out += _differences(a[key], b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if a == b else [f"{prefix}={a!r} (kept: {b!r})"]


def fix_trainer(trainer: Any, config: GradFixConfig, source: str, settings_from: str = "defaults") -> Any:
    """Install the fixes on one trainer (idempotent) and return its state: the one way in for ``patch()`` and
    ``GradFixCallback``, so that only this module reaches into :mod:`.trainer_fix`.

    >>> callable(fix_trainer)
    True
    """
    from .trainer_fix import install

    return install(trainer, config, source, settings_from=settings_from)


def patch_sources() -> list[SettingsSource | None]:
    """The sources in force for a trainer built now: ``$HF_GRADFIX_CONFIG`` and, while patched, ``patch()``'s own
    (a GradFixCallback adds its own after them)."""
    return [env_source(), _source if _active else None]


def swap_to_fixed_class(trainer: Any) -> None:
    """Give an already installed trainer the loss-fixing class (used when a callback's configuration turns the
    loss fix on over ``patch()``'s)."""
    from .trainer.reentry import snapshot_methods
    from .trainer_fix import _TOP_OVERRIDES, _keep_instance_ga_flag, fixed_class_for

    _keep_instance_ga_flag(trainer)
    snapshot_methods(trainer, _TOP_OVERRIDES)
    trainer.__class__ = fixed_class_for(type(trainer))


# ----------------------------------------------------------------------------------------------------------------
# transformers' ReplicatedWithGradAllReduce (tensor parallelism), corrected for gradient accumulation
# ----------------------------------------------------------------------------------------------------------------

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
