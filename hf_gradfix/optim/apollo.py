"""ApolloAdamW: SGD-like memory, AdamW-like updates, by channel-wise scaling of the raw gradient.

Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance" (arXiv 2412.05270, MLSys 2025).
Built on the same projection machinery as :class:`~hf_gradfix.optim.GaLoreAdamW`.
This module imports only torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import projection as proj
from .groups import OptimizerConfigError
from .lowrank import LowRankAdamW
from .lowrank.plan import _Plan
from .lowrank.tensors import _is_dtensor, _is_fake, _local, _world

__all__ = ["ApolloAdamW", "apollo_mini", "next_seed"]


def _norm(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of the whole matrix whose local shard is ``x``, sharded like ``p``.

    A plain ``p``: ``vector_norm(x)``.  A DTensor ``p`` (FSDP2, TP): the squared local sums are all-reduced over
    every mesh dimension that shards ``p``, so each rank gets the norm of the full matrix (a shard-local norm
    would give every rank a different tensor-wise scale and norm-growth limit).
    """
    if not _is_dtensor(p) or not any(pl.is_shard() for pl in p.placements):
        return torch.linalg.vector_norm(x)
    sq = x.float().square().sum()
    for mesh_dim, pl in enumerate(p.placements):
        if pl.is_shard():
            torch.distributed.all_reduce(sq, group=p.device_mesh.get_group(mesh_dim))
    return sq.sqrt().to(x.dtype)


def _device_model(dev: torch.device) -> tuple:
    """What decides the numbers a seeded generator draws on ``dev``: its type, and for CUDA its model and SM count."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return ("cuda", props.name, props.multi_processor_count)
    return (dev.type,)


def next_seed(seed: int, adv: int = 0xF) -> int:
    """The seed of the next random projection (apollo-torch's rule, kept so runs match it)."""
    gen = torch.Generator().manual_seed(int(seed))
    return int(torch.randint(0, torch.iinfo(torch.int64).max, (adv,), generator=gen)[-1])


class ApolloAdamW(LowRankAdamW):
    """APOLLO: Adam moments of a *random* rank-``rank`` projection of each gradient only set a scale.

    Per step: ``R = G P`` with a Gaussian ``P`` regenerated from a stored seed on the parameter's device (nothing
    else stored for it: the seed is the generator's whole state, so a resume that loads ``proj_seed`` draws the same
    ``P``; a new seed every ``update_proj_gap`` steps); Adam on ``R`` gives ``N``; each channel (row for the
    ``right`` side, column for ``left``) of the raw gradient ``G`` is scaled by ``||N_c|| / ||R_c||``
    (``scale_type="channel"``) or the whole matrix by ``||N|| / ||R||`` (``"tensor"``); Fira's norm-growth
    limiter caps the update norm's growth at ``norm_growth_limit`` per step; the update is multiplied by
    ``sqrt(scale)`` (apollo-torch's convention).  Adam arithmetic is apollo-torch's; weight decay is
    applied before the update (torch's order) unless ``compat="apollo_torch"``.

    Args (beyond :class:`~hf_gradfix.optim.GaLoreAdamW`'s): ``scale_type`` (``channel`` | ``tensor``),
    ``norm_growth_limit`` (``1.01``; ``None`` disables the limiter).  ``proj_method`` is always random.
    :func:`apollo_mini` gives APOLLO-Mini (rank 1, tensor-wise, scale 128).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> opt = ApolloAdamW(model, lr=1e-3, rank=4, targets=["0"])
    >>> model(torch.randn(5, 32)).square().mean().backward(); opt.step()
    >>> sorted(opt.state[model[0].weight])   # one seed instead of a 32 x 4 projection matrix
    ['exp_avg', 'exp_avg_sq', 'proj_seed', 'side', 'step', 'update_norm']
    """

    _name = "ApolloAdamW"
    _extra_defaults = {"scale_type": "channel", "norm_growth_limit": 1.01}

    def __init__(self, params: Any, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *, scale: float = 1.0, **kwargs: Any) -> None:
        kwargs.setdefault("proj_method", "randomized")
        super().__init__(params, lr, betas, eps, weight_decay, scale=scale, **kwargs)
        for g in self.param_groups:
            if g["scale_type"] not in ("channel", "tensor"):
                raise OptimizerConfigError(f"{self._name}: scale_type={g['scale_type']!r} is not one of 'channel', 'tensor'")
            lim = g["norm_growth_limit"]
            if lim is not None and not lim >= 1.0:
                raise OptimizerConfigError(f"{self._name}: norm_growth_limit={lim!r} must be >= 1 (or None to disable)")

    def _setup_lowrank_grads(self, model) -> None:
        raise OptimizerConfigError(
            f"{self._name}: lowrank_grads=True is GaLore-only. APOLLO scales the raw full gradient G by factors "
            "from its projected moments, so its step needs G itself, not G's projection: accumulating rank-r "
            "projections cannot serve it. What would apply is the layer-wise form (one process, gradient "
            "accumulation 1, the update applied inside the backward hook), which gives up gradient accumulation, "
            "DDP and clipping, so it is not offered. Use GaLoreAdamW(lowrank_grads=True), or APOLLO with full gradients"
        )

    def _has_basis(self, state: dict) -> bool:
        return "proj_seed" in state

    def _projection(self, state: dict, side: int, shape: tuple[int, int], rank: int, device, dtype) -> torch.Tensor:
        """The (d, rank) projection for the current seed, in apollo-torch's memory layout, drawn on ``device``
        (on the host instead where the ranks' devices would draw different numbers: :meth:`_draw_device`)."""
        seed = int(state["proj_seed"])
        m, n = shape
        at = self._draw_device(device)
        if side == proj.LEFT:
            p = proj.gaussian_projection(m, rank, seed, dtype=dtype, device=at)
        else:
            p = proj.gaussian_projection(n, rank, seed, dtype=dtype, device=at, transposed=True)
        return p.to(device)

    def _draw_device(self, device) -> torch.device:
        """Where the projection is drawn: ``device``, unless several processes run on accelerators that may draw
        different numbers from one seed (torch's CUDA Philox kernels size their grid by the SM count: another GPU
        model or MIG slice gives another matrix, and the replicas would diverge); then the host, as before issue 53
        (slow on a GPU), with one warning. Decided once per device type, from every rank's device model."""
        dev = torch.device(device)
        if dev.type in ("cpu", "meta"):
            return dev
        verdict = getattr(self, "_draw_on_device", {})
        self._draw_on_device = verdict
        if dev.type not in verdict:
            ok = True
            if _world() > 1:
                mine = _device_model(dev)
                every: list = [None] * _world()
                torch.distributed.all_gather_object(every, mine)
                ok = all(x == mine for x in every)
                if not ok:
                    self._warn_once("apollo_draw", (
                        f"{self._name}: the ranks run on different {dev.type} models ({sorted(set(map(str, every)))}), "
                        "which draw different random projections from one seed; APOLLO draws them on the CPU and "
                        "copies them over (the same matrix everywhere, but a slower step). Use one device model"))
            verdict[dev.type] = ok
        return dev if verdict[dev.type] else torch.device("cpu")

    def _step_projected(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:
        state = self.state[p]
        rank = group["rank"]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["side"] = torch.tensor(plan.side, dtype=torch.int8)
        side = int(state["side"])
        if self._refresh_due(state, group, plan):
            seed = self._seed + plan.index if "proj_seed" not in state else next_seed(int(state["proj_seed"]))
            state["proj_seed"] = torch.tensor(seed, dtype=torch.int64)
            if "exp_avg" not in state:
                dtype = p.dtype if group["compat"] == "apollo_torch" else torch.float32
                self._init_moments(p, state, side, rank, dtype)
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        g_raw = _local(p.grad)
        g = g_raw.to(m.dtype)
        device = torch.device("cpu") if _is_fake(g) else g.device  # a fake trace draws on the host, as before
        basis = self._projection(state, side, tuple(p.shape), rank, device, g.dtype).to(g.device)
        r = proj.project(g, basis, side)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        m.mul_(beta1).add_(r, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(r, r, value=1.0 - beta2)
        n_dir = m / v.sqrt().add_(group["eps"])
        step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        if group["scale_type"] == "channel":
            dim = 0 if side == proj.LEFT else 1
            factor = torch.linalg.vector_norm(n_dir, dim=dim, keepdim=True) / (torch.linalg.vector_norm(r, dim=dim, keepdim=True) + 1e-8)
        else:
            factor = _norm(n_dir, p) / (_norm(r, p) + 1e-8)  # whole-matrix norms, also when p is sharded
        update = g * factor
        limit = group["norm_growth_limit"]
        if limit is not None:
            norm = _norm(update, p)  # of the full update: every shard applies the same limit
            if "update_norm" in state:
                limiter = torch.clamp(norm / (state["update_norm"] + 1e-8), min=limit) / limit
                update.div_(limiter)  # in place: same numbers, one full-size temporary fewer
                state["update_norm"] = norm / limiter
            else:
                state["update_norm"] = norm
        update.mul_(math.sqrt(group["scale"]))
        group_torch = group["compat"] == "torch"
        self._apply(_local(p), update, step_size, {**group, "compat": "torch" if group_torch else "apollo_torch"})


def apollo_mini(params: nn.Module | Any, lr: float = 1e-3, **kwargs: Any) -> ApolloAdamW:
    """APOLLO-Mini: rank 1, one tensor-wise scale, ``scale=128`` (the paper's setting; SGD-like memory).

    >>> import torch
    >>> opt = apollo_mini(torch.nn.Linear(16, 16), lr=1e-3)
    >>> opt.param_groups[0]["rank"], opt.param_groups[0]["scale_type"], opt.param_groups[0]["scale"]
    (1, 'tensor', 128.0)
    """
    if kwargs.get("rank", 1) != 1:  # the words of the YAML's optimizer.rank check
        raise OptimizerConfigError(f"apollo_mini: rank={kwargs['rank']!r}: invalid value; apollo_mini is rank 1 by "
                                   "definition: remove rank, or use ApolloAdamW(rank=...) for APOLLO at this rank")
    kwargs.setdefault("rank", 1)
    kwargs.setdefault("scale_type", "tensor")
    kwargs.setdefault("scale", 128.0)
    return ApolloAdamW(params, lr=lr, **kwargs)
