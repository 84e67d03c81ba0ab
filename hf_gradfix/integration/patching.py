"""``patch()`` / ``unpatch()``: the one place where hf_gradfix changes third-party code.

Exactly one function is replaced: ``transformers.Trainer.__init__``, wrapped so that every trainer
built afterwards (any subclass, e.g. TRL's ``SFTTrainer``) is fixed by :func:`trainer_fix.install`.
The replacement is version-checked (:mod:`.versions`), idempotent (a second ``patch()`` only updates
the configuration) and reversible (``unpatch()`` puts the original function object back).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

from ..config import GradFixConfig, load_config
from .versions import check_supported

_LOCK = threading.Lock()


@dataclass
class _ActivePatch:
    owner: type
    attr: str
    original: Any
    replacement: Any


_active: list[_ActivePatch] = []
_config: GradFixConfig | None = None


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
    global _config
    check_supported()
    resolved = load_config(config)
    with _LOCK:
        _config = resolved
        if _active:
            return resolved  # idempotent: already installed, configuration updated
        from transformers import Trainer

        from .trainer_fix import install

        original_init = Trainer.__init__

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            # Only the outermost __init__ call installs (a subclass's __init__ may run more code after
            # super().__init__; install only swaps the class and attaches state, so order does not matter).
            install(self, _config, source="patch()")

        __init__._hf_gradfix_patched = True
        Trainer.__init__ = __init__
        _active.append(_ActivePatch(Trainer, "__init__", original_init, __init__))
    return resolved


def unpatch() -> None:
    """Restore every function :func:`patch` replaced (the original objects). Safe to call twice.

    Trainers built while patched stay fixed; use ``hf_gradfix.integration.trainer_fix.uninstall`` on one.

    >>> import hf_gradfix
    >>> hf_gradfix.unpatch()
    """
    global _config
    with _LOCK:
        while _active:
            item = _active.pop()
            current = item.owner.__dict__.get(item.attr)
            if current is not item.replacement:
                raise RuntimeError(
                    f"{item.owner.__name__}.{item.attr} was replaced by someone else after hf_gradfix.patch(); "
                    "refusing to overwrite it. Unpatch that library first."
                )
            setattr(item.owner, item.attr, item.original)
        _config = None
