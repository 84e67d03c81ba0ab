"""Methods replaced on one object's instance (its class untouched) and put back in one call.

The callbacks that read the Trainer as it runs (the gradient noise scale, the packing balance log, the router health
log) wrap a few of its methods for the length of a ``train()``. Three rules, kept here once:

- a wrapper is *live* while it is the installed one: after :meth:`InstanceMethods.remove_all` a wrapper that someone
  else's later wrapper still calls passes calls through, so nothing is counted or logged twice;
- removal puts back what the instance had before (another wrapper, or nothing: the class's method), and leaves the
  method alone where someone wrapped it after us (unlinking their wrapper would drop it from the chain);
- wrapping again while our wrapper is still installed (a ``train()`` that ended by an exception, so without
  ``on_train_end``) keeps it: no wrapper of a wrapper of our own.

>>> class Greeter:
...     def hello(self):
...         return "hello"
>>> g, methods = Greeter(), InstanceMethods()
>>> wrapper = methods.wrap(g, "hello", lambda original: lambda: original() + "!")
>>> g.hello(), methods.live(wrapper)
('hello!', True)
>>> methods.remove_all()
>>> g.hello(), "hello" in g.__dict__, methods.live(wrapper)
('hello', False, False)
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["InstanceMethods"]

_MISSING = object()


class InstanceMethods:
    """The instance-level wrappers one owner (a callback) installed; see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[Any, Any, Any]] = {}  # (id(obj), name) -> (obj, wrapper, saved)

    def wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Install ``make(obj.<name>)`` as ``obj.<name>`` (on the instance) and return it; our wrapper if it is still
        the installed one."""
        entry = self._entries.get((id(obj), name))
        if entry is not None and obj.__dict__.get(name) is entry[1]:
            return entry[1]
        saved = obj.__dict__.get(name, _MISSING)
        wrapper = make(getattr(obj, name))
        self._entries[(id(obj), name)] = (obj, wrapper, saved)
        setattr(obj, name, wrapper)
        return wrapper

    def live(self, wrapper: Any) -> bool:
        """Whether ``wrapper`` is one of ours and not yet removed."""
        return any(w is wrapper for _, w, _ in self._entries.values())

    def all_installed(self) -> bool:
        """Whether there are wrappers and every one is still the installed method."""
        return bool(self._entries) and all(obj.__dict__.get(name) is w for (_, name), (obj, w, _) in self._entries.items())

    def remove_all(self) -> None:
        """Put back what each instance had before; a method someone wrapped after us stays as it is."""
        for (_, name), (obj, wrapper, saved) in list(self._entries.items()):
            if obj.__dict__.get(name) is wrapper:
                if saved is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, saved)
        self._entries.clear()
