"""``hf-gradfix verify``: passes exact runs, flags every planted bug with the invariant it breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

import harness as H
from hf_gradfix.cli import main
from hf_gradfix.verify import verify


def test_exact_runs_pass():
    plain = verify(steps=1)
    packed = verify(steps=1, packing=True)
    for rep in (plain, packed):
        assert rep.exact and not rep.broken
        assert rep.steps[0].grad_rel_err < 1e-5 and rep.steps[0].loss_rel_err < 1e-5
    assert packed.packing


@pytest.mark.parametrize("bug, verdicts", [
    ("mean_of_means", {"mean_of_means", "mean_of_means_summed"}),  # summed on transformers 5.x, averaged on 4.57
    ("ga_scaled", {"ga_scaled"}),
    ("count_unshifted", {"count_unshifted"}),
    ("cross_attention", {"cross_attention"}),
])
def test_each_planted_bug_is_named(bug, verdicts):
    rep = verify(steps=1, inject=bug)
    assert not rep.exact
    assert rep.steps[0].verdict in verdicts, rep.steps[0].candidates
    assert rep.steps[0].grad_rel_err > 1e-3  # the bug is real, not noise
    # the named explanation reproduces the planted gradient to fp32 precision
    assert rep.steps[0].candidates[rep.steps[0].verdict] < 1e-5


def test_cli_json_exit_code_and_plot(tmp_path, capsys):
    assert main(["verify", "--steps", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exact"] is True and data["steps"][0]["verdict"] == "exact"
    assert main(["verify", "--steps", "1", "--inject", "ga_scaled"]) == 1
    assert "NOT EXACT: scaling by GA" in capsys.readouterr().out
    png = tmp_path / "curves.png"
    assert main(["verify", "--steps", "1", "--plot", str(png), "--plot-steps", "3"]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.distributed
@pytest.mark.parametrize("inject, code, expect", [(None, 0, "EXACT"), ("world_scaled", 1, "NOT EXACT: scaling by world size")])
def test_two_ranks_through_hf_gradfix_launch(tmp_path, inject, code, expect):
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1, "machine_rank": 0,
                                   "main_process_ip": "127.0.0.1", "main_process_port": H._free_port(), "use_cpu": True}))
    cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(cfg), "-m", "hf_gradfix", "verify", "--steps", "1"]
    cmd += ["--inject", inject] if inject else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (proc.returncode != 0) == bool(code), proc.stderr[-2000:]
    assert "2 rank(s)" in proc.stdout and expect in proc.stdout, proc.stdout + proc.stderr[-2000:]
