"""Load and validate the ``hf_gradfix`` configuration.

What :func:`load_config` reads, in order (the first one present wins: one
source; how ``patch()`` and ``GradFixCallback`` combine several is
:mod:`hf_gradfix.config.sources`):

1. the ``source`` argument of :func:`load_config`: a :class:`GradFixConfig`, a
   ``dict`` or the path of a YAML file;
2. the file named by the environment variable ``HF_GRADFIX_CONFIG``;
3. the defaults of :class:`GradFixConfig` (right for most users).

A YAML file (or dict) is either the ``hf_gradfix`` section itself, or an
accelerate config file with an ``hf_gradfix:`` key next to accelerate's own
keys (``compute_environment``, ``distributed_type``, ``num_processes``, ...),
which are ignored here::

    compute_environment: LOCAL_MACHINE
    distributed_type: MULTI_GPU
    num_processes: 4
    hf_gradfix:
      loss:
        count_rule: shifted
      log_fixes: false

Settings left out keep their defaults; an empty file, or ``hf_gradfix:`` with
nothing under it, gives the defaults.  Validation is strict and generic (it
introspects the dataclasses of :mod:`hf_gradfix.config.schema`): an unknown key
or a value of the wrong type raises :class:`ConfigError` naming the dotted key
(e.g. ``hf_gradfix.loss.count_rule``), the file and line when there is one, the
bad value, what is allowed, and the closest valid spelling.

This module imports the standard library and ``yaml``; accelerate only to check a file's accelerate keys (its
``ClusterConfig`` fields for a key outside :data:`_ACCELERATE_KEYS`, ``accelerate launch``'s argument names for the
keys of ``fsdp_config``, ``deepspeed_config``, ``parallelism_config``, ...).

Hostile files are refused in one line before anything is built: over :data:`MAX_FILE_BYTES`, a control character,
nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_NODES` values once aliases are expanded; a plain
scalar that YAML 1.1 reads as a base-60 or octal number or a yes/no/on/off boolean is refused on the plugin's keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from ..errors import InvalidTypeError
from .schema import ConfigError, GradFixConfig, cp_balance_without_cp

__all__ = ["ENV_VAR", "SECTION", "ConfigFile", "load_config", "read_config_file", "config_from_dict", "config_to_dict"]

ENV_VAR = "HF_GRADFIX_CONFIG"
"""Environment variable naming a YAML config file, used when ``load_config()`` gets no source."""

SECTION = "hf_gradfix"
"""Name of the plugin's section (top-level key) in an accelerate config file."""

# Top-level keys of accelerate's own config files: only used to give a better hint
# when someone points us at an accelerate config that has no ``hf_gradfix:`` key.
_ACCELERATE_KEYS = frozenset(
    {
        "compute_environment", "distributed_type", "num_processes", "num_machines",
        "machine_rank", "mixed_precision", "use_cpu", "gpu_ids", "main_training_function",
        "downcast_bf16", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster",
        "tpu_use_sudo", "debug", "enable_cpu_affinity", "fsdp_config", "deepspeed_config",
        "megatron_lm_config", "dynamo_config", "main_process_ip", "main_process_port",
        "ipex_config", "mpirun_config", "parallelism_config", "fp8_config", "dynamo_backend",
    }
)

_INVALID = object()  # sentinel: the value did not validate (a problem was recorded)

Path = tuple  # a key path inside the section: tuple of str (keys) and int (list indices)


# --------------------------------------------------------------------------- public API


def load_config(source: GradFixConfig | Mapping[str, Any] | str | os.PathLike | None = None) -> GradFixConfig:
    """Return a validated :class:`GradFixConfig` from ``source``.

    ``source`` may be:

    * ``None``: the YAML file named by ``$HF_GRADFIX_CONFIG`` if that variable is
      set (non-empty), else the defaults;
    * a :class:`GradFixConfig`: validated, and a copy returned;
    * a ``dict``: the ``hf_gradfix`` section itself, or a dict with an
      ``hf_gradfix`` key (its other keys are ignored);
    * a ``str`` / ``os.PathLike``: path of a YAML file, either the section itself
      or an accelerate config file with an ``hf_gradfix:`` key.

    Raises :class:`ConfigError` (a ``ValueError``) on any problem.

    Example::

        >>> from hf_gradfix.config import load_config
        >>> load_config({"loss": {"count_rule": "shifted"}}).loss.count_rule
        'shifted'
        >>> load_config().loss.enabled   # defaults (when $HF_GRADFIX_CONFIG is unset)
        True
    """
    if source is None:
        env_value = os.environ.get(ENV_VAR, "")
        if not env_value.strip():
            return GradFixConfig()
        return _load_file(env_value.strip(), via_env=True)
    if isinstance(source, GradFixConfig):
        return _build_root(type(source), _to_plain(source))
    if isinstance(source, Mapping):
        return config_from_dict(source)
    if isinstance(source, (str, os.PathLike)):
        return _load_file(source)
    raise ConfigError(
        f"load_config(): unsupported source of type {type(source).__name__} ({_short_repr(source)}); "
        "expected None (use $HF_GRADFIX_CONFIG or the defaults), a GradFixConfig, a dict, "
        "or the path (str or os.PathLike) of a YAML file"
    )


def config_from_dict(d: Mapping[str, Any] | None) -> GradFixConfig:
    """Build a validated :class:`GradFixConfig` from a plain (nested) dict.

    ``d`` is the ``hf_gradfix`` section itself; if it has a top-level
    ``hf_gradfix`` key, that section is used and the other keys (accelerate's)
    are ignored.  Missing settings keep their defaults; ``None`` gives the
    defaults.  Raises :class:`ConfigError` on unknown keys or bad values.

    Example::

        >>> from hf_gradfix.config import config_from_dict
        >>> cfg = config_from_dict({"loss": {"on_undetermined": "warn"}, "log_fixes": False})
        >>> cfg.loss.on_undetermined, cfg.log_fixes
        ('warn', False)
    """
    section, _ = _select_section(d)
    return _build_root(GradFixConfig, section)


def config_to_dict(cfg: GradFixConfig) -> dict[str, Any]:
    """Return ``cfg`` as a plain nested dict (YAML/JSON friendly).

    The result round-trips: ``config_from_dict(config_to_dict(cfg)) == cfg``.
    Raises ``TypeError`` if ``cfg`` is not a dataclass instance.

    Example::

        >>> from hf_gradfix.config import GradFixConfig, config_from_dict, config_to_dict
        >>> d = config_to_dict(GradFixConfig())
        >>> d["loss"]["count_rule"], d["log_fixes"]
        ('auto', True)
        >>> config_from_dict(d) == GradFixConfig()
        True
    """
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise InvalidTypeError(f"config_to_dict() expects a GradFixConfig instance, got {type(cfg).__name__}")
    return _to_plain(cfg)


# --------------------------------------------------------------------------- dict helpers


def _select_section(d: Any) -> tuple[Any, Path]:
    """Return (section, path of the section inside ``d``): unwraps an ``hf_gradfix`` key."""
    if isinstance(d, Mapping) and SECTION in d:
        return d[SECTION], (SECTION,)
    return d, ()


def _to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, recursively; other values are copied as they are."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return copy.deepcopy(obj)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dotted(path: Path) -> str:
    out = SECTION
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _quoted_list(values: typing.Iterable[Any]) -> str:
    return ", ".join(repr(v) for v in values)


# --------------------------------------------------------------------------- validation


class _Validator:
    """Converts plain data into schema dataclasses, collecting every problem found."""

    def __init__(self) -> None:
        self.problems: list[tuple[Path, str]] = []

    def add(self, path: Path, message: str) -> None:
        self.problems.append((path, f"{_dotted(path)}: {message}"))

    # -- dispatch on the type hint
    def convert(self, tp: Any, value: Any, path: Path) -> Any:
        if tp is Any or tp is object:
            return copy.deepcopy(value)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.section(tp, value, path)
        origin = typing.get_origin(tp)
        if origin is Literal:
            return self.literal(typing.get_args(tp), value, path)
        if origin is Union or (hasattr(types, "UnionType") and origin is getattr(types, "UnionType")):
            return self.union(typing.get_args(tp), value, path)
        if origin in (list, tuple):
            return self.sequence(tp, origin, value, path)
        if origin is dict:
            return self.mapping(tp, value, path)
        if tp is bool:
            return self.boolean(value, path)
        if tp is int:
            return self.integer(value, path)
        if tp is float:
            return self.number(value, path)
        if tp is str:
            return self.string(value, path)
        if tp is type(None):
            if value is None:
                return None
            self.add(path, f"invalid value {_short_repr(value)}; expected null")
            return _INVALID
        raise TypeError(f"hf_gradfix config schema: unsupported type {tp!r} for {_dotted(path)}")

    # -- sections
    def section(self, cls: type, value: Any, path: Path) -> Any:
        if value is None:  # "loss:" with nothing under it -> defaults
            return cls()
        if isinstance(value, cls):
            value = _to_plain(value)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        names = [f.name for f in fields]
        if path and isinstance(value, bool) and "enabled" in names:
            value = {"enabled": value}  # shorthand: `packing: true` == `packing: {enabled: true}`
        if not isinstance(value, Mapping):
            if not path:
                hint = f"write the settings as keys of the {SECTION} section, e.g. '{names[0]}: ...'"
            else:
                hint = f"write its settings as keys indented under '{path[-1]}:', e.g. '{names[0]}: ...'"
                if isinstance(value, bool) and "enabled" in names:
                    hint = f"to turn it on or off write '{path[-1]}: {{enabled: {str(value).lower()}}}'"
            self.add(
                path,
                f"expected a mapping (a section with keys {_quoted_list(names)}), got "
                f"{type(value).__name__} {_short_repr(value)}; {hint}",
            )
            return _INVALID
        hints = _type_hints(cls)
        before = len(self.problems)
        kwargs: dict[str, Any] = {}
        unknown_accelerate: list[str] = []
        for key, sub in value.items():
            if not isinstance(key, str):
                self.add(path, f"key {_short_repr(key)} is not a string; allowed keys: {_quoted_list(names)}")
                continue
            if key not in names:
                if not path and key in _ACCELERATE_KEYS:
                    unknown_accelerate.append(key)
                    continue
                self.add(path + (key,), _unknown_key_message(key, names, path))
                continue
            converted = self.convert(hints[key], sub, path + (key,))
            if converted is not _INVALID:
                converted = self.bounded(fields[names.index(key)], converted, path + (key,))
            if converted is not _INVALID:
                kwargs[key] = converted
        if unknown_accelerate:
            self.add(
                path,
                f"unknown keys {_quoted_list(unknown_accelerate)}: these are accelerate settings; "
                f"in an accelerate config file put the plugin settings under an '{SECTION}:' key "
                f"(allowed keys in the {SECTION} section: {_quoted_list(names)})",
            )
        if len(self.problems) != before:
            return _INVALID
        built = cls(**kwargs)
        for key, message in getattr(built, "conflicts", lambda: [])():  # settings that contradict each other
            self.add(path + (key,), message)
        return _INVALID if len(self.problems) != before else built

    def bounded(self, f: dataclasses.Field, value: Any, path: Path) -> Any:
        """Apply a field's range: ``metadata`` ``min`` / ``max`` (inclusive), ``above`` (exclusive), ``special``."""
        return self.in_range(value, path, f.metadata)

    def in_range(self, value: Any, path: Path, meta: Mapping[str, Any]) -> Any:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if "special" in meta and value == meta["special"]:
            return value
        low, high, above = meta.get("min"), meta.get("max"), meta.get("above")
        if (low is None or value >= low) and (high is None or value <= high) and (above is None or value > above):
            return value
        self.add(path, f"invalid value {_short_repr(value)}; {_range_text(meta)}")
        return _INVALID

    # -- leaves
    def literal(self, allowed: tuple, value: Any, path: Path) -> Any:
        for option in allowed:
            if value == option and type(value) is type(option):
                return option
        message = f"invalid value {_short_repr(value)}; allowed values: {_quoted_list(allowed)}"
        str_options = [o for o in allowed if isinstance(o, str)]
        if isinstance(value, str) and str_options:
            lowered = {o.lower(): o for o in str_options}
            if value.lower() in lowered:
                match = [lowered[value.lower()]]
            else:
                match = difflib.get_close_matches(value, str_options, n=1, cutoff=0.6)
                if not match:
                    match = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
                    match = [lowered[m] for m in match]
            if match:
                message += f" (did you mean {match[0]!r}?)"
        elif isinstance(value, bool) and str_options:
            message += " (YAML reads unquoted yes/no/on/off/true/false as booleans; quote the value)"
        self.add(path, message)
        return _INVALID

    def union(self, arms: tuple, value: Any, path: Path) -> Any:
        if value is None and type(None) in arms:
            return None
        real = [a for a in arms if a is not type(None)]
        if len(real) == 1:
            return self.convert(real[0], value, path)
        for arm in real:  # first arm that accepts the value wins
            trial = _Validator()
            result = trial.convert(arm, value, path)
            if result is not _INVALID:
                return result
        self.add(path, f"invalid value {_short_repr(value)}; expected {_describe(Union[arms])}")
        return _INVALID

    def boolean(self, value: Any, path: Path) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            hint = "write true or false without quotes"
        elif isinstance(value, (int, float)):
            hint = "write true or false, not a number"
        else:
            hint = "write true or false"
        self.add(path, f"invalid value {_short_repr(value)}; expected a bool (true or false); {hint}")
        return _INVALID

    def integer(self, value: Any, path: Path) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        hint = ""
        if isinstance(value, bool):
            hint = "; a bool is not accepted here, write a whole number"
        elif isinstance(value, float) and value.is_integer():
            hint = f"; write {int(value)} (no decimal point)"
        elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            hint = "; remove the quotes"
        self.add(path, f"invalid value {_short_repr(value)}; expected an int{hint}")
        return _INVALID

    def number(self, value: Any, path: Path) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if math.isfinite(number):
                return number
            self.add(path, f"invalid value {_short_repr(value)}; expected a finite number (not inf or nan)")
            return _INVALID
        hint = ""
        if isinstance(value, bool):
            hint = "; a bool is not accepted here, write a number"
        elif isinstance(value, str):
            try:
                float(value)
            except ValueError:
                pass
            else:
                hint = (
                    "; remove the quotes (note: YAML reads exponents without a decimal point, "
                    "like 1e-5, as strings: write 1.0e-5)"
                )
        self.add(path, f"invalid value {_short_repr(value)}; expected a float (a number){hint}")
        return _INVALID

    def string(self, value: Any, path: Path) -> Any:
        if isinstance(value, str):
            return value
        self.add(
            path,
            f"invalid value {_short_repr(value)}; expected a string "
            f"(got {type(value).__name__}; quote the value in YAML)",
        )
        return _INVALID

    # -- containers
    def sequence(self, tp: Any, origin: type, value: Any, path: Path) -> Any:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            self.add(path, f"invalid value {_short_repr(value)}; expected {_describe(tp)}")
            return _INVALID
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                self.add(path, f"invalid value {_short_repr(value)}; expected {_describe(tp)} ({len(args)} items)")
                return _INVALID
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = [self.convert(t, v, path + (i,)) for i, (t, v) in enumerate(zip(item_types, value))]
        if any(item is _INVALID for item in items):
            return _INVALID
        return tuple(items) if origin is tuple else items

    def mapping(self, tp: Any, value: Any, path: Path) -> Any:
        key_type, value_type = (typing.get_args(tp) or (Any, Any))
        if not isinstance(value, Mapping):
            self.add(path, f"invalid value {_short_repr(value)}; expected {_describe(tp)}")
            return _INVALID
        out: dict[Any, Any] = {}
        ok = True
        for key, sub in value.items():
            if key_type is str and not isinstance(key, str):
                self.add(path, f"key {_short_repr(key)} is not a string")
                ok = False
                continue
            converted = self.convert(value_type, sub, path + (str(key),))
            if converted is _INVALID:
                ok = False
            else:
                out[key] = converted
        return out if ok else _INVALID


def _range_text(meta: Mapping[str, Any]) -> str:
    """``it must be >= 1 and <= 4294967295 (or -1)`` from a field's range metadata."""
    parts = []
    if meta.get("above") is not None:
        parts.append(f"> {meta['above']}")
    if meta.get("min") is not None:
        parts.append(f">= {meta['min']}")
    if meta.get("max") is not None:
        parts.append(f"<= {meta['max']}")
    text = "it must be " + " and ".join(parts)
    if "special" in meta:
        text += f" (or {meta['special']})"
    if meta.get("help"):
        text += f": {meta['help']}"
    return text


def _unknown_key_message(key: str, names: list[str], path: Path) -> str:
    message = f"unknown key; allowed keys in {_dotted(path)}: {_quoted_list(names)}"
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not match:
        lowered = {n.lower(): n for n in names}
        match = [lowered[m] for m in difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)]
    if match:
        message += f" (did you mean {match[0]!r}?)"
    return message


def _describe(tp: Any) -> str:
    """Human-readable name of a type hint, for error messages."""
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + _quoted_list(typing.get_args(tp))
    if origin is Union or (hasattr(types, "UnionType") and origin is getattr(types, "UnionType")):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return "a list" + (f" of {_describe(args[0])}" if len(set(args)) == 1 else "")
    if origin is dict:
        args = typing.get_args(tp)
        return "a mapping" + (f" of {_describe(args[1])}" if args else "")
    return {bool: "a bool (true or false)", int: "an int", float: "a float (a number)", str: "a string"}.get(
        tp, getattr(tp, "__name__", repr(tp))
    )


_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    hints = _HINTS_CACHE.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS_CACHE[cls] = hints
    return hints


def _build_root(
    cls: type,
    section: Any,
    *,
    origin: str | None = None,
    lines: dict[Path, int] | None = None,
    prefix: Path = (),
) -> Any:
    """Validate ``section`` against ``cls``; raise one ConfigError listing every problem.

    ``origin`` (a file name) and ``lines`` (key path in the file -> line number)
    locate each problem in the file; ``prefix`` is where the section sits in it.
    """
    validator = _Validator()
    result = validator.section(cls, section, ())
    if result is not _INVALID:
        return result
    rendered = []
    for path, message in validator.problems:
        if origin is not None:
            line = _line_of(lines or {}, prefix + path)
            where = f"{origin}:{line}" if line else origin
            message = f"{where}: {message}"
        rendered.append(message)
    if len(rendered) == 1:
        text = rendered[0]
    else:
        text = f"{len(rendered)} problems in the {SECTION} config:\n" + _bulleted(rendered)
    raise ConfigError(text, rendered)


#: a message lists at most this many problems, then how many more (40,000 unknown keys are not 40,000 lines)
MAX_LISTED_PROBLEMS = 20


def _bulleted(problems: list[str]) -> str:
    """``  - problem`` lines, the first :data:`MAX_LISTED_PROBLEMS` of them and a count of the rest.

    >>> text = _bulleted([f"k{i}: unknown key" for i in range(22)])
    >>> len(text.splitlines()), "and 2 more problems" in text
    (21, True)
    """
    shown = [f"  - {p}" for p in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        shown.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more problems (fix these first; the full list "
                     "is in ConfigError.problems)")
    return "\n".join(shown)


def _line_of(lines: dict[Path, int], path: Path) -> int | None:
    """Line of ``path`` in the file, or of its closest ancestor that has one."""
    while True:
        if path in lines:
            return lines[path]
        if not path:
            return None
        path = path[:-1]


# --------------------------------------------------------------------------- YAML files


@dataclasses.dataclass
class ConfigFile:
    """A YAML configuration file read and validated as a whole (what :func:`read_config_file` returns).

    ``accelerate`` holds accelerate's own keys (validated: types and ranges), ``section`` the raw
    ``hf_gradfix:`` section (None when the file has none) and ``gradfix`` the validated plugin settings.
    """

    path: str
    accelerate: dict
    section: dict | None
    gradfix: GradFixConfig


def read_config_file(source: str | os.PathLike, *, via_env: bool = False, require_section: bool = False) -> ConfigFile:
    """Read, split and validate one YAML file: the one implementation behind the library and the CLI.

    Refuses (with one :class:`ConfigError` naming file, line, key, value and the fix): an unreadable file,
    invalid YAML, any tag that builds a Python object (``!!python/...``), a duplicate key anywhere, accelerate
    keys of the wrong type or out of range (``num_processes: 0``, ``main_process_port: http``, an unprefixed
    ``parallelism_config`` key), a misspelled accelerate key next to an ``hf_gradfix:`` section, and every
    problem of the section itself.  A file with only accelerate keys gives the default plugin settings, unless
    ``require_section`` (the library asked for the plugin settings of a file that has none: a hint instead).

    >>> import os, tempfile
    >>> fd, name = tempfile.mkstemp(suffix=".yaml"); _ = os.write(fd, b"num_processes: 2\\nhf_gradfix:\\n  packing: true\\n"); os.close(fd)
    >>> cf = read_config_file(name)
    >>> cf.accelerate, cf.section, cf.gradfix.packing.enabled
    ({'num_processes': 2}, {'packing': True}, True)
    >>> os.unlink(name)
    """
    raw = os.fsdecode(os.fspath(source))
    path = os.path.expanduser(raw)
    shown = raw
    from ..files import not_a_regular_file
    from .shipped import shipped_names, shipped_path

    if not os.path.exists(path) and shipped_path(raw) is not None:  # a shipped configuration, by name
        path = str(shipped_path(raw))

    kind = not_a_regular_file(path)
    if kind is not None and not os.path.isdir(path):  # a FIFO blocks open() until a writer comes; a device never ends
        raise _refuse(f"{raw}: {kind}; a configuration file must be a regular YAML file", via_env)
    try:
        with open(path, encoding="utf-8") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise _refuse(f"{raw}: {size:,} bytes; a configuration file is at most {MAX_FILE_BYTES:,} bytes "
                              "(1 MiB): this is not a configuration file, or it carries data that belongs elsewhere",
                              via_env)
            text = fh.read(MAX_FILE_BYTES + 1)  # a pipe or device has no size: read no more than the limit
            if len(text.encode("utf-8")) > MAX_FILE_BYTES:
                raise _refuse(f"{raw}: more than {MAX_FILE_BYTES:,} bytes; a configuration file is at most "
                              f"{MAX_FILE_BYTES:,} bytes (1 MiB)", via_env)
    except FileNotFoundError:
        resolved = os.path.abspath(path)
        extra = f" (resolved to {resolved})" if resolved != raw else ""
        if via_env:
            raise ConfigError(
                f"{ENV_VAR}={raw!r}: config file not found{extra}; "
                f"fix the path or unset {ENV_VAR} to use the defaults"
            ) from None
        names = ", ".join(n for n in shipped_names() if "/" not in n)
        raise ConfigError(f"config file not found: {raw}{extra}; give a file, or the name of a shipped "
                          f"configuration ({names}, accelerate/...: hf-gradfix configs list)") from None
    except IsADirectoryError:
        raise ConfigError(_env_note(f"config path is a directory, not a YAML file: {raw}", via_env)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(_env_note(f"{raw}: not UTF-8 text ({err.reason} at byte {err.start})", via_env)) from None
    except OSError as err:
        raise ConfigError(_env_note(f"cannot read config file {raw}: {err.strerror or err}", via_env)) from None

    data, lines, duplicates, surprises = _parse_yaml(text, shown, via_env)
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(
            _env_note(
                f"{shown}: expected a mapping at the top level (accelerate's keys and an '{SECTION}:' section, or "
                f"the section's own keys such as 'loss:'), got {type(data).__name__} {_short_repr(data)}",
                via_env,
            )
        )
    data = dict(data or {})
    if SECTION not in data:
        for key in data:
            if isinstance(key, str) and difflib.get_close_matches(key, [SECTION], n=1, cutoff=0.8):
                raise ConfigError(_env_note(
                    f"{shown}:{lines.get((key,), '?')}: {key}: unknown key (did you mean {SECTION!r}?); the plugin's "
                    f"settings go under one '{SECTION}:' key", via_env))
    if SECTION in data:
        section, prefix = data.pop(SECTION), (SECTION,)
        accelerate = data
    elif data and not require_section and all(isinstance(k, str) and k in _accelerate_keys(data) for k in data):
        section, prefix, accelerate = None, (SECTION,), data  # a plain accelerate file: plugin defaults
    else:
        section, prefix, accelerate = data, (), {}
    for dup_path, line, first_line in duplicates:
        if dup_path[: len(prefix)] == prefix and prefix:
            key = _dotted(dup_path[len(prefix):])
        elif not prefix:
            key = _dotted(dup_path)
        else:
            key = ".".join(str(p) for p in dup_path)
        raise ConfigError(
            _env_note(
                f"{shown}:{line}: {key}: duplicate key (first at line {first_line}); "
                "YAML would silently keep only the last one, remove one of them",
                via_env,
            )
        )
    problems = [
        f"{shown}:{_line_of(lines, path) or '?'}: {message}" for path, message in _check_accelerate(accelerate)
    ]
    for where, line, why in surprises:  # only the plugin's keys: accelerate reads its own the way it always has
        if section is not None and where[: len(prefix)] == prefix:
            problems.append(f"{shown}:{line}: {_dotted(where[len(prefix):])}: {why}")
    gradfix = None
    if section is not None or require_section:
        try:
            gradfix = _build_root(GradFixConfig, section, origin=shown, lines=lines, prefix=prefix)
        except ConfigError as err:
            problems.extend(err.problems)
    if gradfix is not None and accelerate:  # what the section asks of the mesh the file's accelerate keys launch
        where = prefix + ("parallel", "cp_balance")
        problems += [f"{shown}:{_line_of(lines, where) or '?'}: {_dotted(where[len(prefix):])}: {message}"
                     for message in _launch_conflicts(gradfix, accelerate)]
    if problems:
        text = problems[0] if len(problems) == 1 else (
            f"{len(problems)} problems in {shown}:\n" + _bulleted(problems)
        )
        raise ConfigError(_env_note(text, via_env), problems)
    if section is not None and not isinstance(section, Mapping):
        section = None  # `hf_gradfix:` with nothing under it
    return ConfigFile(path=shown, accelerate=accelerate, section=dict(section) if section is not None else None,
                      gradfix=gradfix if gradfix is not None else GradFixConfig())


def _launch_conflicts(gradfix: GradFixConfig, acc: Mapping[str, Any]) -> list[str]:
    """Settings of the section that do nothing on the mesh the file's accelerate keys launch: ``cp_balance:
    long_documents`` where neither the section (its own degrees) nor accelerate's ``parallelism_config`` sets cp > 1
    (a section without accelerate keys is checked on the trainer's mesh at install)."""
    par = gradfix.parallel
    if par.cp_balance != "long_documents" or par.mesh_given():  # the section's own mesh: its schema checks it
        return []
    pc = acc.get(_PC) if isinstance(acc.get(_PC), Mapping) else {}
    cp = pc.get(f"{_PC_PREFIX}cp_size")
    if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp > 1):
        return []  # cp > 1, or a value _check_accelerate refuses already
    return [cp_balance_without_cp(f"the launch this file describes has cp 1 (no {_PC_PREFIX}cp_size > 1 in its "
                                  f"{_PC}, no parallel degrees in the section)")]


def _load_file(source: str | os.PathLike, via_env: bool = False) -> GradFixConfig:
    cf = read_config_file(source, via_env=via_env, require_section=True)
    g = cf.gradfix
    if g.parallel.pp > 1 and g.packing.enabled:
        # both from the file: the pipeline refuses the pair at run time (packed rows' document boundaries are not
        # carried to the stages); the library says so on reading it, in config check's line
        from ..parallel.pipeline import PipelineError, check_combination

        try:
            check_combination(pp=g.parallel.pp, packing=True)
        except PipelineError as err:
            raise _refuse(f"{cf.path}: {SECTION}.{err}", via_env) from None
    return g


# --------------------------------------------------------------------------- accelerate's keys

_PC = "parallelism_config"
_PC_PREFIX = "parallelism_config_"
_DISTRIBUTED_TYPES = (
    "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
    "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON",
)
# key -> (kind, allowed / range); null is accepted everywhere (accelerate's default).
_ACCELERATE_SPEC: dict[str, tuple[str, Any]] = {
    "compute_environment": ("choice", ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")),
    "distributed_type": ("choice", _DISTRIBUTED_TYPES),
    "mixed_precision": ("choice", ("no", "fp16", "bf16", "fp8")),
    "dynamo_backend": ("str", None),
    "num_processes": ("int", {"min": 1, "max": 2**20, "help": "processes in total, over every machine"}),
    "num_machines": ("int", {"min": 1, "max": 2**20, "help": "machines (nodes) of the launch"}),
    "machine_rank": ("int", {"min": 0, "max": 2**20, "help": "this machine's index, 0 .. num_machines - 1"}),
    "main_process_port": ("int", {"min": 1, "max": 65535, "help": "a TCP port"}),
    "main_process_ip": ("str", None),
    "rdzv_backend": ("str", None),
    "main_training_function": ("str", None),
    "gpu_ids": ("str_or_int", None),
    "use_cpu": ("bool", None),
    "debug": ("bool", None),
    "same_network": ("bool", None),
    "enable_cpu_affinity": ("bool", None),
    "tpu_use_cluster": ("bool", None),
    "tpu_use_sudo": ("bool", None),
    "tpu_vm": ("any", None),
    "downcast_bf16": ("bool_or_str", None),
    "fp8_config": ("mapping", None),
    "deepspeed_config": ("mapping", None),
    "fsdp_config": ("mapping", None),
    "megatron_lm_config": ("mapping", None),
    "mpirun_config": ("mapping", None),
    "dynamo_config": ("mapping", None),
    "ipex_config": ("mapping", None),
    "parallelism_config": ("mapping", None),
}
_PC_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _accelerate_keys(wanted: typing.Iterable[Any] = ()) -> frozenset:
    """accelerate's top-level config keys: a fixed list, plus its own ``ClusterConfig`` fields when a key in
    ``wanted`` is not in that list (accelerate is imported only then: it costs seconds)."""
    keys = set(_ACCELERATE_KEYS) | set(_ACCELERATE_SPEC)
    if all(k in keys for k in wanted):
        return frozenset(keys)
    try:  # optional: the key list of the installed accelerate (this module needs only yaml)
        from accelerate.commands.config.config_args import ClusterConfig

        keys |= {f.name for f in dataclasses.fields(ClusterConfig)}
    except Exception:  # noqa: BLE001 - accelerate missing or changed: the fixed list is enough
        pass
    return frozenset(keys)


# accelerate launch copies every key of these sections onto its own command-line arguments (``fsdp_config.x`` ->
# ``args.fsdp_x``) and silently ignores a key that is not one of them: the prefix it adds, per section.
_NESTED_PREFIX = {"fsdp_config": ("fsdp", "fsdp_"), "fp8_config": ("fp8", "fp8_"), "dynamo_config": ("dynamo_", "dynamo_")}
_NESTED_SECTIONS = ("fsdp_config", "deepspeed_config", "parallelism_config", "megatron_lm_config", "fp8_config",
                    "dynamo_config", "mpirun_config", "ipex_config")


def _launch_argument_names() -> frozenset | None:
    """The destinations of ``accelerate launch``'s own arguments (None when accelerate is not importable)."""
    try:
        from accelerate.commands.launch import launch_command_parser

        return frozenset(a.dest for a in launch_command_parser()._actions)
    except Exception:  # noqa: BLE001 - accelerate missing or changed: nested keys are then left to accelerate
        return None


def _launch_choices() -> dict[str, tuple[str, ...]]:
    """``{dest: allowed values}`` of accelerate launch's own arguments that have choices (``fsdp_version``: '1', '2';
    ``dynamo_backend``; ``mixed_precision``), plus the FSDP enums accelerate checks only when it builds the plugin."""
    out: dict[str, tuple[str, ...]] = {}
    try:
        from accelerate.commands.launch import launch_command_parser

        for action in launch_command_parser()._actions:
            if action.choices:
                out[action.dest] = tuple(str(c) for c in action.choices)
        from accelerate.utils import constants

        for dest, name in (("fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY"),
                           ("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY"),
                           ("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE"),
                           ("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH")):
            values = getattr(constants, name, None)
            if values:
                out.setdefault(dest, tuple(str(v) for v in values))
    except Exception:  # noqa: BLE001 - accelerate missing or changed: its own launch checks what it knows
        return {}
    return out


def _nested_value_problems(acc: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """A value of a nested accelerate setting outside accelerate's own choices (``fsdp_version: 3``,
    ``fsdp_sharding_strategy: HALF_SHARD``, ``dynamo_backend: TURBO``): accelerate launch raises on some only after
    the processes start, others it ignores."""
    choices = _launch_choices()
    if not choices:
        return []
    problems = []
    for name in _NESTED_SECTIONS:
        section = acc.get(name)
        if not isinstance(section, Mapping):
            continue
        starts, added = _NESTED_PREFIX.get(name, ("", ""))
        for key, value in section.items():
            if not isinstance(key, str) or value is None:
                continue
            dest = key if key.startswith(starts) else added + key
            allowed = choices.get(dest)
            if not allowed:
                continue
            lowered = {a.lower(): a for a in allowed}
            if dest == "fsdp_sharding_strategy" and str(value).isdigit() and 1 <= int(value) <= len(allowed):
                continue  # accelerate also takes the enum's number
            if isinstance(value, bool) or str(value).lower() not in lowered:
                guess = difflib.get_close_matches(str(value).lower(), list(lowered), n=1, cutoff=0.6)
                hint = f" (did you mean {lowered[guess[0]]!r}?)" if guess else ""
                problems.append(((name, key), f"{name}.{key}: invalid value {_short_repr(value)}; allowed values: "
                                              f"{_quoted_list(allowed)}{hint} (accelerate's own choices)"))
    return problems


def _nested_key_problems(acc: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """A key of ``fsdp_config``, ``deepspeed_config``, ``parallelism_config``, ... that accelerate launch would
    silently ignore (a typo such as ``fsdp_versoin``): checked against accelerate launch's own argument names."""
    sections = [(name, acc[name]) for name in _NESTED_SECTIONS if isinstance(acc.get(name), Mapping) and acc[name]]
    if not sections:
        return []
    names = _launch_argument_names()
    if names is None:
        return []
    pool = sorted(names)
    problems = []
    for name, section in sections:
        starts, added = _NESTED_PREFIX.get(name, ("", ""))
        for key in section:
            if not isinstance(key, str):
                problems.append(((name,), f"{name}: key {_short_repr(key)} is not a string"))
                continue
            if name == _PC and (not key.startswith(_PC_PREFIX) or key.endswith("_size")):
                continue  # checked with the sizes in _check_accelerate
            dest = key if key.startswith(starts) else added + key
            if dest in names:
                continue
            match = difflib.get_close_matches(dest, pool, n=1, cutoff=0.75)
            hint = f" (did you mean {match[0]!r}?)" if match else " (accelerate launch --help lists them)"
            problems.append(((name, key), f"{name}.{key}: unknown key{hint}; accelerate launch silently ignores "
                                          f"a key of {name} that is not one of its arguments"))
    return problems


def _check_accelerate(acc: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """(key path, message) for every accelerate key of the wrong type, out of range or misspelled."""
    problems: list[tuple[Path, str]] = []
    known = _accelerate_keys(acc)
    checker = _Validator()

    def bad(path: Path, message: str) -> None:
        problems.append((path, f"{'.'.join(map(str, path))}: {message}"))

    for key, value in acc.items():
        path: Path = (key,)
        if not isinstance(key, str):
            bad(path, f"key {_short_repr(key)} is not a string")
            continue
        if key not in known:
            match = difflib.get_close_matches(key, sorted(known | {SECTION}), n=1, cutoff=0.75)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            bad(path, f"unknown accelerate key{hint}; accelerate refuses unknown keys, and the plugin's settings "
                      f"go under '{SECTION}:'")
            continue
        kind, arg = _ACCELERATE_SPEC.get(key, ("any", None))
        if value is None or kind == "any":
            continue
        if kind == "choice":
            if not (isinstance(value, str) and value in arg):  # accelerate's enums are case-sensitive
                lowered = {str(a).lower(): a for a in arg}
                guess = difflib.get_close_matches(str(value).lower(), list(lowered), n=1, cutoff=0.6)
                hint = f" (did you mean {lowered[guess[0]]!r}?)" if guess else ""
                bad(path, f"invalid value {_short_repr(value)}; allowed values: {_quoted_list(arg)}{hint}")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                fix = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else (
                    "; remove the quotes" if isinstance(value, str) and value.strip().isdigit() else "")
                bad(path, f"invalid value {_short_repr(value)}; expected a whole number{fix} ({arg['help']})")
            elif checker.in_range(value, path, arg) is _INVALID:
                bad(path, checker.problems.pop()[1].split(": ", 1)[1])
        elif kind == "str" and not isinstance(value, str):
            bad(path, f"invalid value {_short_repr(value)}; expected a string (quote it)")
        elif kind == "str_or_int" and (isinstance(value, bool) or not isinstance(value, (str, int))):
            bad(path, f"invalid value {_short_repr(value)}; expected 'all' or device ids such as '0,1'")
        elif kind == "bool" and not isinstance(value, bool):
            bad(path, f"invalid value {_short_repr(value)}; expected true or false")
        elif kind == "bool_or_str" and not isinstance(value, (bool, str)):
            bad(path, f"invalid value {_short_repr(value)}; expected true/false or 'no'")
        elif kind == "mapping" and not isinstance(value, Mapping):
            bad(path, f"invalid value {_short_repr(value)}; expected a mapping of {key} settings")
    pc = acc.get(_PC)
    if isinstance(pc, Mapping):
        for key, value in pc.items():
            path = (_PC, key)
            bare = key[len(_PC_PREFIX):] if isinstance(key, str) and key.startswith(_PC_PREFIX) else str(key)
            if not (isinstance(key, str) and key.startswith(_PC_PREFIX)):
                bad(path, f"accelerate only reads keys with the '{_PC_PREFIX}' prefix and silently ignores this "
                          f"one; write '{_PC_PREFIX}{bare}'")
                continue
            name = bare[: -len("_size")] if bare.endswith("_size") else None
            if name is None or value is None:
                continue
            if name not in _PC_SIZES:
                bad(path, f"unknown size; allowed: {_quoted_list(_PC_PREFIX + n + '_size' for n in _PC_SIZES)}")
            elif isinstance(value, bool) or not isinstance(value, int):
                bad(path, f"invalid value {_short_repr(value)}; expected a whole number >= 1 ({name} degree)")
            elif not 1 <= value <= 2**20:
                bad(path, f"invalid value {value}; it must be >= 1 ({name} degree; accelerate has no -1 here)")
    problems.extend(_nested_key_problems(acc))
    problems.extend(_nested_value_problems(acc))
    rank, machines = acc.get("machine_rank"), acc.get("num_machines")
    if (isinstance(rank, int) and isinstance(machines, int) and not isinstance(rank, bool) and machines >= 1
            and not 0 <= rank < machines):
        bad(("machine_rank",), f"invalid value {rank}; it must be < num_machines ({machines})")
    for section, message in _ignored_engine_sections(acc):
        bad((section,), message)
    return problems


#: accelerate's engine sections and the distributed_type that reads each (accelerate launch decides the engine from
#: distributed_type alone: tests/parallel/test_deepspeed_config.py checks this against its own launch parser)
_ENGINE_SECTIONS = (("deepspeed_config", "DEEPSPEED", "DeepSpeed"), ("fsdp_config", "FSDP", "FSDP"))


def _ignored_engine_sections(acc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(section, problem) for an engine section accelerate launch would ignore: ``deepspeed_config`` next to
    ``distributed_type: FSDP`` launches FSDP without a word, and the reverse; an empty section is accelerate's own
    default and says nothing.

    >>> _ignored_engine_sections({"distributed_type": "FSDP", "fsdp_config": {}, "deepspeed_config": {"zero_stage": 2}})[0][1][:65]
    'ignored: distributed_type is FSDP, so accelerate launch runs FSDP'
    """
    kind = acc.get("distributed_type", "NO")
    if not isinstance(kind, str) or kind not in _DISTRIBUTED_TYPES:
        return []  # refused as a value of its own
    out = []
    for section, engine, name in _ENGINE_SECTIONS:
        if isinstance(acc.get(section), Mapping) and acc[section] and kind != engine:
            out.append((section, f"ignored: distributed_type is {kind}, so accelerate launch runs {kind} and never "
                                 f"reads {section}; fix: set distributed_type: {engine} to run {name}, or remove "
                                 f"{section}"))
    return out


def _env_note(message: str, via_env: bool) -> str:
    return f"{message}\n(config file named by ${ENV_VAR})" if via_env else message


MAX_FILE_BYTES = 1 << 20
"""Largest configuration file read (1 MiB); a bigger file is refused before it is parsed."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists accepted (a real file nests 4 deep)."""
MAX_NODES = 100_000
"""Most values a file may hold once its aliases are expanded (bounds the YAML "billion laughs")."""

# YAML 1.2 forbids these anywhere in a file (PyYAML's reader raises on them); found first, with line and column.
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff\ufffe\uffff]")
_Loader = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader  # libyaml's C parser where installed

# YAML 1.1 (PyYAML) resolves these plain scalars to numbers or booleans a reader would not expect.
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_OCTAL = re.compile(r"[-+]?0[0-7_]+")
_BINARY = re.compile(r"[-+]?0b[01_]+")
_INT_TAG, _FLOAT_TAG, _BOOL_TAG = ("tag:yaml.org,2002:" + t for t in ("int", "float", "bool"))


def _refuse(message: str, via_env: bool) -> ConfigError:
    return ConfigError(_env_note(message, via_env))


def _check_shape(text: str, shown: str, via_env: bool) -> None:
    """Refuse, from the event stream (before any node is built), nesting deeper than :data:`MAX_DEPTH` and more
    than :data:`MAX_NODES` values once aliases are expanded; both in time and memory linear in the file."""
    loader = _Loader(text)
    try:
        depth, total = 0, 0
        sizes: dict[str, int] = {}  # anchor -> values it expands to
        open_nodes: list[tuple[str | None, int]] = []  # (anchor, values before it) of each open collection
        while loader.check_event():
            event = loader.get_event()
            line = event.start_mark.line + 1 if event.start_mark is not None else "?"
            if isinstance(event, yaml.ScalarEvent):
                total += 1
                if event.anchor:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                total += sizes.get(event.anchor, 1)
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                open_nodes.append((event.anchor, total))
                total += 1
                depth += 1
                if depth > MAX_DEPTH:
                    raise _refuse(f"{shown}:{line}: nesting deeper than {MAX_DEPTH} levels at line {line}; a "
                                  "configuration file nests a few levels: this is not one", via_env)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
                anchor, before = open_nodes.pop()
                if anchor:
                    sizes[anchor] = total - before
            if total > MAX_NODES:
                raise _refuse(f"{shown}:{line}: more than {MAX_NODES:,} values (aliases expanded) at line {line}; "
                              "a configuration file holds a few dozen: remove the repeated aliases (*name) or the "
                              "data", via_env)
    except yaml.YAMLError as err:
        raise _refuse(_yaml_error_message(err, shown, text), via_env) from None
    finally:
        loader.dispose()


def _parse_yaml(text: str, shown: str, via_env: bool) -> tuple[Any, dict[Path, int], list[tuple], list[tuple]]:
    """Parse YAML text; return (data, {key path: 1-based line}, duplicate keys found, YAML 1.1 surprises found).

    Refuses hostile input with one line before building anything: a control character (line and column), nesting
    deeper than :data:`MAX_DEPTH`, more than :data:`MAX_NODES` values once aliases are expanded."""
    bad = _CONTROL_CHARS.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise _refuse(f"{shown}:{line}: control character U+{ord(bad.group()):04X} at line {line}, column {column}; "
                      "YAML allows none anywhere, not even in a comment: remove it", via_env)
    _check_shape(text, shown, via_env)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as err:
        raise _refuse(_yaml_error_message(err, shown, text), via_env) from None
    finally:
        loader.dispose()
    lines: dict[Path, int] = {}
    duplicates: list[tuple] = []
    surprises: list[tuple] = []
    if node is not None:
        _index_lines(node, (), lines, duplicates, surprises, set())
    return data, lines, duplicates, surprises


def _yaml11_surprise(node: yaml.ScalarNode) -> str | None:
    """Why a plain scalar that YAML 1.1 resolved to a number or a boolean is a surprise (None when it is not)."""
    if node.style:  # quoted: a string, as written
        return None
    raw = node.value
    if node.tag == _BOOL_TAG and raw.lower() not in ("true", "false"):
        value = raw.lower() in ("yes", "y", "on")
        return f"{raw!r} is read by YAML 1.1 as the boolean {str(value).lower()}; write {str(value).lower()}"
    if node.tag in (_INT_TAG, _FLOAT_TAG) and _SEXAGESIMAL.fullmatch(raw):
        value = yaml.safe_load(raw)
        return f"{raw!r} is read by YAML 1.1 as the base-60 number {value}; write the number you mean (e.g. {value})"
    if node.tag == _INT_TAG and _OCTAL.fullmatch(raw) and raw.lstrip("+-") not in ("0",):
        value = yaml.safe_load(raw)
        return (f"{raw!r} is read by YAML 1.1 as the octal number {value}; write {int(raw.replace('_', '')) if raw.replace('_', '').lstrip('+-').isdigit() else value} "
                f"without the leading zero (or {value} if octal was meant)")
    if node.tag == _INT_TAG and _BINARY.fullmatch(raw):
        value = yaml.safe_load(raw)
        return f"{raw!r} is read by YAML 1.1 as the binary number {value}; write {value} (YAML 1.2 has no 0b numbers)"
    if node.tag in (_INT_TAG, _FLOAT_TAG) and "_" in raw:
        value = yaml.safe_load(raw)
        return (f"{raw!r} is read by YAML 1.1 as the number {value} (YAML 1.2 and JSON read it as a string); "
                f"write {value} without the underscores")
    return None


def _yaml_error_message(err: yaml.YAMLError, shown: str, text: str = "") -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    detail = f"{problem} ({context})" if context else problem
    if "constructor for the tag" in str(problem):
        detail += "; configuration files are plain YAML: tags that build Python objects are refused, write the value"
    if "'\\t'" in str(problem) or "tab character" in str(problem).lower():
        detail += "; indent with spaces, YAML does not allow tabs"
    if mark is not None and "tabs" not in detail and "\t" in (text.splitlines()[mark.line: mark.line + 1] or [""])[0]:
        detail += "; indent with spaces, YAML does not allow tabs"
    if mark is not None:
        line, column = mark.line + 1, mark.column + 1
        return f"{shown}:{line}: invalid YAML at line {line}, column {column}: {detail}"
    return f"{shown}: invalid YAML: {detail}"


def _index_lines(node: yaml.Node, path: Path, lines: dict[Path, int], duplicates: list[tuple],
                 surprises: list[tuple], seen: set) -> None:
    """Record the 1-based line of every mapping key, every duplicated key as (path, line, first line) and every
    YAML 1.1 surprise as (path, line, why).  An aliased node is walked once (its first path): an alias never
    multiplies the work."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        why = _yaml11_surprise(node)
        if why is not None:
            surprises.append((path, node.start_mark.line + 1, why))
    elif isinstance(node, yaml.MappingNode):
        found: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in found:
                duplicates.append((path + (key,), line, found[key]))
            found.setdefault(key, line)
            lines.setdefault(path + (key,), line)
            _index_lines(value_node, path + (key,), lines, duplicates, surprises, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.setdefault(path + (index,), item.start_mark.line + 1)
            _index_lines(item, path + (index,), lines, duplicates, surprises, seen)
