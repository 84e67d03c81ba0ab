"""``benchmarks/gpu_check_1b.py`` (the GPU check at real sizes, issue 53 item 4) on CPU: its ``--quick`` form runs
every section, every goal and every profile (item 5) on tiny sizes, and writes the results file; without CUDA the
default (``--device cuda``) prints one skip line and writes nothing."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
import torch

import harness as H

sys.path.insert(0, str(H.REPO_ROOT / "benchmarks"))
G1 = importlib.import_module("gpu_check_1b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the skip path does not apply")
def test_without_cuda_it_prints_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "r.md"
    assert G1.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu_check_1b: skipped: no CUDA device"), printed
    assert not out.exists()


def test_quick_runs_every_section_goal_and_profile_on_cpu(tmp_path):
    out = tmp_path / "gpu-check-1b.md"
    assert G1.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0, out.read_text()[:3000]
    text = out.read_text()
    data = json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))
    assert set(data["sections"]) == set(G1.SECTIONS)
    for name, sec in data["sections"].items():
        assert sec["status"] in ("measured", "passed"), (name, sec)
    assert {g for g in data["goals"]} == set(G1.GOALS)
    for goal in ("throughput", "overhead", "lean", "optim"):
        assert f"### {goal}" in text and "Self CPU" in text  # the profiler's key_averages table, per goal
    tp = data["sections"]["throughput"]["rows"][0]
    # every arm trained on the same documents: the ratios follow from the tokens/s, the limit from the waste
    assert abs(tp["limit"] - 1 / (1 - tp["padding_waste"])) < 1e-2
    for arm in ("padded", "packed"):
        r = tp["arms"][arm]
        assert abs(r["vs_padded"] - r["real_tokens_per_s"] / tp["arms"]["padded"]["real_tokens_per_s"]) < 1e-2
    syncs = data["sections"]["syncs"]["rows"][0]
    assert syncs["structural_extra_per_window"] <= 1, syncs  # docs/testing.md, "Host syncs per path"
    assert data["sections"]["hybrid"]["status"] == "passed"


def test_useful_flops_counts_the_matmuls_and_causal_attention():
    """6 N per token (N: the matmul parameters, the tied head counted once) + 6 L d l^2 per document, by hand."""
    cfg = G1.model_config(True)
    d, L, v, ff = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * d // cfg.num_attention_heads
    n = L * (d * d * 2 + d * kv * 2 + d * ff * 3) + v * d
    assert G1.useful_flops(cfg, [10, 3]) == 6 * n * 13 + 6 * L * d * (100 + 9)
