"""``hf-gradfix env``: the versions and the device a bug report needs, paste-ready (like ``accelerate env``).

Lists Python, the platform, hf_gradfix and every package of the stack it works with (installed version or "not
installed"), the device (CUDA / CPU, GPU names and memory), and, when run from a clone (``requirements/lock-tf5.txt``
next to the package), every pinned package whose installed version differs from the lock CI tested.

>>> lines = environment_lines()
>>> lines[0].startswith("- hf_gradfix version: ")
True
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path

#: the stack, by distribution name (what pip calls it)
PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "deepspeed", "flash-attn",
            "bitsandbytes", "numba", "tokenizers", "safetensors", "matplotlib", "pyyaml")
LOCK = Path(__file__).resolve().parent.parent / "requirements" / "lock-tf5.txt"


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


def lock_drift(lock: Path = LOCK) -> list[str] | None:
    """``name: installed X, locked Y`` for every pin of ``lock`` that differs (None when there is no lock file: an
    installed package, not a clone)."""
    if not lock.is_file():
        return None
    out = []
    for line in lock.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" not in line:
            continue
        name, pinned = (part.strip() for part in line.split("==", 1))
        installed = _version(name)
        if installed != pinned:
            out.append(f"{name}: installed {installed or 'not installed'}, locked {pinned}")
    return out


def environment_lines() -> list[str]:
    """The report, one ``- key: value`` line each."""
    from . import __version__

    lines = [f"- hf_gradfix version: {__version__} ({Path(__file__).resolve().parent})",
             f"- Python: {sys.version.split()[0]} ({sys.executable})",
             f"- platform: {platform.platform()}"]
    lines += [f"- {name}: {_version(name) or 'not installed'}" for name in PACKAGES]
    lines += _device_lines()
    drift = lock_drift()
    if drift is None:
        lines.append("- lock: no requirements/lock-tf5.txt beside the package (an installed copy, not a clone)")
    elif not drift:
        lines.append(f"- lock: every pin of {LOCK.name} is installed at its locked version")
    else:
        lines.append(f"- lock: {len(drift)} pin(s) of {LOCK.name} differ: " + "; ".join(drift[:20])
                     + (f"; and {len(drift) - 20} more" if len(drift) > 20 else ""))
    return lines
