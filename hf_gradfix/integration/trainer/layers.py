"""Where the plugin's class layers sit in a fixed trainer's MRO: what ``super()`` reaches from ``_GradFixTop``, and
which class below it defines a method.

Apart from :mod:`.top` so that the concern modules, which act as ``_GradFixTop``'s methods, reach "``super()`` of
the top layer" without importing the top layer (which imports them): the top layer is found in the MRO by its
mark, ``_gradfix_layer = "top"``.

>>> class Top:
...     _gradfix_layer = "top"
>>> class Base:
...     def f(self):
...         return "base"
>>> class Fixed(Top, Base):
...     pass
>>> below_top(Fixed(), "f")(), first_class_defining(Fixed(), "f").__name__
('base', 'Base')
"""

from __future__ import annotations

from typing import Any

TOP_MARK = "top"


def top_layer(trainer: Any) -> type:
    """The ``_GradFixTop`` class in ``trainer``'s MRO."""
    for klass in type(trainer).__mro__:
        if klass.__dict__.get("_gradfix_layer") == TOP_MARK:
            return klass
    raise TypeError(f"{type(trainer).__name__} is not a class fixed by hf_gradfix (no _GradFixTop in its MRO)")


def below_top(trainer: Any, name: str, *default: Any) -> Any:
    """``super().<name>`` as ``_GradFixTop``'s methods see it (``default`` as ``getattr``'s)."""
    return getattr(super(top_layer(trainer), trainer), name, *default)


def first_class_defining(trainer: Any, name: str) -> type | None:
    """The first class below ``_GradFixTop`` in ``trainer``'s MRO that defines ``name``."""
    mro = type(trainer).__mro__
    for klass in mro[mro.index(top_layer(trainer)) + 1 :]:
        if name in klass.__dict__:
            return klass
    return None
