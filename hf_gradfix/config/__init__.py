"""Configuration of hf_gradfix: typed schema, YAML/dict/env loading, strict validation.

Where :func:`load_config` reads one configuration from (the first present wins; ``patch()`` and
``GradFixCallback`` combine ``$HF_GRADFIX_CONFIG`` with their own argument by the rule of
:mod:`hf_gradfix.config.sources`: each source sets the keys it names, a key set twice to different values is refused):

1. the argument of :func:`load_config` -- a :class:`GradFixConfig`, a dict, or a
   YAML file path;
2. the YAML file named by ``$HF_GRADFIX_CONFIG`` (:data:`ENV_VAR`);
3. the defaults, right for most users.

A YAML file is either the plugin's section itself or an accelerate config file
with an ``hf_gradfix:`` key (accelerate's own keys are ignored)::

    distributed_type: MULTI_GPU
    num_processes: 8
    hf_gradfix:
      loss:
        count_rule: shifted

Example::

    >>> from hf_gradfix.config import load_config, config_to_dict
    >>> cfg = load_config({"loss": {"count_rule": "shifted"}})
    >>> config_to_dict(cfg)["loss"]["count_rule"]
    'shifted'

This subpackage imports only the standard library and ``yaml``.
"""

from .loader import ENV_VAR, SECTION, config_from_dict, config_to_dict, load_config
from .schema import ConfigError, GradFixConfig, LossConfig, OptimizerConfig, PackingConfig, ParallelConfig

__all__ = [
    "ENV_VAR",
    "SECTION",
    "ConfigError",
    "GradFixConfig",
    "LossConfig",
    "OptimizerConfig",
    "PackingConfig",
    "ParallelConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]
