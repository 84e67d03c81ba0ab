"""``hf-gradfix launch`` and ``hf-gradfix config check``; the shipped accelerate configs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

import hang_bound
import harness as H
from multiproc import run_launch
from hf_gradfix.cli import main, resolve_config
from hf_gradfix.config import ConfigError
from hf_gradfix.parallel import ParallelDimsError

ROOT = Path(__file__).resolve().parents[2]
ACCEL_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


def _write(tmp_path, data, name="combined.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _cpu_yaml(nproc=2, **extra):
    return {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": nproc,
        "num_machines": 1, "machine_rank": 0, "main_process_ip": "127.0.0.1", "main_process_port": H._free_port(),
        "use_cpu": True, "mixed_precision": "no", **extra,
    }


@pytest.mark.parametrize("path", ACCEL_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_accelerate_config_is_plain_accelerate_and_resolves(path):
    from accelerate.commands.config.config_args import load_config_from_file

    load_config_from_file(str(path))  # accelerate's own strict loader accepts it (no unknown keys)
    text = path.read_text()
    assert "Processes:" in text and "accelerate launch --config_file" in text and "hf-gradfix launch" in text
    r = resolve_config(path, micro_batch=2, seq_len=128, grad_accum=4)
    assert r.mesh.dp_replicate * r.mesh.dp_shard * r.mesh.tp * r.mesh.cp == r.world_size
    assert r.global_batch_tokens == 2 * 128 * 4 * r.mesh.dp


def test_config_check_prints_world_mesh_and_global_batch(tmp_path, capsys):
    path = _write(tmp_path, {**_cpu_yaml(8), "hf_gradfix": {"parallel": {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "packing": {"enabled": True, "token_budget": 1024}}})
    assert main(["config", "check", str(path), "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert "8 process(es): dp_replicate=2 x dp_shard=2 x tp=2" in out
    # 1024 tokens per packed row x 4 accumulation x 4 data-parallel ranks (tp ranks share their batch)
    assert "16,384 tokens" in out
    assert main(["config", "check", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2, "cp": 1, "dp": 4, "dp_cp": 4, "ep": 1, "efsdp": 4}


@pytest.mark.parametrize(
    "content, match",
    [
        ({"parallelism_config": {"tp_size": 2}}, "accelerate only reads keys with the 'parallelism_config_' prefix"),
        ({"hf_gradfix": {"parallel": {"dp_shard": 3, "tp": 2}}}, "= 6 processes, but the world size is 4"),
        ({"hf_gradfix": {"parallel": {"tp": 3}}}, "the degrees set (tp=3) multiply to 3, which does not divide num_processes 4; dp_shard (not set"),
        ({"hf_gradfix": {"parallel": {"tp": 3, "dp_shard": -1}}}, "dp_shard=-1: the other degrees multiply to 3"),  # set: named
        ({"hf_gradfix": {"parallel": {"tp": 2}}, "parallelism_config": {"parallelism_config_tp_size": 4}}, "keep one of them"),
        ({"hf_gradfix": {"paralel": {"tp": 2}}}, "did you mean 'parallel'"),
        ({"hf_gradfix": {"parallel": {"tp": 0}}}, "parallel.tp: invalid value 0"),
    ],
)
def test_config_check_errors_name_the_key_and_the_fix(tmp_path, capsys, content, match):
    path = _write(tmp_path, {**_cpu_yaml(4), **content})
    assert main(["config", "check", str(path)]) == 2
    assert match in capsys.readouterr().err


def test_config_check_runs_cp_with_packing(tmp_path, capsys):
    path = _write(tmp_path, {**_cpu_yaml(4), "hf_gradfix": {"parallel": {"tp": 2, "cp": 2}, "packing": True}})
    assert main(["config", "check", str(path)]) == 0
    assert "cp=2 over packed rows: documents padded to a multiple of 4" in capsys.readouterr().out


def test_config_check_validates_tp_against_the_model_heads(tmp_path, capsys):
    path = _write(tmp_path, {**_cpu_yaml(4), "hf_gradfix": {"parallel": {"dp_shard": 1, "tp": 4}}})
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}))
    assert main(["config", "check", str(path), "--model", str(model)]) == 2
    assert "parallel.tp=4 does not divide the model's num_key_value_heads=2" in capsys.readouterr().err
    with pytest.raises(ParallelDimsError):
        resolve_config(path, model_config=type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2})())


PROBE = """
import json, os, sys
import hf_gradfix
from hf_gradfix.config import config_to_dict
rank = int(os.environ["RANK"])
cfg = hf_gradfix.load_config()  # from $HF_GRADFIX_CONFIG, as patch() and GradFixCallback() read it
out = {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "use_cpu": os.environ.get("ACCELERATE_USE_CPU"),
       "config": config_to_dict(cfg)}
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(out))
"""


@pytest.mark.distributed
def test_launch_hands_accelerate_its_keys_and_every_rank_the_section(tmp_path):
    section = {"packing": {"enabled": True, "token_budget": 512}, "optimizer": {"name": "galore_adamw", "rank": 8}}
    path = _write(tmp_path, {**_cpu_yaml(2), "hf_gradfix": section})
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HF_GRADFIX_CONFIG", None)
    cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(path), str(script), str(tmp_path)]
    proc = run_launch(cmd, env=env, step="hf-gradfix launch of a 2-rank probe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert (s["rank"], s["world"], s["use_cpu"]) == (r, 2, "true")
        assert s["config"]["packing"]["token_budget"] == 512 and s["config"]["optimizer"]["rank"] == 8
    # the same file given straight to accelerate fails on the unknown top-level key: why the launcher exists
    plain = hang_bound.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path), str(script), str(tmp_path)],
                           capture_output=True, text=True, env=env, step="accelerate launch of a 1-process probe")
    assert plain.returncode != 0 and "unknown keys" in plain.stderr


def test_launch_refuses_a_bad_section_before_starting_anything(tmp_path, capsys):
    path = _write(tmp_path, {**_cpu_yaml(2), "hf_gradfix": {"loss": {"count_rule": "shift"}}})
    assert main(["launch", "--config_file", str(path), "nonexistent_script.py"]) == 2
    assert "hf_gradfix.loss.count_rule: invalid value 'shift'" in capsys.readouterr().err


def test_unknown_accelerate_yaml_key_without_section_still_resolves(tmp_path):
    with pytest.raises(ConfigError, match="prefix"):
        resolve_config(_write(tmp_path, {**_cpu_yaml(2), "parallelism_config": {"dp_shard_size": 2}}))


def test_a_trainer_launched_as_several_processes_but_running_alone_is_refused(tmp_path, monkeypatch):
    """torchrun / accelerate launch on a CPU machine with TrainingArguments(use_cpu=False): N silent copies."""
    from hf_gradfix.config import load_config
    from hf_gradfix.integration.trainer_fix import GradFixError, install, state_of

    trainer = H.make_trainer(H.build_model("llama"), H.make_samples("causal", n=4), "causal", output_dir=tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the launcher exported; this Trainer's accelerator has 1 process
    with pytest.raises(GradFixError, match="WORLD_SIZE=2 processes were launched.*use_cpu=True"):
        install(trainer, load_config({}), source="test")
    assert state_of(trainer) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert install(trainer, load_config({}), source="test") is state_of(trainer)


def test_version_and_env_for_a_bug_report(tmp_path):
    """``hf-gradfix --version`` and ``hf-gradfix env`` (like accelerate's and TRL's): typed from outside the clone,
    the versions named are the installed ones (read here from importlib.metadata, not from the report's code)."""
    from importlib import metadata

    import hf_gradfix

    env = {**os.environ, "PYTHONPATH": str(H.REPO_ROOT)}
    version = hang_bound.run([sys.executable, "-m", "hf_gradfix", "--version"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, step="hf-gradfix CLI command")
    assert version.returncode == 0 and version.stdout.strip() == f"hf-gradfix {hf_gradfix.__version__}", version
    report = hang_bound.run([sys.executable, "-m", "hf_gradfix", "env"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, step="hf-gradfix CLI command")
    assert report.returncode == 0, report.stderr
    for name in ("torch", "transformers", "accelerate"):
        assert f"- {name}: {metadata.version(name)}\n" in report.stdout, report.stdout
    assert "- device: " in report.stdout and "- lock: " in report.stdout


def _versions_as(monkeypatch, **overrides):
    """importlib.metadata.version as if every package of the tested lock were installed at its locked version (the
    control, whatever this venv holds), except ``overrides`` (name -> version, None = not installed)."""
    from importlib import metadata

    from hf_gradfix.integration import versions

    lock = versions.read_lock(versions.LOCK_DIR / "lock-tf5.txt")
    real = metadata.version

    def version(name):
        if name in overrides:
            if overrides[name] is None:
                raise metadata.PackageNotFoundError(name)
            return overrides[name]
        return lock.get(name) or real(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(versions, "_warned", False)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    return lock


def _untested_warnings(record):
    from hf_gradfix.integration.versions import UntestedVersionWarning

    return [str(w.message) for w in record if issubclass(w.category, UntestedVersionWarning)]


def test_patch_and_env_name_untested_versions_with_the_install_command(monkeypatch):
    """A supported but untested version (transformers 5.99, peft 0.99: what a plain install of the newest releases
    brings) is named at patch() in one warning, once per process, with the command that installs the tested set from
    the lock shipped inside the package; `env` prints the same line. Control: every package at its locked version, no
    warning and `env` says none."""
    import warnings

    import hf_gradfix
    from hf_gradfix.commands.env import environment_lines
    from hf_gradfix.integration import versions

    lock = _versions_as(monkeypatch, transformers="5.99.0", peft="0.99.0")
    path = versions.LOCK_DIR / "lock-tf5.txt"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hf_gradfix.patch()
        hf_gradfix.unpatch()
        hf_gradfix.patch()  # once per process
        hf_gradfix.unpatch()
        hf_gradfix.GradFixCallback()
    [line] = _untested_warnings(record)
    assert "\n" not in line and line.startswith("hf_gradfix: untested versions: ")
    assert f"peft 0.99.0 (tested: {lock['peft']})" in line and f"transformers 5.99.0 (tested: {lock['transformers']})" in line
    command = f"pip install -c {path} peft=={lock['peft']} transformers=={lock['transformers']}"
    assert line.endswith(command), line
    assert path.is_file() and path.resolve().is_relative_to(Path(hf_gradfix.__file__).resolve().parent)  # shipped
    [env_line] = [x for x in environment_lines() if x.startswith("- untested versions: ")]
    assert env_line == "- untested versions: " + line[len("hf_gradfix: untested versions: "):]

    _versions_as(monkeypatch)  # the control: the tested set
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hf_gradfix.patch()
        hf_gradfix.unpatch()
    assert not _untested_warnings(record)
    assert "- untested versions: none (every installed package hf_gradfix integrates with is at its lock-tf5.txt " \
           "version)" in environment_lines()


def test_the_tested_lock_follows_the_installed_transformers_line(monkeypatch):
    from hf_gradfix.integration import versions

    _versions_as(monkeypatch, transformers="4.57.6")
    assert versions.lock_of_installed().name == "lock-tf457.txt"
    _versions_as(monkeypatch, transformers="5.24.0")
    assert versions.lock_of_installed().name == "lock-tf5.txt"


def test_env_counts_only_the_pins_whose_package_is_installed(monkeypatch):
    """Optional extras nobody installed (deepspeed, bitsandbytes, mkdocs, ...) are not differences: `env` counts the
    lock's installed pins only. Control: a pin installed at another version is counted and named."""
    from hf_gradfix.commands.env import environment_lines

    lock = _versions_as(monkeypatch, deepspeed=None, bitsandbytes=None, mkdocs=None, pyyaml="0.0.1")
    [line] = [x for x in environment_lines() if x.startswith("- lock: ")]
    assert line.startswith(f"- lock: 1 of the {len(lock) - 3} installed pin(s) of lock-tf5.txt differ: "
                           f"pyyaml: installed 0.0.1, locked {lock['pyyaml']} ("), line
    assert "deepspeed" not in line and "not installed" not in line
    assert not any(x.startswith("- untested versions: ") and "deepspeed" in x for x in environment_lines())
    _versions_as(monkeypatch, deepspeed=None)
    [line] = [x for x in environment_lines() if x.startswith("- lock: ")]
    assert line.startswith(f"- lock: the {len(lock) - 1} installed pin(s) of lock-tf5.txt are at their locked versions")


def test_the_lock_files_ship_inside_the_package():
    """pyproject's package-data covers every lock (what a wheel installs beside the code), and requirements/ at the
    root of the clone is the same folder (scripts and CI name it there)."""
    import fnmatch
    import tomllib

    from hf_gradfix.integration.versions import LOCK_DIR

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hf_gradfix"]
    locks = sorted(p.relative_to(LOCK_DIR.parent).as_posix() for p in LOCK_DIR.glob("lock-*.txt"))
    assert locks == ["requirements/lock-tf457.txt", "requirements/lock-tf5.txt"]
    assert all(any(fnmatch.fnmatch(name, g) for g in globs) for name in locks), (locks, globs)
    assert (ROOT / "requirements").resolve() == LOCK_DIR


def test_the_cli_commands_and_the_cli_page_agree():
    """docs/cli.md names every command the parser has (read from the parser, not a copy) and says how many; the
    generated help covers each (docs/hooks.py)."""
    import argparse
    import re

    from hf_gradfix.cli import build_parser

    def subcommands(parser):
        return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                for name, sub in action.choices.items()}

    commands = set()
    for name, sub in subcommands(build_parser()).items():
        inner = subcommands(sub)
        # a command group with one subcommand (config check) is named with it; configs lists its own
        commands.add(f"{name} {next(iter(inner))}" if len(inner) == 1 else name)
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `hf-gradfix ([a-z ]+)` \|", page, flags=re.M))
    assert listed == commands, (listed, commands)
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"with {words[len(commands)]} commands" in page
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert {" ".join(c) for c in hooks.CLI_COMMANDS if c} == commands


def test_shipped_configs_by_name_from_outside_the_clone(tmp_path):
    """Typed where a user stands (a folder outside the clone): config check / launch take a shipped configuration by
    name; configs list names every shipped file; show prints it; copy writes an editable copy and never overwrites.
    A CPU file is reported as running on the CPU."""
    env = {**os.environ, "PYTHONPATH": str(H.REPO_ROOT)}

    def run(*argv):
        return hang_bound.run([sys.executable, "-m", "hf_gradfix", *argv], capture_output=True, text=True, env=env,
                              cwd=tmp_path, step="hf-gradfix CLI command")

    shipped = sorted(p.relative_to(H.REPO_ROOT / "hf_gradfix" / "configs").with_suffix("").as_posix()
                     for p in (H.REPO_ROOT / "hf_gradfix" / "configs").rglob("*") if p.suffix in (".yaml", ".json"))
    listed = run("configs", "list")
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == shipped
    check = run("config", "check", "cpu_pp")
    assert check.returncode == 0, check.stderr
    assert "launch            MULTI_GPU, 2 process(es) on the CPU" in check.stdout and "pp=2" in check.stdout
    assert run("config", "check", "accelerate/fsdp2").returncode == 0
    missing = run("config", "check", "cpu_ppp")
    assert missing.returncode == 2 and "the name of a shipped configuration" in missing.stderr and "cpu_pp" in missing.stderr
    shown = run("configs", "show", "cpu_pp")
    assert shown.stdout == (H.REPO_ROOT / "configs" / "cpu_pp.yaml").read_text()
    assert run("configs", "copy", "cpu_pp").returncode == 0
    assert (tmp_path / "cpu_pp.yaml").read_text() == shown.stdout
    again = run("configs", "copy", "cpu_pp")
    assert again.returncode == 2 and "refuses to overwrite" in again.stderr
    # accelerate's habit: --config_file names the file (as launch does); one file, or one clear line
    by_flag = run("config", "check", "--config_file", "cpu_pp")
    assert by_flag.returncode == 0 and by_flag.stdout == check.stdout, by_flag.stderr
    both = run("config", "check", "cpu_pp", "--config_file", "cpu_cp")
    assert both.returncode == 2 and both.stderr.strip().splitlines() == [
        "hf-gradfix config check: two files given ('cpu_pp' and --config_file 'cpu_cp'); fix: name one"]
    none = run("config", "check")
    assert none.returncode == 2 and "fix: hf-gradfix config check FILE (or --config_file FILE" in none.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`hf-gradfix configs list | head -1`: the reader leaves; no BrokenPipeError traceback, exit 141 (128 + SIGPIPE,
    what the shell tools return). The reader here (`true`) leaves before the interpreter has started, so the first
    write always meets a closed pipe (with `head -1` it depends on the pipe buffer's timing)."""
    env = {**os.environ, "PYTHONPATH": str(H.REPO_ROOT)}
    proc = hang_bound.run(["bash", "-c", f"{sys.executable} -m hf_gradfix configs list | true; "
                           'echo "rc=${PIPESTATUS[0]}" >&2'], capture_output=True, text=True, env=env, cwd=tmp_path,
                          step="hf-gradfix CLI command")
    assert proc.stderr.strip().splitlines() == ["rc=141"], proc.stderr


def test_the_wheel_carries_the_shipped_configs(tmp_path):
    """package data: a wheel built from the tree holds every shipped configuration (what pip install gets)."""
    import zipfile

    proc = hang_bound.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(H.REPO_ROOT)], capture_output=True, text=True, step="pip wheel of the repository")
    if proc.returncode != 0:
        pytest.skip(f"no wheel build here: {proc.stderr[-300:]}")
    wheel = next(tmp_path.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (H.REPO_ROOT / "hf_gradfix" / "configs").rglob("*"):
        if path.suffix in (".yaml", ".json"):
            assert path.relative_to(H.REPO_ROOT).as_posix() in names, path


def test_launch_prints_the_resolved_mesh_once_and_config_check_explains_plain_accelerate(tmp_path, capsys,
                                                                                           monkeypatch):
    """launch: one line with the engine, the mesh and where it came from, after every check and before any process;
    config check on a file with the section says how to launch it (plain accelerate stops on the section: measured
    here with accelerate's own config loader)."""
    import accelerate.commands.launch as accelerate_launch
    from accelerate.commands.config.config_args import load_config_from_file

    path = str(H.REPO_ROOT / "configs" / "cpu_pp.yaml")
    with pytest.raises(Exception) as err:  # the measurement: accelerate's loader refuses the plugin's section
        load_config_from_file(path)
    assert "hf_gradfix" in str(err.value) or "upgrad" in str(err.value)
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: None)
    (tmp_path / "train.py").write_text("")
    assert main(["launch", "--config_file", path, str(tmp_path / "train.py")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-gradfix launch:")]
    assert lines == [f"hf-gradfix launch: MULTI_GPU, 2 process(es): pp=2 (data-parallel 1, token groups 1, shard groups 1) "
                     f"[hf_gradfix.parallel]; loss exact over the window ({path})"], lines
    assert main(["config", "check", path]) == 0
    assert f"launch this file with `hf-gradfix launch --config_file {path} train.py`" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["verify", "python", "train.py"], "'python train.py': a command needs `--` before it: hf-gradfix verify [options] -- python train.py"),
    (["verify", "train.py", "--lr", "1"], "a command needs `--` before it: hf-gradfix verify [options] -- python train.py --lr 1"),
    (["verify", "-m", "pkg.train"], "hf-gradfix verify [options] -- -m pkg.train"),
    (["check", "run.yaml"], "'check' is not a command; did you mean `hf-gradfix config check`?"),
    (["version"], "did you mean `hf-gradfix --version`?"),
])
def test_common_cli_slips_get_a_hint(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_launch_options_after_the_script_are_named(tmp_path, capsys, monkeypatch):
    """`hf-gradfix launch train.py --config_file x.yaml`: accelerate hands --config_file to the script and launches
    without the file; launch says so (a note: the script may take its own --config_file)."""
    import accelerate.commands.launch as accelerate_launch

    seen = {}
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.update(script_args=args.training_script_args))
    (tmp_path / "train.py").write_text("")
    assert main(["launch", str(tmp_path / "train.py"), "--config_file", "cpu_pp"]) == 0
    assert seen["script_args"] == ["--config_file", "cpu_pp"]  # what accelerate does with it (measured)
    assert "note: --config_file comes after the script" in capsys.readouterr().err
