"""What every planner module shares (the bottom of ``hf_gradfix.plan``: it imports no other planner module, so
the planner's imports run one way: ``common`` <- ``activations`` <- ``estimate`` <- ``rl`` / ``simulate`` ...).

>>> _fmt(3 * GiB)
'3.00 GiB'
"""

from __future__ import annotations

import re

from ..errors import HfGradfixError

__all__ = ["GiB", "PlanError"]

GiB = 1024**3


class PlanError(HfGradfixError, ValueError):
    """Input the planner cannot use (unknown model, bad mesh, bad size); the message says what to change."""


def _tp_style(name: str, plan: dict) -> str | None:
    short = name[len("model."):] if name.startswith("model.") else name
    module = short.rsplit(".", 1)[0]
    for pattern, style in plan.items():
        rx = "^" + re.escape(pattern).replace(r"\*", r"\d+") + "$"
        if re.match(rx, module):
            if "colwise" in style:
                return "colwise"
            if "rowwise" in style:
                return "rowwise"
    return None


def _fmt(b: float) -> str:
    for unit, div in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"
