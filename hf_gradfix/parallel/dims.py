"""The degrees of an ND-parallel run and the sub-meshes named by their job (after torchtitan's ParallelDims).

Mesh order is torchtitan's ``pp, dp_replicate, dp_shard, cp, tp``: pipeline stages outermost (point-to-point
traffic between stages crosses the slowest links), then accelerate's own order (tp innermost, so a
tensor-parallel group is ``tp`` consecutive ranks). Without pp the mesh built here and the one accelerate's
``ParallelismConfig`` builds agree rank for rank.  Sub-meshes by job:

* ``dp`` = dp_replicate x dp_shard: data loading (ranks that get different samples);
* ``dp_cp`` = dp x cp: the loss's token-count all-reduce (ranks that hold different tokens once CP has
  split the sequences); tp ranks hold the same tokens and are never in it;
* ``dp_shard_cp`` = dp_shard x cp: FSDP2 sharding (with ``dp_replicate`` on top: HSDP);
* ``pp``: the pipeline stages of one model replica (ranks that hold different layers of the same batches).

Pure Python (no torch import) except :meth:`ParallelDims.build_mesh`.

>>> d = ParallelDims(world_size=8, dp_replicate=2, tp=2)   # dp_shard (default -1) takes the rest: 2
>>> (d.dp_replicate, d.dp_shard, d.cp, d.tp), d.dp, d.dp_cp
((2, 2, 1, 2), 4, 4)
>>> d.coords(5)                                              # rank 5: replica 1, shard 0, tp rank 1
{'pp': 0, 'dp_replicate': 1, 'dp_shard': 0, 'cp': 0, 'tp': 1}
>>> ParallelDims(world_size=4, pp=2, dp_shard=2).group_of(1, "pp")  # stage 0 of replica 1 and its stage 1
[1, 3]
>>> d.group_of(5, "tp"), d.group_of(5, "dp")
([4, 5], [1, 3, 5, 7])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import HfGradfixError

__all__ = ["ParallelDims", "ParallelDimsError", "MESH_ORDER", "JOB_DIMS"]

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
JOB_DIMS: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "cp": ("cp",),
    "tp": ("tp",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


#: config keys transformers' MoE families name their routed expert count by
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class ParallelDimsError(HfGradfixError, ValueError):
    """Degrees that do not fit the world size or the model; the message names the key, value and fix."""


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees: ``pp * dp_replicate * dp_shard * cp * tp == world_size``.

    One degree may be ``-1``: it takes the rest of the world (``dp_shard`` by default, as in torchtitan).
    ``pp_virtual_stages`` is the number of pipeline stages each pp rank holds (> 1 only for an interleaved
    schedule); the model's layers are split over ``pp * pp_virtual_stages`` stages.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_virtual_stages: int = 1
    ep: int = 1
    _sizes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ParallelDimsError(f"world_size={self.world_size!r}: must be a positive number of processes")
        for key, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
                raise ParallelDimsError(f"parallel.{key}={value!r}: must be a positive integer, or -1 for 'the rest'")
        if self.pp == -1:
            raise ParallelDimsError("parallel.pp=-1: the pipeline degree must be given (a positive integer, e.g. 2)")
        v = self.pp_virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ParallelDimsError(f"parallel.pp_virtual_stages={v!r}: must be a positive integer (stages per pp rank)")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ParallelDimsError(f"parallel.ep={self.ep!r}: must be a positive integer (ranks the experts are split over)")
        rest = [k for k, v in sizes.items() if v == -1]
        if len(rest) > 1:
            raise ParallelDimsError(f"parallel: {rest} are all -1; at most one degree can take the rest of the world")
        fixed = 1
        for k, v in sizes.items():
            if v != -1:
                fixed *= v
        if rest:
            if self.world_size % fixed:
                raise ParallelDimsError(
                    f"parallel.{rest[0]}=-1: the other degrees multiply to {fixed}, which does not divide the world size "
                    f"{self.world_size}; choose degrees whose product divides {self.world_size}"
                )
            sizes[rest[0]] = self.world_size // fixed
        total = 1
        for v in sizes.values():
            total *= v
        if total != self.world_size:
            shown = " x ".join(f"{k}={v}" for k, v in sizes.items())
            raise ParallelDimsError(
                f"parallel: {shown} = {total} processes, but the world size is {self.world_size}; "
                f"make the product equal num_processes, or set one degree to -1"
            )
        object.__setattr__(self, "pp", sizes["pp"])
        object.__setattr__(self, "dp_replicate", sizes["dp_replicate"])
        object.__setattr__(self, "dp_shard", sizes["dp_shard"])
        object.__setattr__(self, "cp", sizes["cp"])
        object.__setattr__(self, "tp", sizes["tp"])
        self._sizes.update(sizes)
        if self.ep > 1:  # transformers' DistributedConfig rules (ep borrows its ranks, it is not a mesh dim of its own)
            if self.ep % self.tp:
                raise ParallelDimsError(
                    f"parallel.ep={self.ep} is not a multiple of tp={self.tp}: expert parallelism spans whole "
                    f"tensor-parallel groups; use an ep that is a multiple of {self.tp}"
                )
            if (self.dp_shard * self.cp * self.tp) % self.ep:
                raise ParallelDimsError(
                    f"parallel.ep={self.ep} does not divide dp_shard x cp x tp = {self.dp_shard * self.cp * self.tp}: the "
                    "expert-parallel ranks are taken from the shard group (efsdp = dp_shard x cp x tp / ep); use an ep that "
                    f"divides {self.dp_shard * self.cp * self.tp}, or raise dp_shard"
                )

    # -------------------------------------------------------------- sizes by job
    @property
    def dp(self) -> int:
        """Ranks that load different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens (the loss's count all-reduce)."""
        return self.dp * self.cp

    @property
    def dp_shard_cp(self) -> int:
        """Ranks one FSDP2 shard group spans."""
        return self.dp_shard * self.cp

    @property
    def non_data_parallel(self) -> int:
        """Ranks that see the same batch (pp x tp x cp): the divisor of a count all-reduced over the world."""
        return self.pp * self.tp * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks one expert's FSDP2 shard group spans (transformers' ``efsdp_size``: dp_shard x cp x tp / ep)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def pp_stages(self) -> int:
        """Pipeline stages the model is split into (pp ranks x virtual stages per rank)."""
        return self.pp * self.pp_virtual_stages

    @property
    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, shape)`` of the dims larger than 1 in mesh order (what accelerate builds)."""
        dims = [(n, self._sizes[n]) for n in MESH_ORDER if self._sizes[n] > 1]
        if not dims:
            return ("dp_shard",), (1,)
        names, shape = zip(*dims)
        return tuple(names), tuple(shape)

    # -------------------------------------------------------------- rank arithmetic
    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each dim (row-major over MESH_ORDER, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ParallelDimsError(f"rank {rank} is outside the world of {self.world_size}")
        out: dict[str, int] = {}
        rem = rank
        for name in reversed(MESH_ORDER):
            size = self._sizes[name]
            out[name] = rem % size
            rem //= size
        return {n: out[n] for n in MESH_ORDER}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name in MESH_ORDER:
            rank = rank * self._sizes[name] + int(coords.get(name, 0))
        return rank

    def group_of(self, rank: int, job: str) -> list[int]:
        """All ranks that share ``rank``'s coordinates outside the dims of ``job`` (its process group)."""
        if job not in JOB_DIMS:
            raise ParallelDimsError(f"unknown sub-mesh {job!r}; known: {sorted(JOB_DIMS)}")
        me = self.coords(rank)
        free = JOB_DIMS[job]
        return [r for r in range(self.world_size) if all(self.coords(r)[n] == me[n] for n in MESH_ORDER if n not in free)]

    def groups(self, job: str) -> list[list[int]]:
        """Every process group of ``job`` (a partition of the world)."""
        seen: list[list[int]] = []
        for r in range(self.world_size):
            g = self.group_of(r, job)
            if g not in seen:
                seen.append(g)
        return seen

    def data_rank(self, rank: int) -> int:
        """Which data shard ``rank`` loads: its index in the ``dp`` sub-mesh (tp and cp ranks share it)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def pp_rank(self, rank: int) -> int:
        """Which pipeline rank ``rank`` is (its stages: ``pp_rank + i * pp`` for ``i < pp_virtual_stages``)."""
        return self.coords(rank)["pp"]

    # -------------------------------------------------------------- token accounting
    def global_token_count(self, local_counts: Sequence[float], *, counted_after_cp_split: bool = False) -> list[float]:
        """What each rank's all-reduced target count must be, from every rank's local count (a simulated mesh).

        Ranks along tp hold the same tokens and are never summed.  Along cp they hold the same sequences
        before context parallelism splits them (count once: ``counted_after_cp_split=False``) and different
        shards after it (sum them).

        >>> ParallelDims(world_size=4, dp_shard=2, tp=2).global_token_count([7, 7, 12, 12])
        [19, 19, 19, 19]
        """
        if len(local_counts) != self.world_size:
            raise ParallelDimsError(f"{len(local_counts)} local counts for a world of {self.world_size}")
        job = "dp_cp" if counted_after_cp_split else "dp"
        return [sum(local_counts[r] for r in self.group_of(rank, job)) for rank in range(self.world_size)]

    # -------------------------------------------------------------- model and launch checks
    def check_model(self, config: Any) -> None:
        """Refuse degrees the model cannot be split by (tp must divide the heads; cp needs sequences)."""
        if self.tp > 1:
            for key in ("num_attention_heads", "num_key_value_heads"):
                value = getattr(config, key, None)
                if value is not None and value % self.tp:
                    raise ParallelDimsError(
                        f"parallel.tp={self.tp} does not divide the model's {key}={value}; tensor parallelism splits "
                        f"attention heads across tp ranks: use a tp that divides {value}"
                    )
            inter = getattr(config, "intermediate_size", None)
            if inter is not None and inter % self.tp:
                raise ParallelDimsError(
                    f"parallel.tp={self.tp} does not divide the model's intermediate_size={inter}; use a divisor of it"
                )
        if self.ep > 1:
            experts = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
            if experts is None:
                raise ParallelDimsError(
                    f"parallel.ep={self.ep}: the model ({type(config).__name__}) has no routed experts "
                    f"(none of {', '.join(EXPERT_COUNT_KEYS)}); expert parallelism splits a mixture of experts: use ep: 1"
                )
            if experts % self.ep:
                raise ParallelDimsError(
                    f"parallel.ep={self.ep} does not divide the model's {experts} routed experts; every ep rank holds "
                    f"whole experts: use an ep that divides {experts}"
                )
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None and layers < 1:
            raise ParallelDimsError(f"the model has num_hidden_layers={layers}; nothing to shard")
        if self.pp_stages > 1 and layers is not None and layers < self.pp_stages:
            raise ParallelDimsError(
                f"parallel.pp={self.pp} x pp_virtual_stages={self.pp_virtual_stages} = {self.pp_stages} pipeline stages, "
                f"but the model has num_hidden_layers={layers}; every stage needs at least one layer: use "
                f"pp x pp_virtual_stages <= {layers}"
            )

    def accelerate_keys(self) -> dict[str, int]:
        """The ``parallelism_config:`` section accelerate's YAML needs for this mesh (prefixed keys)."""
        return {
            "parallelism_config_dp_replicate_size": self.dp_replicate,
            "parallelism_config_dp_shard_size": self.dp_shard,
            "parallelism_config_tp_size": self.tp,
            "parallelism_config_cp_size": self.cp,
        }

    def describe(self) -> str:
        names, shape = self.mesh_shape
        mesh = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
        pipe = ""
        if self.pp > 1:
            pipe = f", {self.pp_stages} pipeline stages" if self.pp_virtual_stages > 1 else ""
        if self.ep > 1:
            pipe += f", expert parallel ep={self.ep} x efsdp={self.efsdp}"
        return f"{self.world_size} process(es): {mesh} (data-parallel {self.dp}, token groups {self.dp_cp}, shard groups {self.dp_shard_cp}{pipe})"

    def build_mesh(self, device_type: str = "cpu"):
        """A torch DeviceMesh with the flattened job sub-meshes ``dp``, ``dp_cp`` and ``dp_shard_cp`` (needs an
        initialized process group).  Same layout as accelerate's ``ParallelismConfig.build_device_mesh``."""
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = self.mesh_shape
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for job in ("dp", "dp_cp", "dp_shard_cp"):
            dims = tuple(n for n in JOB_DIMS[job] if n in names)
            if len(dims) > 1:
                mesh[dims]._flatten(job)
        return mesh
