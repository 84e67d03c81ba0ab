"""Delegates that call back into the trainer: ``patch.object(MyTrainer, "training_step", wraps=trainer.training_step)``.

The plugin gives a trainer a generated class ``[_GradFixTop, MyTrainer, ..., Trainer]`` (:mod:`.class_swap`).
A common test and instrumentation idiom (TRL's own ``test_prepare_input_called_with_correct_data``) replaces a method
of the user's class by a wrapper of the trainer's *bound* method, taken after construction. Stock, the bound method is
``MyTrainer.training_step`` and the wrapper runs it once. Under the plugin the bound method is ``_GradFixTop``'s,
whose ``super()`` reaches the wrapper, which calls the bound method again: endless recursion.

Rule: a ``_GradFixTop`` method entered again while it is already running on the same trainer was reached through
such a delegate; it does not run its own logic twice, it continues the chain as stock would, with the method each
class had when the plugin took the trainer (for the classes whose method has been replaced since). The delegate
itself has run (and recorded its call) exactly once, as stock.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_ACTIVE_ATTR = "_gradfix_active_methods"
_SNAPSHOT_ATTR = "_gradfix_methods_at_install"


def snapshot_methods(trainer: Any, names: tuple[str, ...]) -> None:
    """Remember, per class of ``trainer``'s MRO, the attributes ``names`` it defines now (before any delegate)."""
    if _SNAPSHOT_ATTR in trainer.__dict__:
        return
    methods = {(klass, name): klass.__dict__[name] for klass in type(trainer).__mro__ for name in names
               if name in klass.__dict__}
    trainer.__dict__[_SNAPSHOT_ATTR] = (frozenset(type(trainer).__mro__), methods)


def _install_time_next(trainer: Any, top: type, name: str) -> Callable:
    """What ``super(top, trainer).<name>`` resolved to when the plugin took the trainer."""
    classes, methods = trainer.__dict__.get(_SNAPSHOT_ATTR, (frozenset(), {}))
    mro = type(trainer).__mro__
    for klass in mro[mro.index(top) + 1 :]:
        if klass not in classes:  # the plugin's own layers (the exact default loss): as they are
            found = klass.__dict__.get(name)
        else:  # the user's classes as they were; one that had no such method then (a delegate set since) is passed
            found = methods.get((klass, name))
        if found is not None:
            return found.__get__(trainer, type(trainer)) if hasattr(found, "__get__") else found
    raise AttributeError(name)


def passes_through_delegates(top: type, names: tuple[str, ...]) -> None:
    """Wrap ``top``'s methods ``names`` so that a re-entry through a delegate continues the stock chain."""
    for name in names:
        method = top.__dict__.get(name)
        if method is None or not callable(method):
            continue

        def make(method=method, name=name):
            @functools.wraps(method)
            def wrapper(self, *args, **kwargs):
                active = self.__dict__.setdefault(_ACTIVE_ATTR, set())
                if name in active:
                    return _install_time_next(self, top, name)(*args, **kwargs)
                active.add(name)
                try:
                    return method(self, *args, **kwargs)
                finally:
                    active.discard(name)

            return wrapper

        setattr(top, name, make())
