"""GaLoreAdamW8bit: GaLore with bitsandbytes' blockwise 8-bit Adam moments (the paper's LLaMA-7B-on-24-GB setting).

The low-rank moments of each projected matrix, and the AdamW moments of every other parameter with at least
``min_8bit_size`` elements, are bitsandbytes' blockwise-quantized 8-bit state (block 256, one fp32 absmax per block,
the dynamic quantization maps shared by all tensors), updated by bitsandbytes' own kernel
(``bitsandbytes.functional.optimizer_update_8bit_blockwise``; it has CPU and CUDA implementations, so the same code
runs in CI and on the GPU).  Smaller tensors keep fp32 moments (``optimizer_update_32bit``), as bitsandbytes and
galore-torch's ``GaLoreAdamW8bit`` do.  The projected Adam step runs on a zero buffer of R's shape, exactly as
galore-torch does it, so ``compat="galore_torch"`` reproduces galore-torch's 8-bit optimizer.

Why bitsandbytes and not torchao's low-bit optimizers: galore-torch's 8-bit optimizer is built on it (parity is
testable), its blockwise kernels run on CPU (bitsandbytes >= 0.45) and CUDA, and its state is plain tensors
(``torch.load(weights_only=True)`` resumes).  bitsandbytes is imported when the optimizer is built (extra
``hf_gradfix[8bit]``).

State per projected matrix: ``step``, ``side``, ``proj`` (the basis, in the parameter dtype as galore-torch keeps it),
``exp_avg`` / ``exp_avg_sq`` (uint8, R's shape) and ``absmax1`` / ``absmax2`` (fp32, one per 256 elements); per other
parameter the same without ``side`` / ``proj``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import projection as proj
from .galore import GaLoreAdamW
from .groups import OptimizerConfigError
from .lowrank.plan import _Plan
from .lowrank.tensors import _local

__all__ = ["GaLoreAdamW8bit", "BLOCKSIZE"]

BLOCKSIZE = 256  # bitsandbytes' blockwise optimizer block


def _bnb():
    try:
        import bitsandbytes.functional as F
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise OptimizerConfigError(
            "GaLoreAdamW8bit needs bitsandbytes (pip install 'hf_gradfix[8bit]' or bitsandbytes>=0.45, which has "
            "CPU and CUDA kernels)"
        ) from err
    return F


_QMAPS: dict = {}


def _qmaps(device) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' dynamic maps (signed for the first moment, unsigned for the second), one copy per device."""
    key = str(device)
    if key not in _QMAPS:
        F = _bnb()
        _QMAPS[key] = (F.create_dynamic_map(signed=True).to(device), F.create_dynamic_map(signed=False).to(device))
    return _QMAPS[key]


class GaLoreAdamW8bit(GaLoreAdamW):
    """:class:`GaLoreAdamW` with blockwise 8-bit moments (bitsandbytes), also for the unprojected parameters.

    Same arguments as :class:`GaLoreAdamW` plus ``min_8bit_size`` (tensors with fewer elements keep fp32 moments;
    4096 like bitsandbytes and galore-torch).  The Adam arithmetic inside is bitsandbytes'; weight decay is
    decoupled, applied before the update (``compat="torch"``) or after it (``compat="galore_torch"``).
    Works with ``lowrank_grads=True`` (then no full gradient of a projected matrix outlives its backward).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4))
    >>> opt = GaLoreAdamW8bit(model, lr=1e-3, rank=32, targets=["0"], proj_method="svd")
    >>> model(torch.randn(5, 128)).square().mean().backward(); opt.step()
    >>> opt.state[model[0].weight]["exp_avg"].dtype, tuple(opt.state[model[0].weight]["exp_avg"].shape)
    (torch.uint8, (128, 32))
    """

    _name = "GaLoreAdamW8bit"
    _keeps_state_dtype = True  # uint8 moments must not be cast to the parameter dtype on load
    _extra_defaults = {"min_8bit_size": 4096}

    def __init__(self, params: Any, lr: float = 1e-3, *args: Any, **kwargs: Any) -> None:
        _bnb()
        super().__init__(params, lr, *args, **kwargs)
        for g in self.param_groups:
            if not (isinstance(g["min_8bit_size"], int) and g["min_8bit_size"] >= 0):
                raise OptimizerConfigError(f"{self._name}: min_8bit_size={g['min_8bit_size']!r} must be an integer >= 0")
            b1, b2 = g["betas"]
            if g["weight_decay"] and g["compat"] not in ("torch", "galore_torch"):  # pragma: no cover - validated above
                raise OptimizerConfigError(f"{self._name}: compat={g['compat']!r}")

    # ------------------------------------------------------------------ state

    @staticmethod
    def _init_8bit(state: dict, shape: tuple[int, ...], device, eight_bit: bool) -> None:
        if eight_bit:
            n = math.prod(shape)
            blocks = n // BLOCKSIZE + bool(n % BLOCKSIZE)
            state["exp_avg"] = torch.zeros(shape, dtype=torch.uint8, device=device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.uint8, device=device)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=device)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=device)
        else:
            state["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=device)

    def _init_moments(self, p: torch.Tensor, state: dict, side: int, rank: int, dtype: torch.dtype) -> None:
        if _local(p) is not p:
            raise OptimizerConfigError(f"{self._name}: FSDP2 / DTensor parameters are not supported (8-bit state is "
                                       "per tensor); use GaLoreAdamW under FSDP2")
        m, n = p.shape
        shape = (m, rank) if side == proj.RIGHT else (rank, n)
        group = self._plan_group_of(p)
        self._init_8bit(state, shape, p.device, math.prod(shape) >= group["min_8bit_size"])

    def _plan_group_of(self, p: torch.Tensor) -> dict:
        cache = getattr(self, "_plan_group", None)
        return cache[p] if cache is not None and p in cache else self._group_of(p)

    def _projected_grad(self, g: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """R in fp32 (``compat="torch"``) or in the gradient's dtype (galore-torch), whatever the moments' dtype."""
        g = g.float() if group["compat"] == "torch" else g
        return proj.project(g, state["proj"].to(g.dtype), int(state["side"]))

    def _new_basis(self, p, state, group, plan):
        basis = super()._new_basis(p, state, group, plan)
        return None if basis is None else basis.to(p.dtype)  # kept in the parameter dtype (galore-torch, the planner)

    # ------------------------------------------------------------------ bitsandbytes' Adam

    @staticmethod
    def _bnb_adam(g: torch.Tensor, buf: torch.Tensor, state: dict, group: dict, step: int, weight_decay: float) -> None:
        """bitsandbytes' Adam on ``buf`` (in place) with gradient ``g``: 8-bit blockwise or 32-bit state."""
        F = _bnb()
        beta1, beta2 = group["betas"]
        g = g.contiguous()
        if state["exp_avg"].dtype == torch.uint8:
            q1, q2 = _qmaps(buf.device)
            F.optimizer_update_8bit_blockwise(
                "adam", g, buf, state["exp_avg"], state["exp_avg_sq"], beta1, beta2, 0.0, 0.0, group["eps"], step,
                group["lr"], q1, q2, state["absmax1"], state["absmax2"], weight_decay, gnorm_scale=1.0, skip_zeros=False,
            )
        else:
            F.optimizer_update_32bit(
                "adam", g, buf, state["exp_avg"], beta1, group["eps"], step, group["lr"], state["exp_avg_sq"], beta2,
                0.0, 0.0, weight_decay, 1.0, None, max_unorm=0.0, skip_zeros=False,
            )

    def _step_plain(self, params: list[torch.Tensor], group: dict) -> None:
        """bitsandbytes' AdamW8bit (AdamW32bit below ``min_8bit_size``): decay inside its kernel."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                self._init_8bit(state, tuple(p.shape), p.device, p.numel() >= group["min_8bit_size"])
            state["step"] += 1
            if not p.is_contiguous():  # pragma: no cover - parameters are contiguous in practice
                raise OptimizerConfigError(f"{self._name}: non-contiguous parameter {tuple(p.shape)}")
            self._bnb_adam(p.grad, p.data, state, group, int(state["step"]), group["weight_decay"])

    def _step_projected(self, p: torch.Tensor, group: dict, plan: _Plan) -> None:
        state, r = self._window_projected_grad(p, group, plan)
        side = plan.side
        basis = state["proj"]
        state["step"] += 1
        # galore-torch's way: bitsandbytes' Adam moves a zero buffer of R's shape to -lr * Adam(R)
        buf = torch.zeros(r.shape, dtype=torch.float32 if group["compat"] == "torch" else p.dtype, device=r.device)
        self._bnb_adam(r.to(buf.dtype), buf, state, group, int(state["step"]), 0.0)
        update = proj.project_back(buf, basis.to(buf.dtype), side).mul_(group["scale"])
        lr, wd = group["lr"], group["weight_decay"]
        if group["compat"] == "torch":
            if wd != 0:
                p.data.mul_(1 - lr * wd)
            p.data.add_(update.to(p.dtype))
        else:
            p.data.add_(update.to(p.dtype))
            if wd > 0:
                p.data.add_(p.data, alpha=-lr * wd)
