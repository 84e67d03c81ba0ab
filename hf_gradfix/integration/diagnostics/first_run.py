"""Notices before the steps of a first run that take minutes with no output of their own.

torch.compile (``TrainingArguments(torch_compile=True)``, accelerate's dynamo config, or a model the user compiled)
traces and compiles the model inside the first training step, silently: for a 2-layer test model on 2 CPU cores
(torch 2.13) 40 s with inductor, 6 s with aot_eager (tests/trainer/test_compile.py); minutes for a real model.
:func:`compile_notice` names it before that step.

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


def _dynamo_backend(trainer) -> str | None:
    """The backend accelerate compiles the model with at ``prepare`` (its TorchDynamoPlugin), None when it does not;
    "a torch.compile'd model" when the model handed in is already compiled (an OptimizedModule keeps ``_orig_mod``)."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "dynamo_plugin", None)
    backend = getattr(getattr(plugin, "backend", None), "value", getattr(plugin, "backend", None))
    if backend is not None and str(backend).lower() != "no":
        return f"backend {str(backend).lower()}"
    if any(hasattr(m, "_orig_mod") for m in (getattr(trainer, "model", None), getattr(trainer, "model_wrapped", None))):
        return "a torch.compile'd model"
    return None


def compile_notice(trainer) -> str | None:
    """The line to log before the first step of a trainer whose model torch.compile will compile, else None.

    >>> compile_notice(object()) is None
    True
    """
    how = _dynamo_backend(trainer)
    if how is None:
        return None
    return (
        f"hf_gradfix: torch.compile is on ({how}): the first step traces and compiles the model, silently: for a "
        "2-layer test model on 2 CPU cores 40 s with inductor, 6 s with aot_eager, minutes for a real model; later "
        "steps reuse the compiled graphs, and an input shape not seen before compiles once more (torch marks the "
        "changing dimension dynamic after its second size)."
    )


__all__ = ["SHM_OP", "compile_notice", "deepspeed_cpu_build_notice", "extension_build_dir"]
