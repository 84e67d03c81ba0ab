"""Low-rank optimizers for full-parameter training: GaLore and APOLLO on one projection machinery.

* :class:`GaLoreAdamW8bit`: the same with bitsandbytes' blockwise 8-bit moments (imported when built).
* :class:`GaLoreAdamW`: Adam moments in the top-``rank`` singular subspace of each selected weight's
  gradient, refreshed every ``update_proj_gap`` steps (exact or randomized SVD).
* :class:`ApolloAdamW` / :func:`apollo_mini`: a random projection only sets channel-wise (or tensor-wise)
  scales for the raw gradient.
* :func:`low_rank_param_groups`: {decay, no decay} x {projected, plain} groups for a model.
* :func:`state_bytes` / :func:`expected_state_bytes`: the optimizer state, measured and predicted.

The subpackage imports only torch (it is usable in any training loop).

>>> import torch, hf_gradfix.optim as optim
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
>>> opt = optim.GaLoreAdamW(model, lr=1e-3, rank=4, targets=["0"])
>>> model(torch.randn(3, 64)).sum().backward(); opt.step()
>>> optim.state_bytes(opt) == optim.expected_state_bytes(opt)
True
"""

from .apollo import ApolloAdamW, apollo_mini
from .galore import GaLoreAdamW
from .galore8bit import GaLoreAdamW8bit
from .groups import OptimizerConfigError, low_rank_param_groups, no_decay_names, select_targets
from .lowrank import LowRankAdamW
from .memory import expected_state_bytes, state_bytes

__all__ = [
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "ApolloAdamW",
    "apollo_mini",
    "LowRankAdamW",
    "OptimizerConfigError",
    "low_rank_param_groups",
    "no_decay_names",
    "select_targets",
    "state_bytes",
    "expected_state_bytes",
]
