"""``patch()`` / ``unpatch()``: the one place where hf_gradfix changes third-party code.

Exactly one function is replaced: ``transformers.Trainer.__init__``, wrapped so that every trainer
built afterwards (any subclass, e.g. TRL's ``SFTTrainer``) is fixed by :func:`trainer.class_swap.install`.
The replacement is version-checked (:mod:`.versions`), idempotent (a second ``patch()`` only updates
the configuration) and reversible (``unpatch()`` puts the original function object back). Around the original
``__init__`` it lets a model expert-parallel at load time pass transformers' ``save_only_model`` check (hf_gradfix
writes that model's resumable checkpoints, :mod:`.checkpoints.sharded`): the arguments are changed for ``__init__`` only.  When
``unpatch()`` cannot restore (another library wrapped ``Trainer.__init__`` after us), it raises
:class:`~hf_gradfix.errors.PatchError` and the bookkeeping stays true: ``is_patched()`` is still True
(our wrapper is still called) and a second ``patch()`` does not wrap again.

The one change hf_gradfix makes to a model instance rather than a function (transformers' tensor-parallel
``replicated_with_grad_allreduce`` forward) lives with the parallel glue:
:mod:`hf_gradfix.integration.parallel.tensor_parallel`.

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
            from .checkpoints.sharded import init_allows_ep_checkpoints

            try:
                bound = _init_signature(original_init).bind_partial(self, *args, **kwargs).arguments
            except TypeError:  # transformers raises its own error for these arguments
                bound = {}
            # an expert-parallel model sharded at load time: hf_gradfix writes its resumable checkpoints (checkpoints/sharded.py)
            with init_allows_ep_checkpoints(bound.get("model"), bound.get("args")):
                original_init(self, *args, **kwargs)
            # Only the outermost __init__ call installs (a subclass's __init__ may run more code after
            # super().__init__; install only swaps the class and attaches state, so order does not matter). A
            # GradFixCallback given to the constructor installed first, with patch()'s settings combined into its own.
            state = fix_trainer(self, _config, source="patch()", settings_from=_settings_from)
            from .diagnostics.nonfinite import attach

            attach(self, state.config)
            from .parallel.deepspeed import attach as attach_deepspeed

            attach_deepspeed(self, state.config)
            from .rl.packing import attach as attach_rl_packing

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

    Trainers built while patched stay fixed; use ``hf_gradfix.uninstall`` on one.

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
    from .diagnostics.explained_warnings import forget_all

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
    ``GradFixCallback``, so that only this module reaches into the class layers (:mod:`.trainer`).

    >>> callable(fix_trainer)
    True
    """
    from .trainer.class_swap import install

    return install(trainer, config, source, settings_from=settings_from)


def patch_sources() -> list[SettingsSource | None]:
    """The sources in force for a trainer built now: ``$HF_GRADFIX_CONFIG`` and, while patched, ``patch()``'s own
    (a GradFixCallback adds its own after them)."""
    return [env_source(), _source if _active else None]


def swap_to_fixed_class(trainer: Any) -> None:
    """Give an already installed trainer the loss-fixing class (used when a callback's configuration turns the
    loss fix on over ``patch()``'s)."""
    from .trainer.reentry import snapshot_methods
    from .trainer.class_swap import fixed_class_for
    from .trainer.ga_flag import _keep_instance_ga_flag
    from .trainer.top import _TOP_OVERRIDES

    _keep_instance_ga_flag(trainer)
    snapshot_methods(trainer, _TOP_OVERRIDES)
    trainer.__class__ = fixed_class_for(type(trainer))
