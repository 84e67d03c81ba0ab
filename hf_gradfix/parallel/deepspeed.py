"""DeepSpeed ZeRO as accelerate's YAML describes it: stage, clipping, offload, and the traps of that route.

Pure logic (no DeepSpeed import): read by ``hf-gradfix config check`` / ``launch`` (through
:mod:`hf_gradfix.config.resolve`), by ``hf-gradfix plan --zero`` and by the Trainer glue
(:mod:`hf_gradfix.integration.parallel.deepspeed`).

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
import math
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
    """True when accelerate's YAML keys select DeepSpeed: ``distributed_type: DEEPSPEED``, accelerate's own rule
    (``accelerate launch`` sets ``use_deepspeed`` from ``distributed_type`` alone and ignores a ``deepspeed_config``
    next to ``distributed_type: FSDP``)."""
    return str(acc.get("distributed_type", "")).upper() == "DEEPSPEED"


def _device(section: Any) -> str:
    if isinstance(section, dict):
        return str(section.get("device", "none")).lower()
    return "none"


#: a DeepSpeed JSON larger than this is refused before reading (a config is a few KiB; /dev/zero never ends)
MAX_JSON_BYTES = 4 * 1024 * 1024


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate key(s) {dup} (JSON keeps the last one silently)")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _read_json(path: str, where: str) -> dict:
    key = "deepspeed_config.deepspeed_config_file"
    try:
        from ..files import not_a_regular_file

        kind = not_a_regular_file(path)
        if kind is not None:  # a FIFO or a device would block or never end
            raise OSError(f"not a regular file: it {kind}")
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise OSError(f"{os.path.getsize(path)} bytes, more than {MAX_JSON_BYTES} for a config")
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (OSError, ValueError) as err:
        raise DeepSpeedConfigError(
            f"{where}: {key} {path!r} cannot be read ({type(err).__name__}: {err}); give the path of a DeepSpeed "
            "JSON config (relative paths are taken from the YAML's folder)"
        ) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"{where}: deepspeed_config_file {path!r} must hold a JSON object")
    return data


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _check_clipping_value(value: Any, key: str, where: str) -> float | str:
    """``"auto"`` or a finite number >= 0 (not a string, not a bool)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DeepSpeedConfigError(f"{where}: {key}: invalid value {value!r}; it must be a finite number >= 0 or "
                                   "\"auto\" (follows TrainingArguments.max_grad_norm)")
    return float(value)


def _deepspeed_zero_schema():
    """DeepSpeed's ``DeepSpeedZeroConfig``, imported without its import-time banner reaching stdout (``config check
    --json`` prints JSON there); DeepSpeed's logger is pointed back at the real stdout afterwards."""
    import contextlib
    import io
    import logging
    import sys

    if "deepspeed.runtime.zero.config" in sys.modules:
        return sys.modules["deepspeed.runtime.zero.config"].DeepSpeedZeroConfig
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception:  # noqa: BLE001
        return None
    finally:
        for handler in logging.getLogger("DeepSpeed").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sink:
                handler.setStream(sys.stdout)
    return DeepSpeedZeroConfig


def _check_zero(zero: dict, where: str, keys: dict) -> None:
    """The ``zero_optimization`` section by DeepSpeed's own schema (``DeepSpeedZeroConfig``, when DeepSpeed is
    installed) and what that schema lets through but DeepSpeed then ignores or coerces: a stage that is not an int
    (``"2"``, ``true``), nvme offload without its path, parameter offload below ZeRO-3. ``keys``: how the user spelled
    each setting (the YAML's ``zero_stage`` or the JSON's ``zero_optimization.stage``), for the message."""
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(f"{where}: {keys['stage']}: invalid value {stage!r}; it must be one of the ZeRO "
                                   "stages 0, 1, 2, 3 (an integer)")
    for part in ("offload_optimizer", "offload_param"):
        section = zero.get(part)
        if not isinstance(section, dict):
            continue
        device = section.get("device", "none")
        if device not in _OFFLOAD_DEVICES:
            raise DeepSpeedConfigError(f"{where}: {keys[part]}: invalid value {device!r}; it must be one of "
                                       f"{', '.join(_OFFLOAD_DEVICES)} (DeepSpeed offloads to the CPU or NVMe only)")
        if device == "nvme" and not section.get("nvme_path"):
            raise DeepSpeedConfigError(f"{where}: {keys[part]}: nvme without {keys[part + '_path']}; set the NVMe "
                                       "folder DeepSpeed swaps to, or offload to cpu")
        if part == "offload_param" and device != "none" and stage != 3:
            raise DeepSpeedConfigError(f"{where}: {keys[part]}: {device!r} with ZeRO-{stage}: DeepSpeed offloads "
                                       f"parameters under ZeRO-3 only and ignores it here; set {keys['stage']}: 3 or "
                                       f"remove {keys[part]}")
    DeepSpeedZeroConfig = _deepspeed_zero_schema()
    if DeepSpeedZeroConfig is None:  # DeepSpeed not installed (or not importable here): the checks above stand
        return
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError: its first error, in one line
        errors = getattr(err, "errors", None)
        first = errors()[0] if callable(errors) else {"loc": (), "msg": str(err).splitlines()[0], "input": None}
        loc = ".".join(str(x) for x in first.get("loc", ())) or "zero_optimization"
        raise DeepSpeedConfigError(f"{where}: zero_optimization.{loc}: invalid value {first.get('input')!r}: "
                                   f"{first.get('msg')} (DeepSpeed's DeepSpeedZeroConfig)") from None


#: how each ZeRO setting is spelled in accelerate's YAML and in a DeepSpeed JSON (for the one-line messages)
_YAML_KEYS = {"stage": "deepspeed_config.zero_stage", "offload_optimizer": "deepspeed_config.offload_optimizer_device",
              "offload_param": "deepspeed_config.offload_param_device",
              "offload_optimizer_path": "deepspeed_config.offload_optimizer_nvme_path",
              "offload_param_path": "deepspeed_config.offload_param_nvme_path"}
_JSON_KEYS = {"stage": "zero_optimization.stage", "offload_optimizer": "zero_optimization.offload_optimizer.device",
              "offload_param": "zero_optimization.offload_param.device",
              "offload_optimizer_path": "zero_optimization.offload_optimizer.nvme_path",
              "offload_param_path": "zero_optimization.offload_param.nvme_path"}
#: YAML keys accelerate ignores when a deepspeed_config_file is given (it reads them from the file)
_YAML_ZERO_KEYS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                   "offload_param_nvme_path", "gradient_clipping", "zero3_save_16bit_model")


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
        both = sorted(k for k in ds if k in _YAML_ZERO_KEYS)
        if both:  # accelerate takes the file and ignores these
            raise DeepSpeedConfigError(
                f"{where}: deepspeed_config.deepspeed_config_file with deepspeed_config.{both[0]}: accelerate uses the "
                f"JSON file and ignores {', '.join(both)}; set them in the JSON file only")
        data = _read_json(path, where)
        zero = data.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise DeepSpeedConfigError(f"{where}: zero_optimization in {config_file!r} must be a JSON object")
        _check_zero(zero, where, _JSON_KEYS)
        stage = zero.get("stage", 0)
        clipping = _check_clipping_value(data.get("gradient_clipping", DEEPSPEED_DEFAULT_CLIPPING),
                                         "gradient_clipping (DeepSpeed JSON)", where)
        return DeepSpeedSettings(
            stage=stage,
            clipping=clipping,
            offload_optimizer=_device(zero.get("offload_optimizer")),
            offload_param=_device(zero.get("offload_param")),
            config_file=str(config_file),
        )
    clipping = ds.get("gradient_clipping", "auto")
    if clipping is not None:
        clipping = _check_clipping_value(clipping, "deepspeed_config.gradient_clipping", where)
    if clipping != "auto" and clipping is not None and not float(clipping):
        raise DeepSpeedConfigError(
            f"{where}: deepspeed_config.gradient_clipping: {clipping}: accelerate drops a 0 and DeepSpeed then clips at "
            f"its default {DEEPSPEED_DEFAULT_CLIPPING:g} (silent clipping). Fix: remove gradient_clipping from the YAML "
            "(DeepSpeed then follows TrainingArguments.max_grad_norm; set max_grad_norm=0 for no clipping)"
        )
    zero = {"stage": ds.get("zero_stage", 2) if ds.get("zero_stage") is not None else 2}
    for part in ("optimizer", "param"):
        device = ds.get(f"offload_{part}_device")
        if device is not None:
            zero[f"offload_{part}"] = {"device": str(device).lower() if isinstance(device, str) else device,
                                       "nvme_path": ds.get(f"offload_{part}_nvme_path")}
    _check_zero(zero, where, _YAML_KEYS)
    return DeepSpeedSettings(
        stage=zero["stage"],
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
