"""``hf-gradfix env``: the versions and the device a bug report needs, paste-ready (like ``accelerate env``).

Lists Python, the platform, hf_gradfix and every package of the stack it works with (installed version or "not
installed"), the device (CUDA / CPU, GPU names and memory), the packages hf_gradfix integrates with that are installed
at a version CI did not test, with the command that installs the tested set (the line ``patch()`` warns with), and the
pins of the tested lock (shipped with the package: ``hf_gradfix/requirements/``) whose installed version differs:
only the pins whose package is installed count, an optional extra nobody installed is not a difference.

>>> lines = environment_lines()
>>> lines[0].startswith("- hf_gradfix version: ")
True
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

#: the stack, by distribution name (what pip calls it)
PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "deepspeed", "flash-attn",
            "bitsandbytes", "numba", "tokenizers", "safetensors", "matplotlib", "pyyaml")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _device_lines() -> list[str]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return ["- device: torch not importable"]
    if torch.cuda.is_available():
        names = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                 for i in range(torch.cuda.device_count())]
        return [f"- device: CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}"]
    return [f"- device: CPU only (torch {torch.__version__} sees no CUDA device)"]


def _lock_lines() -> list[str]:
    """The ``tested versions`` and ``lock`` lines: the integrated packages that differ from the tested lock (with the
    command that installs it), then every installed pin of that lock that differs."""
    from ..integration.versions import lock_drift, lock_of_installed, untested_versions

    lock = lock_of_installed()
    if not lock.is_file():
        return [f"- lock: {lock} is missing (a copy of the package without its data files)"]
    untested = untested_versions()
    lines = [f"- untested versions: {untested}" if untested else
             f"- untested versions: none (every installed package hf_gradfix integrates with is at its {lock.name} "
             "version)"]
    drift, installed = lock_drift(lock)
    shown = "; ".join(f"{name}: installed {version}, locked {pinned}" for name, version, pinned in drift[:20])
    if not drift:
        lines.append(f"- lock: the {installed} installed pin(s) of {lock.name} are at their locked versions ({lock})")
    else:
        lines.append(f"- lock: {len(drift)} of the {installed} installed pin(s) of {lock.name} differ: {shown}"
                     + (f"; and {len(drift) - 20} more" if len(drift) > 20 else "") + f" ({lock})")
    return lines


def environment_lines() -> list[str]:
    """The report, one ``- key: value`` line each."""
    from .. import __version__

    lines = [f"- hf_gradfix version: {__version__} ({Path(__file__).resolve().parent.parent})",
             f"- Python: {sys.version.split()[0]} ({sys.executable})",
             f"- platform: {platform.platform()}"]
    lines += [f"- {name}: {_version(name) or 'not installed'}" for name in PACKAGES]
    lines += _device_lines()
    lines += _lock_lines()
    return lines


def add_parser(sub: Any) -> None:
    """``env``, on the top-level parser's subcommands ``sub``."""
    sub.add_parser("env", help="versions of the stack and the device, for a bug report (like accelerate env)")


def run() -> int:
    """Print the report, paste-ready."""
    print("Copy-and-paste the text below in your GitHub issue\n")
    print("\n".join(environment_lines()))
    return 0
