"""The low-rank optimizer's state: the rank-r moments (DTensors with the parameter's placements under FSDP2), one
basis for all processes, and loading a saved state (low-rank tensors keep their saved dtype; a full-rank or
other-rank state is refused by name).  Apart from the step, which only fills and reads this state.

This module imports only torch.
"""

from __future__ import annotations

import torch

from .. import projection as proj
from ...errors import UsageError
from .tensors import _is_dtensor, _local, _world

_HOST_KEYS = ("proj_seed", "side")  # scalars the step reads on the host


class LowRankState:
    """Mixin of :class:`~hf_gradfix.optim.lowrank.LowRankAdamW`: moments, basis broadcast, ``load_state_dict``."""

    def _wrap_like(self, p: torch.Tensor, local: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
        """A low-rank moment as a DTensor with the parameter's placements (the reduced dim is never sharded)."""
        if not _is_dtensor(p):
            return local
        from torch.distributed.tensor import DTensor

        stride = (global_shape[1], 1)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(global_shape), stride=stride)

    def _init_moments(self, p: torch.Tensor, state: dict, side: int, rank: int, dtype: torch.dtype) -> None:
        lp = _local(p)
        m, n = p.shape
        lm, ln = lp.shape
        local_shape, global_shape = ((lm, rank), (m, rank)) if side == proj.RIGHT else ((rank, ln), (rank, n))
        state["exp_avg"] = self._wrap_like(p, torch.zeros(local_shape, dtype=dtype, device=lp.device), global_shape)
        state["exp_avg_sq"] = self._wrap_like(p, torch.zeros(local_shape, dtype=dtype, device=lp.device), global_shape)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Make every rank hold rank 0's tensor: one basis for all, bit for bit (a 3e-10 difference in a
        gradient can otherwise pick a different top-r subspace near a spectral gap)."""
        if self._sync_basis and _world() > 1:
            torch.distributed.broadcast(t, src=0)
        return t

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_loaded_state(state_dict)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype on load; the low-rank state keeps its own dtype.
        saved = state_dict["state"]
        for i, p in enumerate(pp for g in self.param_groups for pp in g["params"]):
            if (p in self._plans or self._keeps_state_dtype) and i in saved:
                for key, value in saved[i].items():
                    cur = self.state[p].get(key)
                    if isinstance(value, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.dtype != value.dtype:
                        # Take the saved tensor, not the cast one cast back: the round trip through the parameter
                        # dtype is lossy (an int64 proj_seed through fp32, fp32 moments through bf16).
                        self.state[p][key] = value.to(device=cur.device)
            if p in self._plans:  # read with int() every step: on the host, or each read syncs a GPU stream
                for key in _HOST_KEYS:
                    if isinstance(self.state[p].get(key), torch.Tensor):
                        self.state[p][key] = self.state[p][key].cpu()

    def _check_loaded_state(self, state_dict: dict) -> None:
        """Refuse, naming the matrix, a state this optimizer cannot continue from: a full-rank optimizer's (AdamW's
        moments have the matrix's shape) or one saved at another rank (torch would load it and fail later in a
        matmul, or not at all)."""
        saved = state_dict.get("state") if isinstance(state_dict, dict) else None
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict) or not isinstance(groups, list):
            raise UsageError(f"{self._name}.load_state_dict: expected an optimizer state_dict with 'state' and "
                             f"'param_groups', got {type(state_dict).__name__} with keys "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else '-'}")
        params = [p for g in self.param_groups for p in g["params"]]
        rank_of = {id(p): g["rank"] for g in self.param_groups for p in g["params"] if "rank" in g}
        for i, p in enumerate(params):
            plan = self._plans.get(p)
            entry = saved.get(i)
            if plan is None or not isinstance(entry, dict) or not torch.is_tensor(entry.get("exp_avg")):
                continue
            got = tuple(entry["exp_avg"].shape)
            if got == tuple(p.shape):
                raise UsageError(
                    f"{self._name}.load_state_dict: {plan.name}: the saved moments have the matrix's full shape {got}: "
                    f"this state was saved by a full-rank optimizer (AdamW?), not by {self._name}; resume with the "
                    "optimizer that saved it, or start this optimizer fresh (do not load the state)")
            rank = rank_of.get(id(p))
            m, n = p.shape
            want = (m, rank) if plan.side == proj.RIGHT else (rank, n)
            if rank is not None and got != want:
                raise UsageError(
                    f"{self._name}.load_state_dict: {plan.name}: the saved low-rank moments are {got}, this optimizer "
                    f"(rank {rank}) keeps {want}: the state was saved at another rank or projection side; resume with "
                    "the rank it was saved with")
