"""Notices before the steps of a first run that take minutes with no output of their own.

DeepSpeed on CPU (``DS_ACCELERATOR=cpu``) JIT-builds its shared-memory all-reduce op (``deepspeed_shm_comm``, g++ via
torch.utils.cpp_extension) inside ``deepspeed.init_distributed``, the first time only: 330 s measured on 2 busy cores
(docs/multi-device.md), silent until "DeepSpeed ... built successfully". torch caches the build under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<ver>_cpu/``); a cached ``.so`` loads in seconds, so
the notice is given only when that file is missing and the op was not prebuilt into the DeepSpeed wheel.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

#: DeepSpeed's ShareMemCommBuilder.NAME (deepspeed/ops/op_builder/cpu/comm.py)
SHM_OP = "deepspeed_shm_comm"


def extension_build_dir(name: str, env: Mapping[str, str] | None = None) -> str:
    """Where torch.utils.cpp_extension builds and caches extension ``name`` (its ``_get_build_directory`` rule,
    without creating the folder as that private function does)."""
    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accel = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accel = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accel = "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accel}")
    return os.path.join(root, name)


def _prebuilt(name: str) -> bool:
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:  # noqa: BLE001 - no DeepSpeed (or a broken one): nothing of it will be built either
        return True
    return bool(installed_ops.get(name, False))


def deepspeed_cpu_build_notice(env: Mapping[str, str] | None = None) -> str | None:
    """The line to print before a DeepSpeed-on-CPU start that will compile its all-reduce op, else None.

    >>> deepspeed_cpu_build_notice({"DS_ACCELERATOR": "cuda"}) is None
    True
    """
    env = os.environ if env is None else env
    if env.get("DS_ACCELERATOR", "").strip().lower() != "cpu":
        return None
    where = extension_build_dir(SHM_OP, env)
    if os.path.isfile(os.path.join(where, f"{SHM_OP}.so")) or _prebuilt(SHM_OP):  # cheap check first
        return None
    return (
        f"hf_gradfix: first DeepSpeed run on CPU: DeepSpeed now compiles its shared-memory all-reduce op ({SHM_OP}) "
        f"with g++, silently, once: about 5-6 minutes on 2 busy cores (330 s measured). It is cached in {where} and "
        "later launches start in seconds."
    )


__all__ = ["SHM_OP", "deepspeed_cpu_build_notice", "extension_build_dir"]
