"""Where a trainer's settings come from, and the one rule that combines them.

Settings can reach a trainer from four places, from the most general to the most specific:

1. the defaults of :class:`~hf_gradfix.config.GradFixConfig`;
2. the YAML file named by ``$HF_GRADFIX_CONFIG`` (``hf-gradfix launch`` sets it on every rank from the launch file's
   ``hf_gradfix:`` section, and says so in ``$HF_GRADFIX_CONFIG_ORIGIN``);
3. ``hf_gradfix.patch(config)``;
4. ``GradFixCallback(config)`` on one trainer.

**The rule:** each source sets exactly the keys it names; a key it leaves out keeps the value of the sources above it
(in the end, the default). A key named by two sources with *different* values is a conflict, refused in one line
naming the key, both values and both sources (the same value twice is fine). So ``patch({"packing": ...})`` in a
script launched with a pipeline-parallel file keeps the file's mesh (and meets the refusal of packing under pp),
instead of silently running without it.

>>> from hf_gradfix.config.sources import combine, source_of
>>> cfg, where = combine([source_of({"loss": {"count_rule": "shifted"}}, "patch(dict)"),
...                       source_of({"log_fixes": False}, "GradFixCallback(dict)")])
>>> cfg.loss.count_rule, cfg.log_fixes, where
('shifted', False, 'patch(dict) + GradFixCallback(dict)')
>>> combine([source_of({"parallel": {"pp": 2}}, "A"), source_of({"parallel": {"pp": 1}}, "B")])
Traceback (most recent call last):
  ...
hf_gradfix.config.schema.ConfigError: hf_gradfix.parallel.pp: set to 2 by A and to 1 by B; a setting comes from one place: remove it from one of them (the rule: each source sets the keys it names, the others keep theirs)

This module imports only the standard library and the loader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .loader import ENV_VAR, _select_section, config_from_dict, config_to_dict, read_config_file
from .schema import ConfigError, GradFixConfig

__all__ = ["ORIGIN_ENV_VAR", "SettingsSource", "combine", "env_source", "source_of"]

ORIGIN_ENV_VAR = "HF_GRADFIX_CONFIG_ORIGIN"
"""Set by ``hf-gradfix launch`` next to ``$HF_GRADFIX_CONFIG``: the launch file the section came from (for the
start line and conflict messages)."""


@dataclass(frozen=True)
class SettingsSource:
    """One source of settings: a label for messages and the keys it sets (dotted key -> value)."""

    label: str
    settings: dict[str, Any] = field(default_factory=dict)


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested plain dict (a list is one value)."""
    out: dict[str, Any] = {}
    if isinstance(d, Mapping):
        for key, value in d.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, Mapping) and value:
                out.update(_leaves(value, name))
            else:
                out[name] = value
    return out


_DEFAULT_LEAVES = _leaves(config_to_dict(GradFixConfig()))


def _named(section: Any) -> dict[str, Any]:
    """The keys a raw section sets: its validated values where they differ from the defaults (``packing: true`` sets
    ``packing.enabled``), and every key it spells out, even at its default value."""
    validated = _leaves(config_to_dict(config_from_dict(section)))
    spelled = set(_leaves(section)) if isinstance(section, Mapping) else set()
    return {k: v for k, v in validated.items() if k in spelled or v != _DEFAULT_LEAVES.get(k)}


def source_of(config: GradFixConfig | Mapping | str | os.PathLike | None, label: str) -> SettingsSource:
    """The keys ``config`` sets (validated; a :class:`ConfigError` for a bad value), as a source named ``label``."""
    if config is None:
        return SettingsSource(label)
    if isinstance(config, GradFixConfig):
        settings = {k: v for k, v in _leaves(config_to_dict(config)).items() if v != _DEFAULT_LEAVES.get(k)}
        return SettingsSource(label, settings)
    if isinstance(config, Mapping):
        section, _ = _select_section(config)
        return SettingsSource(label, _named(section))
    if isinstance(config, (str, os.PathLike)):
        return SettingsSource(label, _named(read_config_file(config, require_section=True).section or {}))
    config_from_dict(config)  # raises the loader's own message for an unsupported type
    return SettingsSource(label)  # pragma: no cover


def env_source() -> SettingsSource | None:
    """The file named by ``$HF_GRADFIX_CONFIG`` as a source, or None when the variable is unset."""
    path = os.environ.get(ENV_VAR, "").strip()
    if not path:
        return None
    origin = os.environ.get(ORIGIN_ENV_VAR, "").strip()
    label = f"hf-gradfix launch --config_file {origin}" if origin else f"${ENV_VAR} ({path})"
    section = read_config_file(path, via_env=True, require_section=True).section or {}
    return SettingsSource(label, _named(section))


def label_for(config: Any, owner: str) -> str:
    """``patch(dict)``, ``patch('run.yaml')``, ``GradFixCallback(GradFixConfig)``, ... for messages."""
    if isinstance(config, (str, os.PathLike)):
        return f"{owner}({os.fspath(config)!r})"
    kind = "dict" if isinstance(config, Mapping) else type(config).__name__
    return f"{owner}({kind})"


def combine(sources: list[SettingsSource | None]) -> tuple[GradFixConfig, str]:
    """The configuration the sources give together, and where it came from ("defaults" when none sets a key).

    Raises :class:`ConfigError` on a key two sources set to different values (see the module's rule)."""
    merged: dict[str, tuple[Any, str]] = {}
    used: list[str] = []
    for source in sources:
        if source is None:
            continue
        for key, value in source.settings.items():
            if key in merged and merged[key][0] != value:
                first, where = merged[key]
                raise ConfigError(
                    f"hf_gradfix.{key}: set to {first!r} by {where} and to {value!r} by {source.label}; a setting "
                    "comes from one place: remove it from one of them (the rule: each source sets the keys it names, "
                    "the others keep theirs)"
                )
            merged[key] = (value, source.label)
        if source.settings and source.label not in used:
            used.append(source.label)
    nested: dict[str, Any] = config_to_dict(GradFixConfig())
    for key, (value, _) in merged.items():
        *parents, last = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config_from_dict(nested), " + ".join(used) if used else "defaults"
