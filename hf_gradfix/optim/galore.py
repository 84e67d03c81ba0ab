"""GaLoreAdamW: full-parameter training with Adam moments in a refreshed low-rank gradient subspace.

Zhao et al., "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection" (ICML 2024).
This module imports only torch.
"""

from __future__ import annotations

import torch

from . import projection as proj
from .lowrank import LowRankAdamW
from .lowrank.plan import _Plan
from .lowrank.tensors import _full, _local

__all__ = ["GaLoreAdamW"]


class GaLoreAdamW(LowRankAdamW):
    """AdamW whose moments for selected 2-D weights live in a rank-``rank`` subspace of their gradient.

    Every ``update_proj_gap`` steps the basis is refreshed from the current gradient's top singular
    vectors; in between, the gradient ``G`` is projected (``R = G P``), Adam runs on ``R``, and the update
    ``scale * N P^T`` is applied to the full weight.  Everything not projected is ``torch.optim.AdamW``.

    Args:
        params: the model (targets default to ``"all-linear"``, output head excluded), named parameters,
            parameter groups (a group may set ``project=False`` and any key below), or plain tensors
            (then every 2-D parameter is projected).
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW`` (decoupled decay, applied before the update).
        rank: subspace rank per matrix.
        update_proj_gap: optimizer steps between basis refreshes (>= 1).
        scale: multiplier of the back-projected update (the paper's alpha: 0.25 for pre-training).
        proj_side: ``auto`` (reduce the in-features; row-sharded FSDP2 weights stay shard-local), ``right``,
            ``left``, ``std`` / ``reverse_std`` (galore-torch: reduce the smaller / larger side).
        proj_method: ``svd`` (exact), ``randomized`` (randomized range finder, 5-15x faster on real
            gradients at 0.98 subspace overlap), ``auto`` (randomized when rank < min(m, n) / 4, else svd),
            ``identity`` (no projection; for tests).
        on_switch: what the moments do when the basis changes: ``keep`` (galore-torch), ``reproject``
            (rotate into the new basis), ``reset`` (zero them and restart bias correction).
        min_size: matrices whose smaller side is below this stay plain AdamW.
        stagger: spread the refreshes of the matrices over the gap instead of refreshing all at once.
        targets, exclude: module-name patterns (substring or regex) choosing / excluding matrices.
        oversample, niter: randomized SVD sketch size (rank + oversample) and power iterations.
        seed: seed of the randomized sketches (a dedicated generator; the global RNG is untouched).
        compat: ``torch`` (torch.optim.AdamW arithmetic) or ``galore_torch`` (galore-torch 1.0 arithmetic:
            eps outside the bias correction, decay after the update, basis in the parameter dtype; used to
            prove parity with it).
        sync_basis: under torch.distributed, broadcast every refreshed basis from rank 0 so all ranks agree.
        on_nonfinite: a NaN/inf gradient at ``step()``: ``warn`` (default; the update is applied, as torch's AdamW
            does), ``skip`` (no update: weights, moments and basis unchanged) or ``error`` (``NonFiniteError``).

        lowrank_grads: low-rank gradient accumulation.  A post-accumulate-grad hook projects each micro-batch's
            gradient of a projected matrix into a rank-``rank`` accumulator and frees the full gradient at once
            (projection is linear: the sum of projections is the projection of the sum), so no full gradient of
            a projected matrix outlives its backward, with gradient accumulation and under DDP (the optimizer
            all-reduces the accumulators, ``rank / d`` of the traffic; DDP is told to leave those weights
            alone).  Only a matrix whose basis refreshes at the coming step keeps its full gradient for the
            SVD; ``stagger`` defaults to True with it, so that is a few matrices at a time.  Clip with
            :meth:`clip_grad_norm_` (it clips the accumulators).  Not with FSDP2 (refused, with the reason).
        initial_basis: with ``lowrank_grads``, where the first basis comes from: ``accumulated`` (the first
            step holds every projected matrix's full gradient, exactly as full-gradient GaLore) or
            ``first_microbatch`` (each matrix's first basis from its first micro-batch's gradient, rank 0's
            under DDP: no step ever holds more than the refreshing matrices' gradients; the first basis is
            then not the accumulated gradient's, every later refresh is).

    A non-finite gradient or a failed SVD at a refresh keeps the previous basis (with a warning).

    Example:

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> opt = GaLoreAdamW(model, lr=1e-3, rank=8, update_proj_gap=10, targets=["0"])
    >>> opt.projected_names
    ['0.weight']
    >>> model(torch.randn(5, 32)).square().mean().backward(); opt.step()
    >>> tuple(opt.state[model[0].weight]["exp_avg"].shape)   # (out, rank): 32 x 8 instead of 32 x 32
    (32, 8)
    """

    _name = "GaLoreAdamW"
    _basis_from_gradient = True

    def _has_basis(self, state: dict) -> bool:
        return "proj" in state

    def _method(self, group: dict, shape: tuple[int, int]) -> str:
        method = group["proj_method"]
        if method == "auto":
            return "randomized" if group["rank"] < min(shape) / 4 else "svd"
        return method

    def _new_basis(self, p: torch.Tensor, state: dict, group: dict, plan: _Plan) -> torch.Tensor | None:
        """The refreshed basis from the full gradient, or None to keep the current one."""
        g = _full(p.grad)
        rank, side = group["rank"], plan.side
        galore_compat = group["compat"] == "galore_torch"
        g32 = g.float()
        method = self._method(group, tuple(g.shape))
        if not bool(torch.isfinite(g32).all()):
            self._warn_once(
                f"nonfinite:{plan.name}",
                f"{self._name}: non-finite gradient in {plan.name} at a basis refresh (step {int(state['step'])}); "
                "keeping the previous basis",
            )
            if self._has_basis(state):
                return None
            gen = torch.Generator().manual_seed((self._seed * 1_000_003 + plan.index) % 2**63)
            return proj.random_basis(g.shape[proj.reduced_dim(side)], rank, gen, device=g.device)
        gen = None
        if method == "randomized":
            refreshes = int(state["step"]) // group["update_proj_gap"]
            gen = torch.Generator().manual_seed(((self._seed * 1_000_003 + plan.index) * 1_000_033 + refreshes) % 2**63)
        try:
            basis = proj.top_basis(g32, rank, side, method=method, oversample=group["oversample"], niter=group["niter"], generator=gen)
        except torch.linalg.LinAlgError:
            try:
                basis = proj.top_basis(g32.double(), rank, side, method=method, oversample=group["oversample"], niter=group["niter"], generator=gen).float()
            except torch.linalg.LinAlgError:
                self._warn_once(
                    f"svd:{plan.name}",
                    f"{self._name}: SVD failed to converge for {plan.name} at step {int(state['step'])}; keeping the previous basis",
                )
                if self._has_basis(state):
                    return None
                gen = torch.Generator().manual_seed((self._seed * 1_000_003 + plan.index) % 2**63)
                return proj.random_basis(g.shape[proj.reduced_dim(side)], rank, gen, device=g.device)
        if galore_compat:
            # galore-torch casts the basis to the parameter dtype and keeps LAPACK's signs.
            return basis.to(p.dtype)
        return proj.canonicalize_signs(basis)

    def _ensure_state(self, p: torch.Tensor, group: dict, plan: _Plan) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["side"] = torch.tensor(plan.side, dtype=torch.int8)
            if group["on_switch"] == "reset":
                state["refresh_step"] = torch.tensor(0.0, dtype=torch.float32)
        plan.side = int(state["side"])
        return state

    def _refresh(self, p: torch.Tensor, state: dict, group: dict, plan: _Plan) -> None:
        """A new basis from ``p.grad`` (all ranks get rank 0's), and the moments' rule for the switch."""
        side = plan.side
        new = self._new_basis(p, state, group, plan)
        if new is None:
            return
        new = self._broadcast(new.contiguous() if group["compat"] == "torch" else new)
        old = state.get("proj")
        state["proj"] = new
        if "exp_avg" not in state:
            dtype = p.dtype if group["compat"] == "galore_torch" else torch.float32
            self._init_moments(p, state, side, group["rank"], dtype)
        elif old is not None and group["on_switch"] == "reproject":
            t = float(state["step"])
            b1, b2 = group["betas"]
            proj.transfer_moments(
                _local(state["exp_avg"]), _local(state["exp_avg_sq"]), old.float(), new.float(), side, 1 - b1**t, 1 - b2**t
            )
        elif old is not None and group["on_switch"] == "reset":
            _local(state["exp_avg"]).zero_()
            _local(state["exp_avg_sq"]).zero_()
            state["refresh_step"] = state["step"].clone()

    def _projected_grad(self, g: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """``R``: the local gradient in the current basis, in the moments' dtype."""
        m = _local(state["exp_avg"])
        g = g.to(m.dtype) if group["compat"] == "torch" else g
        return proj.project(g, state["proj"].to(g.dtype), int(state["side"])).to(m.dtype)

    # low-rank gradient accumulation (see LowRankAdamW._lowrank_hook)
    def _project_for_accumulation(self, p: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        return self._projected_grad(_local(p.grad), state, group)

    def _first_basis_from(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:
        state = self._ensure_state(p, group, plan)
        self._refresh(p, state, group, plan)

    def _window_projected_grad(self, p: torch.Tensor, group: dict, plan: _Plan) -> tuple[dict, torch.Tensor]:
        """(state, R) for this step: the basis refreshed if due, then R = the projected window gradient; with
        low-rank accumulation R was summed micro-batch by micro-batch (projection is linear) and the refresh, if
        any, already happened when the accumulation started."""
        state = self._ensure_state(p, group, plan)
        acc = self._lowrank_acc.get(p)
        if acc is None and self._refresh_due(state, group, plan):
            self._refresh(p, state, group, plan)
        r = acc if acc is not None else self._projected_grad(_local(p.grad), state, group)
        return state, r

    def _step_projected(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:
        state, r = self._window_projected_grad(p, group, plan)
        side = plan.side
        basis = state["proj"]
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        if p in self._lowrank_acc:  # the accumulator is in the gradient's dtype; the moments may be wider
            r = r.to(m.dtype)
        state["step"] += 1
        t = float(state["step"]) - (float(state["refresh_step"]) if "refresh_step" in state else 0.0)
        direction, step_size = self._adam_direction(r, m, v, group, t)
        update = proj.project_back(direction, basis.to(direction.dtype), side)
        update.mul_(group["scale"])
        self._apply(_local(p), update, step_size, group)
