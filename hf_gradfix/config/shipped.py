"""The configurations shipped inside the package (``hf_gradfix/configs``), addressable by name from anywhere.

A name is a file's path under that folder without its extension (``cpu_pp``, ``accelerate/fsdp2``), or its bare
stem when no other shipped file has it (``fsdp2``). Every place that reads a configuration file
(``patch(config=...)``, ``GradFixCallback``, ``hf-gradfix config check`` / ``launch --config_file``) takes a name
where no file of that path exists; ``hf-gradfix configs list | show NAME | copy NAME [DEST]`` browses them.

>>> shipped_path("cpu_pp").name
'cpu_pp.yaml'
>>> shipped_path("accelerate/fsdp2").parent.name
'accelerate'
>>> shipped_path("no_such_config") is None
True
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "configs"
_SUFFIXES = (".yaml", ".yml", ".json")


def shipped_names() -> dict[str, Path]:
    """Every shipped configuration by its name (relative path without the extension)."""
    if not SHIPPED_DIR.is_dir():
        return {}
    files = sorted(p for p in SHIPPED_DIR.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
    return {p.relative_to(SHIPPED_DIR).with_suffix("").as_posix(): p for p in files}


def shipped_path(name: str) -> Path | None:
    """The shipped file a name stands for (None when it names none); ``configs/`` and an extension are tolerated."""
    key = str(name).strip().replace("\\", "/")
    for prefix in ("hf_gradfix/configs/", "configs/"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    for suffix in _SUFFIXES:
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    names = shipped_names()
    if key in names:
        return names[key]
    by_stem = [p for n, p in names.items() if n.rsplit("/", 1)[-1] == key]
    return by_stem[0] if len(by_stem) == 1 else None
