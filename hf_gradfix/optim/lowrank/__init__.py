"""The low-rank optimizer machinery shared by GaLoreAdamW and ApolloAdamW, one concern per module.

* :mod:`.optimizer`: :class:`LowRankAdamW`, the public surface: construction, ``step()``, the plain-AdamW path and
  the Adam arithmetic, composed from the pieces below.
* :mod:`.intake`: what the constructor accepts (a model, tensors, named tensors, groups, galore-torch's and
  apollo-torch's group keys) normalized to parameter groups, and each group validated.
* :mod:`.plan`: the per-matrix plan (which matrices are projected, on which side, refreshed when).
* :mod:`.accumulation`: ``lowrank_grads=True``: the backward hooks that fold gradients into rank-r accumulators,
  DDP exclusion of the projected weights and the bucketed all-reduce of the accumulators.
* :mod:`.clipping`: ``clip_grad_norm_`` over what the step consumes, and the refusal of a clip that cannot reach
  the accumulators.
* :mod:`.state`: the low-rank moments (DTensors under FSDP2), basis agreement, and loading a saved state.
* :mod:`.tensors`: DTensor / fake-tensor / process-count helpers.

``from hf_gradfix.optim.lowrank import LowRankAdamW`` (the documented path) keeps working.  The submodules import
only torch and each other in one direction (tensors, plan, intake, state, clipping, accumulation, optimizer).
"""

from .optimizer import LowRankAdamW

__all__ = ["LowRankAdamW"]
