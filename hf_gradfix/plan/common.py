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


def build_model_for_config(config, **kwargs):
    """``AutoModelForCausalLM.from_config``, or for a vision-language config that it does not map (Qwen2.5-VL,
    LLaVA, ...: a config with a ``vision_config``) ``AutoModelForImageTextToText.from_config`` (tower, projector,
    decoder and head; a text-only forward of it runs the decoder alone)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError:
        if getattr(config, "vision_config", None) is None:
            raise
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, **kwargs)


def _fmt(b: float) -> str:
    for unit, div in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"
