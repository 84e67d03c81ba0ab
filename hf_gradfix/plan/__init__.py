"""``hf-gradfix plan``: per-rank training memory for a model and a mesh, closed form and simulated.

The command line is :mod:`hf_gradfix.plan.command` (``plan_main``); nothing else in this package imports it.

>>> from hf_gradfix.plan import estimate, Settings, load_model_config   # doctest: +SKIP
"""

from .estimate import (GPU_MEMORY, TINY_MODELS, Plan, PlanError, Settings, estimate, load_model_config, param_table,
                       parse_memory, playbook_activation_bytes, playbook_model_state_bytes)

__all__ = ["GPU_MEMORY", "TINY_MODELS", "Plan", "PlanError", "Settings", "estimate", "load_model_config", "param_table",
           "parse_memory", "playbook_activation_bytes", "playbook_model_state_bytes"]

