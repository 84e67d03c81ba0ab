"""``parallel.ep`` in the configuration: the shipped expert-parallel configs, ``config check``'s lines, and every
combination expert parallelism refuses, in one line naming both keys, the same from the library and the CLI.
No processes: the 2-process runs through the Trainer are tests/parallel/test_ep.py's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hf_gradfix.cli import main
from hf_gradfix.config.resolve import resolve_config
from hf_gradfix.config.schema import ConfigError
from hf_gradfix.parallel import ParallelDims
from hf_gradfix.parallel.dims import ParallelDimsError

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, nproc: int, section: dict, **acc) -> Path:
    path = tmp_path / "ep.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": nproc, "use_cpu": True, **acc,
                                    "hf_gradfix": section}))
    return path


@pytest.mark.parametrize("name, world, dp, ep, efsdp", [("cpu_ep.yaml", 2, 2, 2, 1), ("cpu_ep4.yaml", 4, 4, 2, 1),
                                                        ("ep.yaml", 8, 8, 4, 2)])
def test_shipped_ep_configs_resolve_and_say_what_runs(name, world, dp, ep, efsdp, capsys):
    path = ROOT / "configs" / name
    r = resolve_config(path, micro_batch=2, seq_len=64, grad_accum=2)
    assert (r.world_size, r.mesh.dp, r.mesh.ep, r.mesh.efsdp) == (world, dp, ep, efsdp)
    assert r.global_batch_tokens == 2 * 64 * 2 * dp  # ep borrows ranks: every one of them still loads its own data
    assert main(["config", "check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["ep"] == ep
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"expert parallel   ep={ep}" in out and f"efsdp={efsdp}" in out and f"averaged over the {dp} data ranks" in out


@pytest.mark.parametrize("nproc, section, needle", [
    (4, {"parallel": {"dp_shard": 2, "pp": 2, "ep": 2}}, "parallel.ep=2 with parallel.pp=2"),
    (4, {"parallel": {"dp_shard": 2, "cp": 2, "ep": 2}}, "parallel.ep=2 with parallel.cp=2"),
    (2, {"parallel": {"ep": 2}, "packing": {"enabled": True}}, "parallel.ep=2 with packing.enabled=true"),
    (2, {"parallel": {"ep": 2}, "optimizer": {"name": "galore_adamw"}}, "parallel.ep=2 with optimizer.name='galore_adamw'"),
    (2, {"parallel": {"ep": 3}}, "parallel.ep=3 does not divide dp_shard x cp x tp = 2"),
    (4, {"parallel": {"dp_replicate": 4, "dp_shard": 1, "ep": 2}}, "parallel.ep=2 does not divide dp_shard x cp x tp = 1"),
    (2, {"parallel": {"ep": 0}}, "parallel.ep: invalid value 0"),
])
def test_what_ep_does_not_combine_with_is_refused_in_one_line(tmp_path, capsys, nproc, section, needle):
    path = _write(tmp_path, nproc, section)
    with pytest.raises((ConfigError, ParallelDimsError)) as library:
        resolve_config(path)
    assert needle in str(library.value)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and str(library.value).splitlines()[0] in err


def test_ep_with_tensor_parallelism_resolves(tmp_path, capsys):
    """ep x tp composes (measured exact in tests/parallel/test_nd_parallel.py): tp 2 x dp_shard 2 x ep 2 on 4 processes."""
    path = _write(tmp_path, 4, {"parallel": {"dp_shard": 2, "tp": 2, "ep": 2}})
    r = resolve_config(path)
    assert (r.mesh.dp, r.mesh.tp, r.mesh.ep, r.mesh.efsdp) == (2, 2, 2, 2)
    assert main(["config", "check", str(path)]) == 0
    assert "expert parallel   ep=2" in capsys.readouterr().out


def test_ep_under_accelerates_fsdp_plugin_is_refused(tmp_path):
    path = _write(tmp_path, 2, {"parallel": {"ep": 2}}, distributed_type="FSDP", fsdp_config={"fsdp_version": 2})
    with pytest.raises(ConfigError, match="parallel.ep=2 under accelerate's FSDP plugin"):
        resolve_config(path)


def test_ep_is_checked_against_the_model_experts():
    dims = ParallelDims(4, dp_shard=4, ep=4)
    assert dims.efsdp == 1 and "ep=4 x efsdp=1" in dims.describe()
    dims.check_model(SimpleNamespace(num_experts=8, num_hidden_layers=2))
    dims.check_model(SimpleNamespace(n_routed_experts=4, num_hidden_layers=2))  # DeepSeek-V3's key
    with pytest.raises(ParallelDimsError, match="does not divide the model's 6 routed experts"):
        dims.check_model(SimpleNamespace(num_local_experts=6, num_hidden_layers=2))  # Mixtral's key
    with pytest.raises(ParallelDimsError, match="has no routed experts"):
        dims.check_model(SimpleNamespace(num_attention_heads=4, num_hidden_layers=2))
    with pytest.raises(ParallelDimsError, match="not a multiple of tp=2"):
        ParallelDims(4, dp_shard=1, dp_replicate=2, tp=2, ep=1 + 2)
