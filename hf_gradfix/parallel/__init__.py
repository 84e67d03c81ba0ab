"""ND-parallel meshes: the degrees (:class:`ParallelDims`), validated against the world size and the model,
and the sub-meshes named by their job (``dp`` data loading, ``dp_cp`` loss all-reduce, ``dp_shard_cp`` sharding).

>>> from hf_gradfix.parallel import ParallelDims
>>> ParallelDims(world_size=4, dp_shard=2, tp=2).describe()
'4 process(es): dp_shard=2 x tp=2 (data-parallel 2, token groups 2, shard groups 2)'
"""

from .dims import JOB_DIMS, MESH_ORDER, ParallelDims, ParallelDimsError

__all__ = ["ParallelDims", "ParallelDimsError", "MESH_ORDER", "JOB_DIMS"]
