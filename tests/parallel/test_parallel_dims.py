"""ParallelDims without processes: validation, rank arithmetic, sub-meshes by job, simulated token accounting.

The layout is checked against torch's own (``init_device_mesh`` lays ranks out as ``arange(world).view(shape)``)
and against accelerate's ``ParallelismConfig`` (dim order) and transformers' ``(pp, dp_replicate, fsdp, tp)`` mesh.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from hf_gradfix.parallel import JOB_DIMS, MESH_ORDER, ParallelDims, ParallelDimsError

LLAMA = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def test_rest_is_taken_by_the_minus_one_degree():
    d = ParallelDims(8, dp_replicate=2, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 2, 1, 2)
    d = ParallelDims(8, dp_replicate=-1, dp_shard=2, tp=2)
    assert (d.dp_replicate, d.dp_shard) == (2, 2)
    assert ParallelDims(4).dp_shard == 4  # defaults: all FSDP


@pytest.mark.parametrize(
    "world,kw,needle",
    [
        (4, dict(dp_shard=3, tp=2), "dp_replicate=1 x dp_shard=3 x cp=1 x tp=2 = 6 processes, but the world size is 4"),
        (4, dict(dp_shard=1, tp=2), "= 2 processes, but the world size is 4"),
        (4, dict(dp_shard=-1, tp=-1), "at most one degree can take the rest"),
        (4, dict(dp_replicate=-1, dp_shard=-1), "at most one degree can take the rest"),
        (6, dict(tp=4), "multiply to 4, which does not divide the world size 6"),
        (4, dict(tp=0), "parallel.tp=0: must be a positive integer"),
        (4, dict(dp_shard=-2), "parallel.dp_shard=-2"),
        (4, dict(tp=True), "parallel.tp=True"),
        (0, {}, "world_size=0"),
    ],
)
def test_invalid_degrees_raise_naming_the_key(world, kw, needle):
    with pytest.raises(ParallelDimsError) as err:
        ParallelDims(world, **kw)
    assert needle in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "tp,config,needle",
    [
        (4, LLAMA, "parallel.tp=4 does not divide the model's num_key_value_heads=2"),
        (3, LLAMA, "parallel.tp=3 does not divide the model's num_attention_heads=4"),
        (2, SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=127), "intermediate_size=127"),
        (1, SimpleNamespace(num_hidden_layers=0), "num_hidden_layers=0"),
    ],
)
def test_model_check_names_the_model_field(tp, config, needle):
    with pytest.raises(ParallelDimsError) as err:
        ParallelDims(tp, dp_shard=1, tp=tp).check_model(config)
    assert needle in str(err.value)


def test_model_check_accepts_divisible_heads_and_a_real_config():
    import transformers

    ParallelDims(4, dp_shard=2, tp=2).check_model(LLAMA)
    ParallelDims(2, tp=2, dp_shard=1).check_model(transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                                           intermediate_size=128, hidden_size=64))
    ParallelDims(8, dp_shard=8).check_model(LLAMA)  # tp 1: heads do not matter


# ----------------------------------------------------------------------------------------------------------------
# Rank arithmetic and groups by job
# ----------------------------------------------------------------------------------------------------------------

SHAPES = [
    dict(world=8, dp_replicate=2, dp_shard=2, tp=2),
    dict(world=8, dp_replicate=1, dp_shard=2, cp=2, tp=2),
    dict(world=4, dp_replicate=2, dp_shard=1, tp=2),
    dict(world=4, dp_replicate=2, dp_shard=2),
    dict(world=6, dp_replicate=1, dp_shard=3, tp=2),
]


@pytest.mark.parametrize("kw", SHAPES, ids=lambda kw: "x".join(f"{k}{v}" for k, v in kw.items() if k != "world"))
def test_coords_follow_torch_row_major_layout(kw):
    kw = dict(kw)
    d = ParallelDims(kw.pop("world"), **kw)
    sizes = [getattr(d, n) for n in MESH_ORDER]
    grid = torch.arange(d.world_size).view(*sizes)  # what init_device_mesh(shape) assigns
    for idx in itertools.product(*(range(s) for s in sizes)):
        rank = int(grid[idx])
        assert d.coords(rank) == dict(zip(MESH_ORDER, idx))
        assert d.rank_of(d.coords(rank)) == rank


@pytest.mark.parametrize("kw", SHAPES, ids=lambda kw: "x".join(f"{k}{v}" for k, v in kw.items() if k != "world"))
def test_groups_partition_the_world_and_match_torch_sub_meshes(kw):
    kw = dict(kw)
    d = ParallelDims(kw.pop("world"), **kw)
    sizes = [getattr(d, n) for n in MESH_ORDER]
    grid = torch.arange(d.world_size).view(*sizes)
    for job, dims in JOB_DIMS.items():
        groups = d.groups(job)
        assert sorted(r for g in groups for r in g) == list(range(d.world_size))
        size = 1
        for n in dims:
            size *= getattr(d, n)
        assert all(len(g) == size for g in groups), (job, groups)
        # torch's sub-mesh: move the job's dims last and flatten them
        keep = [i for i, n in enumerate(MESH_ORDER) if n not in dims]
        free = [MESH_ORDER.index(n) for n in dims]
        expected = grid.permute(*keep, *free).reshape(-1, size).tolist()
        assert sorted(map(sorted, groups)) == sorted(map(sorted, expected)), job
    assert d.group_of(0, "tp") == list(range(d.tp))  # tp innermost: consecutive ranks
    with pytest.raises(ParallelDimsError, match="unknown sub-mesh 'ep'"):
        d.group_of(0, "ep")


def test_groups_of_the_docstring_example():
    d = ParallelDims(8, dp_replicate=2, tp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (d.dp, d.dp_cp, d.dp_shard_cp, d.non_data_parallel) == (4, 4, 2, 2)


def test_data_rank_same_on_tp_and_cp_ranks_different_across_data_parallel():
    d = ParallelDims(16, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    ranks = list(range(16))
    assert sorted({d.data_rank(r) for r in ranks}) == list(range(d.dp))
    for group in d.groups("tp") + d.groups("cp"):
        assert len({d.data_rank(r) for r in group}) == 1
    for group in d.groups("dp"):
        assert sorted(d.data_rank(r) for r in group) == list(range(d.dp))
    # the data rank is the index in accelerate's dp sharding: process_index // (tp * cp) in accelerate's layout
    assert [d.data_rank(r) for r in ranks] == [r // (d.tp * d.cp) for r in ranks]


def test_layout_agrees_with_accelerate_and_transformers():
    from accelerate import ParallelismConfig

    for dp_replicate, dp_shard, tp in [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1)]:
        d = ParallelDims(dp_replicate * dp_shard * tp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
        if not (dp_shard == 1 and tp > 1):  # accelerate refuses TP with pure replication (transformers does not)
            names, shape = ParallelismConfig(dp_replicate_size=dp_replicate, dp_shard_size=dp_shard, tp_size=tp)._get_mesh()
            assert (tuple(names), tuple(shape)) == d.mesh_shape
        # transformers' DistributedConfig mesh (pp, dp_replicate, fsdp, tp): same row-major grid, fsdp = dp_shard
        grid = torch.arange(d.world_size).view(1, dp_replicate, dp_shard, tp)
        tf_tp_groups = grid.reshape(-1, tp).tolist()
        tf_dp_groups = grid.permute(0, 3, 1, 2).reshape(-1, dp_replicate * dp_shard).tolist()
        assert sorted(tf_tp_groups) == sorted(d.groups("tp"))
        assert sorted(tf_dp_groups) == sorted(d.groups("dp"))
        assert d.accelerate_keys()["parallelism_config_tp_size"] == tp


# ----------------------------------------------------------------------------------------------------------------
# Simulated token accounting
# ----------------------------------------------------------------------------------------------------------------


def test_token_count_sums_data_ranks_never_tp():
    d = ParallelDims(4, dp_shard=2, tp=2)
    assert d.global_token_count([7, 7, 12, 12]) == [19] * 4
    d = ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2)
    local = [3, 3, 5, 5, 11, 11, 13, 13]
    assert d.global_token_count(local) == [32] * 8
    # trainer_fix's formula: all-reduce over the world, divide by the ranks that share a batch
    assert sum(local) / d.non_data_parallel == 32


def test_token_count_with_cp_before_and_after_the_split():
    d = ParallelDims(8, dp_shard=2, cp=2, tp=2)  # coords: dp_shard (4 ranks each) > cp (2 each) > tp
    # counted on the full sequences, before CP splits them: cp and tp ranks all hold the same count
    before = [10, 10, 10, 10, 30, 30, 30, 30]
    assert d.global_token_count(before) == [40] * 8
    assert sum(before) / d.non_data_parallel == 40  # world sum / (tp * cp)
    # counted after the split: each cp rank holds its part of the same sequences (tp partners equal)
    after = [4, 4, 6, 6, 14, 14, 16, 16]
    assert d.global_token_count(after, counted_after_cp_split=True) == [40] * 8
    assert sum(after) / d.tp == 40  # after the split only tp duplicates
    # summing over data ranks only would miss the other cp half; over the world would count tp twice
    assert d.global_token_count(after) != [40] * 8
    with pytest.raises(ParallelDimsError, match="3 local counts for a world of 8"):
        d.global_token_count([1, 2, 3])


def test_mesh_shape_and_describe():
    assert ParallelDims(4, dp_shard=2, tp=2).mesh_shape == (("dp_shard", "tp"), (2, 2))
    assert ParallelDims(1).mesh_shape == (("dp_shard",), (1,))
    assert "dp_shard=2 x tp=2 (data-parallel 2" in ParallelDims(4, dp_shard=2, tp=2).describe()
    assert ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2).accelerate_keys() == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
    }


def test_docstring_examples():
    import doctest

    import hf_gradfix.parallel
    import hf_gradfix.parallel.dims

    for module in (hf_gradfix.parallel, hf_gradfix.parallel.dims):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
