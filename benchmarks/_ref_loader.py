"""galore-torch's GaLoreAdamW module without its package __init__ (which imports bitsandbytes' 8-bit optimizers)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def galore_ref():
    alias = "_ref_galore_torch"
    if alias not in sys.modules:
        spec = importlib.util.find_spec("galore_torch")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("galore-torch is not installed (pip install galore-torch==1.0)")
        stub = types.ModuleType(alias)
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules[alias] = stub
    return importlib.import_module(f"{alias}.adamw")
