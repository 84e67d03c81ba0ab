"""Expert parallelism as transformers 5.24 builds it (``DistributedConfig(ep_size=..., ep_implementation=...)``),
checked for what makes the token-mean loss exact.

How transformers lays it out (``transformers/distributed``): a dense mesh ``(pp, dp_replicate, fsdp, tp)`` and an
expert mesh ``(pp, dp_replicate, efsdp, ep)`` over the same ranks, ``efsdp = fsdp * tp / ep``. Each
``ep_dispatch_experts`` module (``mlp.experts``) keeps ``num_experts / ep`` whole experts per rank (``grouped_gemm``:
``Shard(0)`` on ``ep``), reached by two all-to-alls (``AllToAllEP``); dense modules are FSDP2-sharded over ``fsdp``,
expert modules over ``efsdp`` (HSDP with ``dp_replicate``).

Why the gradient is the window's objective (measured on 2 and 4 gloo processes against a float64 one-process reference,
tests/parallel/test_ep.py and the 4-process launch of tests/parallel/test_nd_parallel.py): a token of data rank r reaches its expert
through the all-to-all, so rank r's loss term back-propagates into the expert owner's gradient. After the window the
expert gradient on its owner is the sum over every data rank of d(loss_r)/dW (each token once), and the efsdp reduction
adds the other copies; transformers then divides by ``dp_size = dp_replicate * fsdp`` (``set_gradient_divide_factor`` on
every expert module), the same mean over data ranks FSDP2 takes for the dense parameters. With hf_gradfix's per-rank
loss ``sum_r * dp / N`` (N: the window's target count over all data ranks) both are ``d(sum / N)``. Stock transformers
is exact for the token loss too (``average_tokens_across_devices``); its router aux term is ``GA x dp`` times too large
(#48690), which hf_gradfix's ``loss.aux_loss`` conventions fix as they do without ep.

What is checked here, on the model, before training (:func:`check_model`): the divide factor of every expert module
(a transformers version that divides by ``efsdp`` instead, or not at all, would leave the expert gradients ``ep``
times too large or too small), the implementation (``all_to_all`` / ``auto``: the ones that move tokens in
training), and ``pp == 1``. Under tp the ranks of a tp group share one batch: transformers' ``AllToAllEP`` splits its
tokens over them before the dispatch (each token routed once) and the divide factor is still ``dp_size`` (measured
exact at tp 2 x dp_shard 2 x ep 2, tests/parallel/test_nd_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import HfGradfixError

__all__ = ["EPError", "EPLayout", "check_combination", "check_model", "expert_modules", "layout_of"]

#: ``ep_implementation`` values that run in training (``auto`` is ``all_to_all`` whenever gradients flow)
TRAINING_IMPLEMENTATIONS = ("all_to_all", "auto")


class EPError(HfGradfixError, RuntimeError):
    """An expert-parallel setup hf_gradfix cannot train exactly; the message says why and what to do."""


@dataclass
class EPLayout:
    """The expert-parallel degrees of a model sharded by transformers (``model.config.distributed_config``)."""

    ep: int
    efsdp: int
    fsdp: int
    dp_replicate: int
    tp: int
    pp: int
    implementation: str
    experts: list[str] = field(default_factory=list)  # the ep_dispatch_experts modules

    @property
    def dp(self) -> int:
        """Data-parallel ranks (each a distinct batch): the expert gradients are divided by this."""
        return self.dp_replicate * self.fsdp

    @property
    def line(self) -> str:
        return (f"expert parallel ep={self.ep} (efsdp={self.efsdp}, {self.implementation}) over {self.dp} data "
                f"rank(s): {len(self.experts)} expert module(s), expert gradients summed over every data rank's "
                f"tokens and divided by {self.dp}, as the dense ones")


def check_combination(*, ep: int, pp: int = 1, cp: int = 1, tp: int = 1, packing: bool = False, optimizer: str = "none",
                      fsdp_plugin: bool = False, optimizer_key: str = "optimizer.name") -> None:
    """Refuse, in one line naming both keys, what ``parallel.ep`` does not train exactly (yet).

    >>> check_combination(ep=2, tp=1)
    >>> check_combination(ep=2, pp=2)
    Traceback (most recent call last):
    ...
    hf_gradfix.parallel.ep.EPError: parallel.ep=2 with parallel.pp=2: transformers refuses expert token dispatch across pipeline stages; use pp: 1 with ep, or ep: 1
    """
    if ep <= 1:
        return
    if pp > 1:
        raise EPError(f"parallel.ep={ep} with parallel.pp={pp}: transformers refuses expert token dispatch across pipeline "
                      "stages; use pp: 1 with ep, or ep: 1")
    if cp > 1:
        raise EPError(f"parallel.ep={ep} with parallel.cp={cp}: the routing of a sequence split over cp ranks is not "
                      "measured exact with expert dispatch yet; use cp: 1 with ep, or ep: 1")
    if packing:
        raise EPError(f"parallel.ep={ep} with packing.enabled=true: packed rows under expert dispatch are not measured "
                      "exact yet; set packing.enabled: false, or ep: 1")
    if optimizer != "none":
        raise EPError(f"parallel.ep={ep} with {optimizer_key}={optimizer!r}: the low-rank optimizers project each 2-D "
                      "weight, the expert weights are 3-D DTensor shards; use a full-rank optimizer (e.g. AdamW) with ep, "
                      "or ep: 1")
    if fsdp_plugin:
        raise EPError(f"parallel.ep={ep} under accelerate's FSDP plugin (distributed_type FSDP / fsdp_config): "
                      "transformers shards the experts itself (ep) and the rest with FSDP2; launch with distributed_type "
                      "MULTI_GPU (or MULTI_CPU) and set dp_shard in the hf_gradfix parallel section")


def layout_of(model: torch.nn.Module) -> EPLayout | None:
    """The expert-parallel layout of a model sharded with ``DistributedConfig(ep_size > 1)``, else None."""
    dc = getattr(getattr(model, "config", None), "distributed_config", None)
    if dc is None or int(getattr(dc, "ep_size", 1) or 1) <= 1:
        return None
    return EPLayout(
        ep=int(dc.ep_size), efsdp=int(dc.efsdp_size), fsdp=int(dc.fsdp_size or 1),
        dp_replicate=int(dc.dp_replicate_size or 1), tp=int(dc.tp_size or 1), pp=int(dc.pp_size or 1),
        implementation=str(getattr(dc, "ep_implementation", "auto")), experts=[n for n, _ in expert_modules(model)],
    )


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules transformers sharded by expert (``grouped_gemm`` parameters with ``Shard(0)`` on an ``ep`` mesh)."""
    from torch.distributed.tensor import DTensor

    found = []
    for name, module in model.named_modules():
        if not getattr(module, "_is_expert_parallel", False):
            continue
        params = [p for p in module.parameters(recurse=False) if isinstance(p, DTensor)]
        if params and all("ep" in (p.device_mesh.mesh_dim_names or ()) for p in params):
            found.append((name, module))
    return found


def _divide_factors(module: torch.nn.Module) -> list[float | None]:
    """The gradient divide factor of each FSDP2 parameter group of ``module`` (None: FSDP2's default, the group size)."""
    state_of = getattr(module, "_get_fsdp_state", None)
    if state_of is None:
        return []
    return [getattr(g, "gradient_divide_factor", None) for g in state_of()._fsdp_param_groups]


def check_model(model: torch.nn.Module) -> EPLayout:
    """Raise :class:`EPError` unless ``model``'s expert parallelism trains the declared objective exactly (see the
    module docstring); return its layout."""
    layout = layout_of(model)
    if layout is None:
        raise EPError("hf_gradfix parallel: the model has no expert parallelism (DistributedConfig ep_size <= 1)")
    what = f"hf_gradfix parallel: expert parallelism ep_size={layout.ep}"
    if layout.pp > 1:
        raise EPError(f"{what} with pp_size={layout.pp}: transformers refuses token dispatch with pipeline stages.")
    if layout.implementation not in TRAINING_IMPLEMENTATIONS:
        raise EPError(f"{what}: ep_implementation={layout.implementation!r} does not train on ranks holding "
                      "different batches. Fix: ep_implementation='all_to_all'.")
    if not layout.experts:
        raise EPError(f"{what}: no module of {type(model).__name__} was sharded by expert (ep_plan "
                      "'ep_dispatch_experts' + 'grouped_gemm'); the experts would train on this rank's tokens alone.")
    if layout.dp > 1:
        for name, module in expert_modules(model):
            factors = _divide_factors(module)
            if not factors or any(f is None or float(f) != float(layout.dp) for f in factors):
                raise EPError(
                    f"{what}: the expert module {name!r} divides its gradient by {factors or 'nothing (not FSDP2)'}, "
                    f"not by the {layout.dp} data-parallel ranks whose tokens it received; its gradient would not be "
                    "the mean the dense parameters get. Fix: shard with the tested transformers, whose "
                    "apply_fully_sharded_data_parallelism sets set_gradient_divide_factor(dp_size)."
                )
    return layout
