"""What the fake-tensor traces share (the supervised step, :mod:`.simulate`, and the RL step, :mod:`.rl_simulate`):
the optimizer the Trainer would build, the tracker's categories and how many micro-batches are traced.  Its own
module so that ``simulate`` -> ``rl_simulate`` is the only edge between the two.

>>> TRACED_MICRO_BATCHES
4
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import PlanError

if TYPE_CHECKING:
    from .estimate import Settings

__all__ = ["TRACED_MICRO_BATCHES", "SIMULATED_DTYPES", "check_traced_dtype"]

#: micro-batches traced in the recorded step under gradient accumulation (``grad_accum`` when smaller): the first
#: runs without gradients, every later one with the accumulated gradients alive, all of them alike
TRACED_MICRO_BATCHES = 4

# tracker category -> plan component
_MAP = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "comm_buffers",
    "Buffer": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "comm_buffers",
    "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer_state", "OptState": "optimizer_state", "Other": "other",
    "All Gather": "comm_buffers", "Reduce Scatter": "comm_buffers",
}


def _make_optimizer(model, settings: Settings):
    import torch

    name = settings.optimizer
    if name == "adamw":
        # the Trainer's default optimizer on torch >= 2.8 ("adamw_torch_fused"): updates in place, no temporaries
        # (the foreach path would hold one moment-sized temporary at the step, the for-loop two of the largest weight)
        from torch.distributed.tensor import DTensor

        # one fused call may not mix DTensors (TP-sharded weights) and plain tensors (the rest): two groups
        params = list(model.parameters())
        groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                              [p for p in params if not isinstance(p, DTensor)]) if g]
        return torch.optim.AdamW([{"params": g} for g in groups], lr=1e-4, fused=True)
    if name in ("galore_adamw", "apollo_adamw", "apollo_mini"):
        from ..optim import ApolloAdamW, GaLoreAdamW, apollo_mini

        kw = dict(targets=settings.targets, exclude=list(settings.exclude), min_size=settings.min_size,
                  proj_side=settings.proj_side)
        if name == "galore_adamw":
            from ..optim import projection as proj
            from ..optim.lowrank.tensors import _full

            class _TracedGaLore(GaLoreAdamW):
                """GaLoreAdamW whose basis refresh skips the finiteness check (a data-dependent branch that fake
                tensors cannot take); the stored basis has the real one's shape and dtype."""

                def _new_basis(self, p, state, group, plan):
                    g32 = _full(p.grad).float()
                    basis = proj.top_basis(g32, group["rank"], plan.side, method=self._method(group, tuple(g32.shape)),
                                           oversample=group["oversample"], niter=group["niter"])
                    return proj.canonicalize_signs(basis)

            return _TracedGaLore(model, lr=1e-4, rank=settings.rank, **kw)
        if name == "apollo_adamw":
            return ApolloAdamW(model, lr=1e-4, rank=settings.rank, **kw)
        return apollo_mini(model, lr=1e-4, **kw)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-4)
    raise PlanError(f"--simulate supports adamw, galore_adamw, apollo_adamw, apollo_mini and sgd; not {name!r} "
                    "(8-bit optimizers need bitsandbytes' CUDA kernels, which fake tensors on CPU cannot run)")


#: the dtypes the fake-tensor trace runs (what torch runs); bf16 / fp16 are the closed form's Megatron-style split
SIMULATED_DTYPES = ("fp32", "bf16-pure", "amp-bf16")


def check_traced_dtype(dtype: str) -> None:
    """Refuse a dtype the trace cannot run, in one line naming the flag to use (the same from the library and
    from ``hf-gradfix plan``, which checks it before any work).

    >>> check_traced_dtype("bf16")
    Traceback (most recent call last):
    ...
    hf_gradfix.plan.common.PlanError: --dtype bf16 with --simulate / --timeline: the trace runs what torch runs, and bf16 is the closed form's Megatron-style split (bf16 weights + fp32 master); use --dtype amp-bf16 (the Trainer's bf16=True), bf16-pure or fp32, or drop --simulate / --timeline
    """
    if dtype not in SIMULATED_DTYPES:
        raise PlanError(f"--dtype {dtype} with --simulate / --timeline: the trace runs what torch runs, and {dtype} is "
                        "the closed form's Megatron-style split (bf16 weights + fp32 master); use --dtype amp-bf16 (the "
                        "Trainer's bf16=True), bf16-pure or fp32, or drop --simulate / --timeline")
