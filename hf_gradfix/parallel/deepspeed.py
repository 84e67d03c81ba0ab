"""DeepSpeed ZeRO as accelerate's YAML describes it: stage, clipping, offload, and the traps of that route.

Pure logic (no DeepSpeed import): read by ``hf-gradfix config check`` / ``launch`` (through
:mod:`hf_gradfix.config.resolve`), by ``hf-gradfix plan --zero`` and by the Trainer glue
(:mod:`hf_gradfix.integration.deepspeed`).

Measured traps (deepspeed 0.19.8, accelerate 1.15, transformers 5.24):

- accelerate writes the YAML's ``gradient_clipping`` into DeepSpeed's config only when it is truthy: a ``0`` is
  dropped and DeepSpeed clips at its own default 1.0 (the user asked for no clipping and gets clipping at 1.0).
  Without the key, accelerate passes ``"auto"`` and transformers fills in ``TrainingArguments.max_grad_norm``.
- ``ACCELERATE_USE_CPU=true`` in the ranks' environment turns DeepSpeed off inside accelerate (``AcceleratorState``
  picks DEEPSPEED only when not on CPU): ZeRO-2 then runs as plain data parallel, ZeRO-3 crashes.

>>> s = deepspeed_settings({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3,
...     "offload_optimizer_device": "cpu"}})
>>> s.stage, s.clipping, s.offload_optimizer, s.describe()
(3, 'auto', 'cpu', 'ZeRO-3: parameters, gradients and optimizer state partitioned; clipping follows TrainingArguments.max_grad_norm; optimizer state offloaded to cpu')
>>> deepspeed_settings({"distributed_type": "MULTI_GPU"}) is None
True
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..errors import HfGradfixError

__all__ = [
    "DEEPSPEED_DEFAULT_CLIPPING",
    "DeepSpeedConfigError",
    "DeepSpeedSettings",
    "check_clipping",
    "deepspeed_settings",
    "is_deepspeed",
    "zero_stage_of",
]

#: DeepSpeed's own ``gradient_clipping`` when its config has none (``deepspeed.runtime.constants``).
DEEPSPEED_DEFAULT_CLIPPING = 1.0

_WHAT_IS_PARTITIONED = {
    0: "nothing partitioned (plain data parallel)",
    1: "optimizer state partitioned",
    2: "gradients and optimizer state partitioned",
    3: "parameters, gradients and optimizer state partitioned",
}


class DeepSpeedConfigError(HfGradfixError, ValueError):
    """A DeepSpeed setting that would silently run something else than asked (one line with the fix)."""


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What DeepSpeed will run, as far as the YAML (and its ``deepspeed_config_file``) says.

    ``clipping`` is a float, or ``"auto"`` (transformers fills in ``TrainingArguments.max_grad_norm``).
    ``offload_*`` is ``"none"``, ``"cpu"`` or ``"nvme"``.
    """

    stage: int
    clipping: float | str
    offload_optimizer: str = "none"
    offload_param: str = "none"
    config_file: str | None = None
    zero3_init: bool | None = None

    def describe(self) -> str:
        clip = ("follows TrainingArguments.max_grad_norm" if self.clipping == "auto"
                else "off" if not self.clipping else f"at global norm {self.clipping:g}")
        parts = [f"ZeRO-{self.stage}: {_WHAT_IS_PARTITIONED.get(self.stage, '?')}", f"clipping {clip}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer state offloaded to {self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"parameters offloaded to {self.offload_param}")
        return "; ".join(parts)


def is_deepspeed(acc: dict) -> bool:
    """True when accelerate's YAML keys select DeepSpeed."""
    return str(acc.get("distributed_type", "")).upper() == "DEEPSPEED" or bool(acc.get("deepspeed_config"))


def _device(section: Any) -> str:
    if isinstance(section, dict):
        return str(section.get("device", "none")).lower()
    return "none"


def _read_json(path: str, where: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise DeepSpeedConfigError(
            f"{where}: deepspeed_config.deepspeed_config_file {path!r} cannot be read ({type(err).__name__}: {err}); "
            "give the path of a DeepSpeed JSON config (relative paths are taken from the YAML's folder)"
        ) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"{where}: deepspeed_config_file {path!r} must hold a JSON object")
    return data


def deepspeed_settings(acc: dict, yaml_path: str | None = None) -> DeepSpeedSettings | None:
    """DeepSpeed's stage, clipping and offload from accelerate's YAML keys (``None`` when not DeepSpeed).

    Raises :class:`DeepSpeedConfigError` for ``gradient_clipping: 0`` (accelerate drops it; DeepSpeed clips at 1.0).
    """
    if not is_deepspeed(acc):
        return None
    where = yaml_path or "accelerate config"
    ds = acc.get("deepspeed_config") or {}
    config_file = ds.get("deepspeed_config_file")
    if config_file:
        path = str(config_file)
        if yaml_path and not os.path.isabs(path) and not os.path.exists(path):
            path = os.path.join(os.path.dirname(os.path.abspath(yaml_path)), path)
        data = _read_json(path, where)
        zero = data.get("zero_optimization") or {}
        stage = zero.get("stage", 0)
        clipping = data.get("gradient_clipping", DEEPSPEED_DEFAULT_CLIPPING)
        return DeepSpeedSettings(
            stage=int(stage) if str(stage).isdigit() else 0,
            clipping=clipping if clipping == "auto" else float(clipping),
            offload_optimizer=_device(zero.get("offload_optimizer")),
            offload_param=_device(zero.get("offload_param")),
            config_file=str(config_file),
        )
    clipping = ds.get("gradient_clipping", "auto")
    if clipping != "auto" and clipping is not None and not float(clipping):
        raise DeepSpeedConfigError(
            f"{where}: deepspeed_config.gradient_clipping: {clipping}: accelerate drops a 0 and DeepSpeed then clips at "
            f"its default {DEEPSPEED_DEFAULT_CLIPPING:g} (silent clipping). Fix: remove gradient_clipping from the YAML "
            "(DeepSpeed then follows TrainingArguments.max_grad_norm; set max_grad_norm=0 for no clipping)"
        )
    return DeepSpeedSettings(
        stage=int(ds.get("zero_stage", 2) if ds.get("zero_stage") is not None else 2),
        clipping="auto" if clipping in (None, "auto") else float(clipping),
        offload_optimizer=str(ds.get("offload_optimizer_device", "none") or "none").lower(),
        offload_param=str(ds.get("offload_param_device", "none") or "none").lower(),
        zero3_init=ds.get("zero3_init_flag"),
    )


def zero_stage_of(acc: dict, yaml_path: str | None = None) -> int | None:
    """The ZeRO stage a YAML selects, or None when it does not select DeepSpeed."""
    s = deepspeed_settings(acc, yaml_path)
    return None if s is None else s.stage


def check_clipping(engine_clipping: float, max_grad_norm: float | None) -> None:
    """Raise when DeepSpeed's engine clips differently from ``TrainingArguments.max_grad_norm``.

    Under DeepSpeed the Trainer does not clip: the engine does, at its own ``gradient_clipping``.

    >>> check_clipping(1.0, 1.0)
    >>> check_clipping(1.0, 0.0)
    Traceback (most recent call last):
    ...
    hf_gradfix.parallel.deepspeed.DeepSpeedConfigError: DeepSpeed clips gradients at global norm 1 but TrainingArguments.max_grad_norm is 0 (no clipping): the engine, not the Trainer, clips under DeepSpeed. Fix: set "gradient_clipping": "auto" in the DeepSpeed config (or remove gradient_clipping from the accelerate YAML) so DeepSpeed follows max_grad_norm, or set max_grad_norm=1
    """
    wanted = float(max_grad_norm or 0.0)
    got = float(engine_clipping or 0.0)
    if abs(wanted - got) <= 1e-12 * max(1.0, abs(wanted)):
        return
    engine_says = f"clips gradients at global norm {got:g}" if got > 0 else "does not clip gradients"
    trainer_says = f"{wanted:g}" + (" (no clipping)" if wanted <= 0 else "")
    raise DeepSpeedConfigError(
        f"DeepSpeed {engine_says} but TrainingArguments.max_grad_norm is {trainer_says}: the engine, not the Trainer, "
        'clips under DeepSpeed. Fix: set "gradient_clipping": "auto" in the DeepSpeed config (or remove '
        f"gradient_clipping from the accelerate YAML) so DeepSpeed follows max_grad_norm, or set max_grad_norm={got:g}"
    )
