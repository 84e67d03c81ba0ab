"""``hf-gradfix plan`` as a new user types it (issue 39): defaults and refusals decided before any work, the mesh
on the command line, ``--suggest``'s answer in a form to paste, one unit per output, the GPU's size inside the
timeline's axes.  Ground truths: the same plan read from a YAML file by the config loader (an independent path),
the figures of the JSON output, the matplotlib axes the picture is drawn on."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

import hang_bound

from hf_gradfix.plan import command as plan_cli
from hf_gradfix.plan.command import plan_main

ROOT = Path(__file__).resolve().parents[2]


def _plan_json(argv, capsys) -> dict:
    assert plan_main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_timeline_with_the_default_dtype_traces_and_prints_one_unit(tmp_path):
    # the user types neither --simulate nor --dtype; big enough (a third of a GiB) that the table is in GiB
    pytest.importorskip("matplotlib")
    png = tmp_path / "step.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = hang_bound.run([sys.executable, "-m", "hf_gradfix", "plan", "--model", "tiny-llama", "--seq-len", "2048",
                          "--micro-batch", "8", "--timeline", str(png)], capture_output=True, text=True, env=env,
                         step="plan --timeline subprocess")
    assert run.returncode == 0, run.stderr
    assert "--dtype amp-bf16" in run.stderr and png.read_bytes()[:4] == b"\x89PNG"
    # one unit for every memory figure of the output (was: the table in GiB, the timeline's peak in MiB)
    units = set(re.findall(r"\d (GiB|MiB|KiB)\b", "\n".join(
        line for line in run.stdout.splitlines() if not line.startswith(("activations ", "parameters ")))))
    assert units == {"GiB"}, run.stdout
    peak = re.search(r"timeline written to .* \(traced peak ([\d.]+) GiB", run.stdout)
    traced = re.search(r"traced peak ([\d.]+) GiB during", run.stdout)
    assert peak and traced and peak.group(1) == traced.group(1)


def test_a_dtype_the_trace_cannot_run_is_refused_before_any_work(monkeypatch, capsys):
    def no_work(*a, **k):  # the model is the first work: it must not be loaded
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(plan_cli, "load_model_config", no_work)
    for dtype in ("bf16", "fp16"):
        assert plan_main(["--model", "tiny-llama", "--dtype", dtype, "--simulate"]) == 2
        err = capsys.readouterr().err
        assert f"--dtype {dtype} with --simulate" in err and "--dtype amp-bf16" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--timeline", "--plot"])
def test_missing_matplotlib_is_found_before_any_work(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, find_spec -> None

    def no_work(*a, **k):
        raise AssertionError("the model was loaded before matplotlib was checked")

    monkeypatch.setattr(plan_cli, "load_model_config", no_work)
    started = time.process_time()  # CPU seconds of this process (a busy machine does not stretch them)
    assert plan_main(["--model", "tiny-llama", flag, str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{flag} " in err and "pip install matplotlib" in err and time.process_time() - started < 5


def test_mesh_flags_plan_what_the_same_yaml_plans(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nhf_gradfix:\n  parallel:\n"
                    "    dp_replicate: 2\n    dp_shard: 2\n    tp: 2\n")
    common = ["--model", "tiny-llama", "--seq-len", "128", "--micro-batch", "2"]
    from_file = _plan_json([*common, "--config", str(yaml)], capsys)["plan"]
    flags = _plan_json([*common, "--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"], capsys)["plan"]
    with_gpus = _plan_json([*common, "--num-gpus", "8", "--dp-replicate", "2", "--tp", "2"], capsys)["plan"]
    assert from_file["mesh"] == flags["mesh"] == with_gpus["mesh"]
    assert (from_file["mesh"]["world_size"], from_file["mesh"]["tp"], from_file["mesh"]["dp_shard"]) == (8, 2, 2)
    assert from_file["components"] == flags["components"] == with_gpus["components"]
    # control: without the flags the mesh is another one (the flags are not ignored)
    assert _plan_json([*common, "--num-gpus", "8"], capsys)["plan"]["mesh"] != flags["mesh"]


def test_mesh_flags_with_a_config_fill_unset_keys_and_refuse_contradictions(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nhf_gradfix:\n  parallel:\n    tp: 2\n")
    plan = _plan_json(["--model", "tiny-llama", "--config", str(yaml), "--dp-replicate", "2", "--tp", "2"], capsys)
    assert {k: plan["plan"]["mesh"][k] for k in ("dp_replicate", "dp_shard", "tp")} == {"dp_replicate": 2, "dp_shard": 1,
                                                                                        "tp": 2}
    assert plan_main(["--model", "tiny-llama", "--config", str(yaml), "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4" in err and "parallel tp=2" in err and "keep one of them" in err
    # a mesh from accelerate's parallelism_config (every degree given): the same rule, nothing silently replaced
    shipped = str(ROOT / "configs" / "accelerate" / "fsdp2_tp_cp.yaml")
    assert plan_main(["--model", "tiny-llama", "--config", shipped, "--tp", "4"]) == 2
    assert "parallelism_config tp=2" in capsys.readouterr().err
    same = _plan_json(["--model", "tiny-llama", "--config", shipped, "--tp", "2"], capsys)["plan"]["mesh"]
    assert (same["dp_shard"], same["cp"], same["tp"]) == (2, 2, 2)


def test_suggest_prints_a_yaml_and_a_command_that_plan_its_first_row(tmp_path, capsys):
    argv = ["--model", "tiny-llama", "--num-gpus", "4", "--seq-len", "256", "--gpu-memory", "1GiB", "--suggest"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    first = _plan_json(argv, capsys)["suggest"][0]
    block = out.split("paste into your accelerate config (run.yaml):\n", 1)[1].split("\nwith the Trainer's", 1)[0]
    yaml = tmp_path / "run.yaml"
    yaml.write_text("\n".join(line[2:] for line in block.splitlines()) + "\n")
    # the pasted section, read by the config loader, plans the row (its mesh, its peak)
    mb = re.search(r"per_device_train_batch_size=(\d+)", out).group(1)
    recompute = "full" if "gradient_checkpointing=True" in out else "none"
    assert (int(mb), recompute) == (first["micro_batch"], first["recompute"])
    from_yaml = _plan_json(["--model", "tiny-llama", "--config", str(yaml), "--seq-len", "256", "--micro-batch", mb,
                            "--recompute", recompute, "--gpu-memory", "1GiB"], capsys)["plan"]
    row_mesh = {k: first[k] for k in ("dp_replicate", "dp_shard", "tp", "cp")}
    assert {k: from_yaml["mesh"][k] for k in row_mesh} == row_mesh and from_yaml["peak"] == first["peak_bytes"]
    # the printed command plans the same
    command = shlex.split(out.split("or plan it on its own:\n", 1)[1].strip().splitlines()[0])
    assert command[:2] == ["hf-gradfix", "plan"]
    assert _plan_json(command[2:], capsys)["plan"]["peak"] == first["peak_bytes"]


def test_suggest_without_a_gpu_count_or_size_says_which_flag_to_add(capsys):
    assert plan_main(["--model", "tiny-llama", "--gpu", "h100", "--suggest"]) == 2
    assert "--num-gpus N" in capsys.readouterr().err
    assert plan_main(["--model", "tiny-llama", "--num-gpus", "8", "--suggest"]) == 2
    assert "--gpu NAME" in capsys.readouterr().err


def test_the_gpu_line_is_inside_the_timeline_axes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from hf_gradfix.diagnostics import memory_timeline as mt
    from hf_gradfix.plan import Settings, load_model_config
    from hf_gradfix.plan.simulate import simulate
    from hf_gradfix.parallel import ParallelDims

    sim = simulate(load_model_config("tiny-llama"), ParallelDims(1), Settings(seq_len=32, micro_batch=1, dtype="fp32"))
    tl = sim["timeline"]
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    gpu = 3 * tl.peak  # in scale: drawn as a line below the axes' top (was: above the y range, off the chart)
    mt.plot_memory_timeline(tl, str(tmp_path / "a.png"), gpu_memory=gpu)
    ax = figures[-1].axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("GPU ")]
    assert lines and lines[0].get_ydata()[0] < ax.get_ylim()[1]
    # far above (80 GiB for a few MiB): written inside the axes instead of a line nobody sees
    mt.plot_memory_timeline(tl, str(tmp_path / "b.png"), gpu_memory=80 * 1024**3)
    ax = figures[-1].axes[0]
    notes = [t for t in ax.texts if t.get_text().startswith("GPU 80 GiB: above this scale")]
    assert notes and not [ln for ln in ax.get_lines() if ln.get_label().startswith("GPU ")]
    x, y = notes[0].get_position()
    assert 0 <= x <= 1 and 0 <= y <= 1  # axes coordinates: inside


def test_suggest_offers_no_pipeline_layout_the_run_refuses():
    # pp x cp and pp x tp x dp_shard were suggested (the docs' own example's first row), and config check refused them
    from hf_gradfix.parallel.pipeline import PipelineError, check_combination
    from hf_gradfix.plan import Settings, load_model_config

    rows = plan_cli.suggest(load_model_config("tiny-llama"), 4, 1024**3, Settings(seq_len=512, grad_accum=4),
                            limit=10_000)
    assert any(r["pp"] > 1 for r in rows)  # pipeline layouts are still offered
    for r in rows:
        try:
            check_combination(pp=r["pp"], tp=r["tp"], cp=r["cp"], dp_shard=r["dp_shard"])
        except PipelineError as err:
            pytest.fail(f"suggested {r}: {err}")
