"""DeepSpeed through accelerate's YAML: shipped configs, ``config check`` (engine, stage, clipping, offload), the
launcher keeping DeepSpeed on under ``use_cpu: true``, and one real ``hf-gradfix launch`` of 2 CPU processes."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import harness as H
from multiproc import run_launch
from hf_gradfix.cli import main, resolve_config
from hf_gradfix.parallel.deepspeed import DeepSpeedConfigError, check_clipping, deepspeed_settings

CONFIGS = H.REPO_ROOT / "configs" / "accelerate"
SHIPPED = {"deepspeed_zero1.yaml": 1, "deepspeed_zero2.yaml": 2, "deepspeed_zero3.yaml": 3, "cpu_deepspeed.yaml": 2}


def _ds_yaml(tmp_path, name="ds.yaml", **deepspeed_config):
    data = yaml.safe_load((CONFIGS / "cpu_deepspeed.yaml").read_text())
    data["deepspeed_config"].update(deepspeed_config)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_deepspeed_configs_load_and_report_engine_stage_clipping(name, capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    path = CONFIGS / name
    cfg = load_config_from_file(str(path))  # accelerate's own strict loader
    assert str(cfg.distributed_type).endswith("DEEPSPEED") and cfg.deepspeed_config["zero_stage"] == SHIPPED[name]
    r = resolve_config(path)
    assert r.deepspeed.stage == SHIPPED[name] and r.deepspeed.clipping == "auto"
    assert r.world_size == (2 if name.startswith("cpu") else 8)
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"DEEPSPEED, {r.world_size} process(es)" in out
    assert f"deepspeed         ZeRO-{SHIPPED[name]}:" in out and "clipping follows TrainingArguments.max_grad_norm" in out
    assert ("DS_ACCELERATOR=cpu" in out) == name.startswith("cpu")


def test_config_check_reports_offload_and_a_deepspeed_json(tmp_path, capsys):
    path = _ds_yaml(tmp_path, zero_stage=3, offload_optimizer_device="cpu")
    assert main(["config", "check", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["deepspeed"]
    assert data["stage"] == 3 and data["offload_optimizer"] == "cpu" and data["offload_param"] == "none"
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                                                  "gradient_clipping": 0.5}))
    data = yaml.safe_load(path.read_text())
    data["deepspeed_config"] = {"deepspeed_config_file": "ds.json"}
    path.write_text(yaml.safe_dump(data))
    s = resolve_config(path).deepspeed
    assert (s.stage, s.clipping, s.offload_optimizer) == (1, 0.5, "cpu")


def test_config_check_flags_gradient_clipping_zero(tmp_path, capsys):
    path = _ds_yaml(tmp_path, gradient_clipping=0.0)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gradient_clipping: 0.0: accelerate drops a 0 and DeepSpeed then clips at its default 1" in err
    assert "Fix: remove gradient_clipping from the YAML" in err


@pytest.mark.parametrize("section, match", [
    ({"optimizer": {"name": "galore_adamw"}}, "DeepSpeed ZeRO flattens and partitions"),
    ({"parallel": {"dp_shard": 2}}, "parallel section builds its own FSDP2"),
])
def test_config_check_refuses_what_cannot_combine_with_deepspeed(tmp_path, capsys, section, match):
    path = _ds_yaml(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["hf_gradfix"] = section
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", str(path)]) == 2
    assert match in capsys.readouterr().err


def test_check_clipping_names_both_values_and_the_fix():
    check_clipping(0.0, 0.0)
    check_clipping(1.0, 1.0)
    with pytest.raises(DeepSpeedConfigError, match=r"DeepSpeed does not clip gradients but TrainingArguments.max_grad_norm is 1"):
        check_clipping(0.0, 1.0)
    assert deepspeed_settings({"distributed_type": "MULTI_GPU"}) is None


def test_launch_keeps_deepspeed_on_under_use_cpu(tmp_path, monkeypatch):
    import accelerate.commands.launch as accelerate_launch

    from hf_gradfix.cli import launch

    seen = {}
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.update(
        use_cpu=os.environ.get("ACCELERATE_USE_CPU"), ds=os.environ.get("DS_ACCELERATOR")))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")  # launch refuses a script that does not exist
    assert launch(["--config_file", str(CONFIGS / "cpu_deepspeed.yaml"), "train.py"]) == 0
    assert seen == {"use_cpu": None, "ds": "cpu"}
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert launch(["--config_file", str(CONFIGS / "cpu_multiprocess.yaml"), "train.py"]) == 0
    assert seen == {"use_cpu": "true", "ds": None}  # other CPU launches still export it
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert main(["launch", "--config_file", str(CONFIGS / "cpu_deepspeed.yaml"), "train.py"]) == 2


_SCRIPT = textwrap.dedent('''
    import json, os, sys
    sys.path[:0] = [os.environ["HGF_TESTS"]]
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__ = {}  # no g++ build of the shared-memory comm op (gloo instead)
    import torch, transformers
    import harness as H
    import hf_gradfix

    hf_gradfix.patch()  # reads the hf_gradfix: section through $HF_GRADFIX_CONFIG
    model = H.build_model("llama", 0)
    args = transformers.TrainingArguments(output_dir=sys.argv[1] + "/t", use_cpu=True, max_steps=1, report_to="none",
        per_device_train_batch_size=1, gradient_accumulation_steps=2, optim="sgd", learning_rate=0.1, max_grad_norm=0.0,
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=H.ListDataset(H.make_samples("causal", n=4)),
                                   data_collator=H.RecordingCollator("causal"))
    trainer.train()
    if trainer.args.process_index == 0:
        json.dump(dict(deepspeed=trainer.is_deepspeed_enabled, engine=type(trainer.model_wrapped).__name__,
                       stage=trainer.model_wrapped.zero_optimization_stage(), world=trainer.args.world_size,
                       use_cpu_env=os.environ.get("ACCELERATE_USE_CPU"), on_nonfinite=hf_gradfix.state_of(trainer).config.loss.on_nonfinite),
                  open(sys.argv[1] + "/result.json", "w"))
    from multiproc import finish_distributed
    finish_distributed()
''')


@pytest.mark.distributed
def test_hf_gradfix_launch_runs_zero3_on_cpu(tmp_path):
    """The shipped CPU file (stage 3 here): DeepSpeed stays on; with ACCELERATE_USE_CPU exported ZeRO-3 crashed."""
    pytest.importorskip("deepspeed")
    data = yaml.safe_load((CONFIGS / "cpu_deepspeed.yaml").read_text())
    data["deepspeed_config"]["zero_stage"] = 3
    data["main_process_port"] = H._free_port()
    data["hf_gradfix"] = {"loss": {"on_nonfinite": "skip"}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR", "HF_GRADFIX_CONFIG")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HGF_TESTS=str(H.TESTS_DIR),
               PYTHONPATH=os.pathsep.join([str(H.REPO_ROOT), str(H.TESTS_DIR)]))
    proc = run_launch([sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(cfg), str(script), str(tmp_path)],
                      env=env, step="hf-gradfix launch of ZeRO-3", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == dict(deepspeed=True, engine="DeepSpeedEngine", stage=3, world=2, use_cpu_env=None, on_nonfinite="skip")


# ------------------------------------------------------------------------------------------------------------------
# Hostile DeepSpeed settings: each refused in one line naming the key, the value and the fix, library and CLI alike
# ------------------------------------------------------------------------------------------------------------------
BAD_YAML = [
    (dict(zero_stage=4), "deepspeed_config.zero_stage: invalid value 4"),
    (dict(zero_stage=-1), "deepspeed_config.zero_stage: invalid value -1"),
    (dict(zero_stage="2"), "deepspeed_config.zero_stage: invalid value '2'"),
    (dict(zero_stage=2.5), "deepspeed_config.zero_stage: invalid value 2.5"),
    (dict(zero_stage=True), "deepspeed_config.zero_stage: invalid value True"),
    (dict(gradient_clipping=-1), "deepspeed_config.gradient_clipping: invalid value -1"),
    (dict(gradient_clipping=float("nan")), "deepspeed_config.gradient_clipping: invalid value nan"),
    (dict(gradient_clipping=float("inf")), "deepspeed_config.gradient_clipping: invalid value inf"),
    (dict(gradient_clipping="1.0"), "deepspeed_config.gradient_clipping: invalid value '1.0'"),
    (dict(offload_optimizer_device="gpu"), "deepspeed_config.offload_optimizer_device: invalid value 'gpu'"),
    (dict(offload_optimizer_device="nvme"), "offload_optimizer_device: nvme without deepspeed_config.offload_optimizer_nvme_path"),
    (dict(zero_stage=2, offload_param_device="cpu"), "deepspeed_config.offload_param_device: 'cpu' with ZeRO-2"),
    (dict(zero_stage=3, deepspeed_config_file="ds.json"), "deepspeed_config_file with deepspeed_config."),
]


def _one_line(tmp_path, capsys, path, needle):
    from hf_gradfix.config.schema import ConfigError

    with pytest.raises((DeepSpeedConfigError, ConfigError)) as library:
        resolve_config(path)
    assert needle in str(library.value) and "\n" not in str(library.value), str(library.value)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("settings, needle", BAD_YAML, ids=[n.split(":")[0] + str(i) for i, (_, n) in enumerate(BAD_YAML)])
def test_bad_deepspeed_yaml_settings_are_one_line(tmp_path, capsys, settings, needle):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    _one_line(tmp_path, capsys, _ds_yaml(tmp_path, **settings), needle)


BAD_JSON = [
    ('{"zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 3}}', "duplicate key(s) ['zero_optimization']"),
    ('{"zero_optimization": {"stage": 2}, "gradient_clipping": NaN}', "NaN is not a JSON number"),
    ('{"zero_optimization": {"stage": 5}}', "zero_optimization.stage: invalid value 5"),
    ('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}', "zero_optimization.offload_optimizer.device: invalid value 'gpu'"),
    ('{"zero_optimization": {"stage": 2, "overlap_com": true}}', "zero_optimization.overlap_com"),  # DeepSpeed's own schema: a typo
    ('{"zero_optimization": {"stage": 2}, "gradient_clipping": -0.5}', "gradient_clipping (DeepSpeed JSON): invalid value -0.5"),
]


@pytest.mark.parametrize("text, needle", BAD_JSON, ids=[str(i) for i in range(len(BAD_JSON))])
def test_bad_deepspeed_json_is_one_line(tmp_path, capsys, text, needle):
    (tmp_path / "ds.json").write_text(text)
    path = _ds_yaml(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["deepspeed_config"] = {"deepspeed_config_file": "ds.json"}
    path.write_text(yaml.safe_dump(data))
    if "overlap_com" in text:
        pytest.importorskip("deepspeed")
    _one_line(tmp_path, capsys, path, needle)


def test_a_deepspeed_json_that_is_not_a_regular_file_or_too_large_is_refused_without_reading_it(tmp_path, capsys):
    path = _ds_yaml(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["deepspeed_config"] = {"deepspeed_config_file": "/dev/zero"}
    path.write_text(yaml.safe_dump(data))
    _one_line(tmp_path, capsys, path, "not a regular file")
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * (5 * 1024 * 1024) + '"}')
    data["deepspeed_config"] = {"deepspeed_config_file": str(big)}
    path.write_text(yaml.safe_dump(data))
    _one_line(tmp_path, capsys, path, "more than 4194304 for a config")


@pytest.mark.parametrize("kind,extra", [
    ("FSDP", {"fsdp_config": {"fsdp_version": 2}, "deepspeed_config": {"zero_stage": 2}}),
    ("DEEPSPEED", {"fsdp_config": {"fsdp_version": 2}, "deepspeed_config": {"zero_stage": 2}}),
    ("MULTI_CPU", {"deepspeed_config": {"zero_stage": 3}}),
])
def test_an_engine_section_accelerate_ignores_is_refused_in_one_line(tmp_path, capsys, kind, extra):
    """A file with an engine section its distributed_type does not select (issue 50: FSDP with a deepspeed_config
    launched as FSDP without a word): accelerate's own launch parser says which engine runs; the library, config check
    and launch refuse the file with one line naming the ignored section, distributed_type, that engine and the fix.
    Control: the same file without the ignored section is accepted and runs accelerate's engine."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from hf_gradfix.config import ConfigError, load_config

    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_processes": 2, "use_cpu": True,
            "hf_gradfix": {}, **extra}
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(data))
    plain = tmp_path / "plain.yaml"  # accelerate's parser reads a file without the plugin's section
    plain.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "hf_gradfix"}))
    args = launch_command_parser().parse_args(["--config_file", str(plain), "train.py"])
    try:
        _validate_launch_command(args)
    except ValueError:
        pass  # a CPU machine: accelerate may refuse later checks; the engine flags are set before them
    theirs = "DEEPSPEED" if args.use_deepspeed else "FSDP" if args.use_fsdp else "other"
    ignored = [s for s in extra if {"deepspeed_config": "DEEPSPEED", "fsdp_config": "FSDP"}[s] != theirs]
    assert len(ignored) == 1, (theirs, extra)
    section = ignored[0]
    engine = {"deepspeed_config": "DEEPSPEED", "fsdp_config": "FSDP"}[section]
    wanted = (f"{section}: ignored: distributed_type is {kind}, so accelerate launch runs {kind} and never reads "
              f"{section}; fix: set distributed_type: {engine}")
    with pytest.raises(ConfigError) as library:
        load_config(str(path))  # what patch(config=path) reads
    assert wanted in str(library.value) and "\n" not in str(library.value), str(library.value)
    for argv in (["config", "check", str(path)], ["launch", "--config_file", str(path), "train.py"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and wanted in err and "Traceback" not in err, err
    # control: without the ignored section the file is accepted, and the engine is the one accelerate runs
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != section}))
    resolved = resolve_config(path, for_launch=True)
    ours = "DEEPSPEED" if resolved.deepspeed is not None else resolved.distributed_type.upper()
    assert (ours if ours in ("DEEPSPEED", "FSDP") else "other") == theirs
    assert main(["config", "check", str(path)]) == 0
    assert "ignored" not in capsys.readouterr().out
