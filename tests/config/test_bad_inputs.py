"""Every key, wrong types, out-of-range and non-finite values, typos: one validating path for every entry point.

The table is generated from the schema (every field of every section) plus accelerate's keys and broken files.
Each bad file is given to the library (``load_config(path)``, as ``patch(config=path)`` reads it), to
``hf-gradfix config check`` and to ``hf-gradfix launch`` (``main()`` in-process): the same message everywhere,
no traceback, exit code 2.  Two real subprocess runs check the console script end to end.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

import hang_bound
import torch
import yaml

from hf_gradfix.cli import main
from hf_gradfix.config import ConfigError, GradFixConfig, load_config
from hf_gradfix.config.loader import _type_hints
from hf_gradfix.errors import HfGradfixError

BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True}


def _bad_values(tp, meta):
    """(value, fragment the message must hold) for a field of type ``tp`` with range ``meta``."""
    out = []
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        tp = args[0] if len(args) == 1 else tp
        origin = typing.get_origin(tp)
    if tp is bool:
        out += [("yes", "expected a bool"), (1, "expected a bool")]
    elif tp is int:
        out += [("four", "expected an int"), (1.5, "expected an int"), (True, "expected an int"), ([2], "expected an int")]
        if meta.get("min") is not None:
            out.append((meta["min"] - 1 if meta.get("special") != meta["min"] - 1 else meta["min"] - 2, f">= {meta['min']}"))
        if meta.get("max") is not None:
            out.append((meta["max"] + 1, f"<= {meta['max']}"))
        if meta.get("min") is None and meta.get("max") is None:
            raise AssertionError(f"int field without a range: {meta}")
    elif tp is float:
        out += [("fast", "expected a float"), (float("inf"), "finite"), (float("nan"), "finite"), (-float("inf"), "finite")]
        if meta.get("above") is not None:
            out.append((meta["above"], f"> {meta['above']}"))
        if meta.get("max") is not None:
            out.append((meta["max"] * 10, f"<= {meta['max']}"))
    elif origin is typing.Literal:
        option = typing.get_args(tp)[0]
        out += [(option[:-1] + "x" if len(option) > 2 else option + "x", "allowed values"), (7, "allowed values")]
    elif origin is list:
        out += [(5, "expected"), ([1, 2], "expected a string")]
    else:
        raise AssertionError(f"no bad values for {tp!r}")
    return out


def _schema_cases():
    cases = []
    for section in dataclasses.fields(GradFixConfig):
        cls = type(getattr(GradFixConfig(), section.name))
        if not dataclasses.is_dataclass(cls):  # log_fixes
            cases.append((section.name, {section.name: "yes"}, f"hf_gradfix.{section.name}: invalid value 'yes'", "expected a bool"))
            continue
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"hf_gradfix.{section.name}.{f.name}"
            for value, fragment in _bad_values(hints[f.name], f.metadata):
                where = f"{key}[0]" if isinstance(value, list) and value == [1, 2] else key
                cases.append((f"{key}={value!r}", {section.name: {f.name: value}}, f"{where}: invalid value", fragment))
            typo = f.name[:-1] + ("x" if f.name[-1] != "x" else "y")
            hint = f"did you mean {f.name!r}" if len(f.name) > 3 else "allowed keys"
            cases.append((f"{key} typo", {section.name: {typo: 1}}, f"hf_gradfix.{section.name}.{typo}: unknown key", hint))
        typo = section.name[:-1] + "x"
        cases.append((f"{section.name} typo", {typo: {}}, f"hf_gradfix.{typo}: unknown key", f"did you mean {section.name!r}"))
    return cases


SCHEMA_CASES = _schema_cases()

ACCELERATE_CASES = [
    # nested values outside accelerate's own choices (issue 38: launched, or refused by accelerate after start)
    ("fsdp_version 3", {"fsdp_config": {"fsdp_version": 3}}, "fsdp_config.fsdp_version: invalid value 3", "allowed values: '1', '2'"),
    ("sharding HALF_SHARD", {"fsdp_config": {"fsdp_sharding_strategy": "HALF_SHARD"}},
     "fsdp_config.fsdp_sharding_strategy: invalid value 'HALF_SHARD'", "'FULL_SHARD'"),
    ("dynamo TURBO", {"dynamo_config": {"dynamo_backend": "TURBO"}}, "dynamo_config.dynamo_backend: invalid value 'TURBO'",
     "accelerate's own choices"),
    ("num_processes four", {"num_processes": "four"}, "num_processes: invalid value 'four'", "whole number"),
    ("num_processes 0", {"num_processes": 0}, "num_processes: invalid value 0", ">= 1"),
    ("num_processes -3", {"num_processes": -3}, "num_processes: invalid value -3", ">= 1"),
    ("num_processes 2.5", {"num_processes": 2.5}, "num_processes: invalid value 2.5", "whole number"),
    ("num_machines 0", {"num_machines": 0}, "num_machines: invalid value 0", ">= 1"),
    ("machine_rank >= machines", {"num_machines": 2, "machine_rank": 2}, "machine_rank: invalid value 2", "< num_machines"),
    ("main_process_port", {"main_process_port": 70000}, "main_process_port: invalid value 70000", "<= 65535"),
    ("main_process_port str", {"main_process_port": "http"}, "main_process_port: invalid value 'http'", "whole number"),
    ("mixed_precision", {"mixed_precision": "bf15"}, "mixed_precision: invalid value 'bf15'", "did you mean 'bf16'"),
    ("distributed_type", {"distributed_type": "MULTI_GPUU"}, "distributed_type: invalid value 'MULTI_GPUU'", "did you mean 'MULTI_GPU'"),
    ("use_cpu", {"use_cpu": "yes"}, "use_cpu: invalid value 'yes'", "true or false"),
    ("fsdp_config", {"fsdp_config": "full"}, "fsdp_config: invalid value 'full'", "mapping"),
    ("accelerate typo", {"num_processess": 2}, "num_processess: unknown accelerate key", "did you mean 'num_processes'"),
    ("pc tp two", {"parallelism_config": {"parallelism_config_tp_size": "two"}}, "parallelism_config.parallelism_config_tp_size: invalid value 'two'", "whole number"),
    ("pc tp 0", {"parallelism_config": {"parallelism_config_tp_size": 0}}, "parallelism_config_tp_size: invalid value 0", ">= 1"),
    ("pc unprefixed", {"parallelism_config": {"tp_size": 2}}, "parallelism_config.tp_size", "prefix"),
    ("pc not a mapping", {"parallelism_config": 4}, "parallelism_config: invalid value 4", "mapping"),
]

FILE_CASES = [  # (id, raw text, fragments)
    ("yaml syntax", "num_processes: 2\nhf_gradfix:\n  loss: {count_rule: auto\n", ("invalid YAML at line",)),
    ("python tag", "num_processes: !!python/object/apply:os.getpid []\nhf_gradfix: {}\n", ("invalid YAML", "plain YAML")),
    ("tab indent", "hf_gradfix:\n\tloss: {}\n", ("invalid YAML", "tabs")),
    ("duplicate accelerate key", "num_processes: 2\nnum_processes: 4\nhf_gradfix: {}\n", (":2: num_processes: duplicate key",)),
    ("duplicate section key", "hf_gradfix:\n  loss: {}\n  loss: {}\n", (":3: hf_gradfix.loss: duplicate key",)),
    ("top-level list", "- 1\n- 2\n", ("expected a mapping at the top level",)),
    ("section not a mapping", "num_processes: 2\nhf_gradfix: 5\n", ("hf_gradfix: expected a mapping",)),
    ("not utf-8", b"hf_gradfix: {}\n# \xff\xfe\n", ("not UTF-8",)),
    ("accelerate keys without section", "num_processes: 2\nhf_gradfix_: {}\n", ("hf_gradfix_", "did you mean 'hf_gradfix'")),
    ("mesh does not fit", "num_processes: 4\nhf_gradfix:\n  parallel: {dp_shard: 3}\n", ("world size is 4",)),
]


def _write(tmp_path, content) -> str:
    path = tmp_path / "run.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(yaml.safe_dump(content, sort_keys=False, allow_unicode=True))
    return str(path)


def _cli(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def _same_everywhere(path: str, capsys, fragments, *, library: bool = True) -> None:
    message = None
    if library:
        with pytest.raises(HfGradfixError) as info:
            load_config(path)  # what patch(config=path) and GradFixCallback(path) read
        message = str(info.value)
    for argv, prefix in (
        (["config", "check", path], "hf-gradfix config check: "),
        (["launch", "--config_file", path, "no_such_script.py"], "hf-gradfix launch: "),
    ):
        code, err = _cli(argv, capsys)
        assert code == 2, (argv, err)
        assert "Traceback" not in err and err.startswith(prefix), err
        if message is not None:
            assert err[len(prefix):].rstrip("\n") == message
        for fragment in fragments:
            assert fragment in err, (fragment, err)


@pytest.mark.parametrize("name, section, key_fragment, fragment", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_every_schema_key(tmp_path, capsys, name, section, key_fragment, fragment):
    # YAML cannot spell every Python value: nan/inf are written .nan/.inf by safe_dump, which is the point
    path = _write(tmp_path, {**BASE, "hf_gradfix": section})
    _same_everywhere(path, capsys, [key_fragment, fragment])
    with pytest.raises(ConfigError) as info:  # the dict path of the library: the same problem line
        load_config(section)
    assert key_fragment in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("name, keys, key_fragment, fragment", ACCELERATE_CASES, ids=[c[0] for c in ACCELERATE_CASES])
def test_every_accelerate_key(tmp_path, capsys, name, keys, key_fragment, fragment):
    path = _write(tmp_path, {**BASE, **keys, "hf_gradfix": {"loss": {"count_rule": "auto"}}})
    _same_everywhere(path, capsys, [key_fragment, fragment])


@pytest.mark.parametrize("name, text, fragments", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_broken_files(tmp_path, capsys, name, text, fragments):
    path = _write(tmp_path, text)
    _same_everywhere(path, capsys, fragments, library=name not in ("mesh does not fit",))


def test_missing_file_and_directory(tmp_path, capsys):
    _same_everywhere(str(tmp_path / "nope.yaml"), capsys, ["config file not found"])
    _same_everywhere(str(tmp_path), capsys, ["is a directory"])


def test_command_line_numbers_are_checked(tmp_path, capsys):
    path = _write(tmp_path, BASE)
    for argv, fragment in (
        (["config", "check", path, "--num-processes", "0"], "--num-processes 0"),
        (["config", "check", path, "--micro-batch", "-1", "--seq-len", "8"], "--micro-batch -1"),
        (["config", "check", path, "--grad-accum", "0"], "--grad-accum 0"),
        (["launch", "--config_file", path, "--num_processes", "0", "x.py"], "--num_processes 0"),  # the flag as typed
    ):
        code, err = _cli(argv, capsys)
        assert code == 2 and fragment in err and "Traceback" not in err, err


def test_remote_code_model_is_one_line(tmp_path, capsys):
    model = tmp_path / "remote"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "my_custom_arch", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}'
    )
    path = _write(tmp_path, BASE)
    code, err = _cli(["config", "check", path, "--model", str(model)], capsys)
    assert code == 2 and "never runs remote code" in err and "Traceback" not in err, err
    code, err = _cli(["plan", "--model", str(model), "--num-gpus", "1"], capsys)
    assert code == 2 and "never runs remote code" in err and "Traceback" not in err, err
    code, err = _cli(["verify", "--model", str(model)], capsys)
    assert code == 2 and "never runs remote code" in err and "Traceback" not in err, err


def test_help_teaches(capsys):
    for argv in (["--help"], ["config", "check", "--help"], ["verify", "--help"], ["launch", "--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "example" in out and "``" not in out, (argv, out[:300])
    main_help = _help(["--help"], capsys)
    assert all(c in main_help for c in ("launch", "config check", "verify", "plan"))
    launch_help = _help(["launch", "--help"], capsys)
    assert launch_help.index("hf_gradfix:") < launch_help.index("positional arguments:")
    assert "(default: 4)" in _help(["verify", "--help"], capsys) and "(default: 1)" in _help(["config", "check", "--help"], capsys)


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_console_script_subprocess(tmp_path):
    """The real command: one line on stderr, exit code 2, no traceback (config check and launch)."""
    path = _write(tmp_path, {**BASE, "num_processes": "four", "hf_gradfix": {"optimizer": {"scale": float("inf")}}})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in (["config", "check", path], ["launch", "--config_file", path, "x.py"]):
        proc = hang_bound.run([sys.executable, "-m", "hf_gradfix", *argv], capture_output=True, text=True, env=env, step="hf-gradfix CLI command")
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.startswith(f"hf-gradfix {argv[0]}")
        assert "num_processes: invalid value 'four'" in proc.stderr and "optimizer.scale: invalid value inf" in proc.stderr


def test_unsupported_torch_suggests_a_torch_install(monkeypatch):
    from packaging.version import Version

    from hf_gradfix.integration import versions

    real = versions._installed
    monkeypatch.setattr(versions, "_installed", lambda name: Version("2.5.1") if name == "torch" else real(name))
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(versions.UnsupportedVersionError) as info:
        versions.check_supported()
    message = str(info.value)
    assert isinstance(info.value, HfGradfixError) and "torch 2.5.1" in message
    assert "pip install 'torch>=2.6'" in message and "transformers>=" not in message


@pytest.mark.parametrize("argv, fragment", [
    (["verify", "--steps", "0"], "--steps 0"),
    (["verify", "--grad-accum", "-2"], "--grad-accum -2"),
    (["verify", "--tolerance", "nan"], "--tolerance nan"),
    (["verify", "--inject", "nope"], "--inject 'nope'"),
    (["plan", "--model", "tiny-llama", "--num-gpus", "0"], "--num-gpus 0"),
    (["plan", "--model", "tiny-llama", "--rank", "0"], "--rank 0"),
    (["plan", "--model", "no/such-model-here"], "no/such-model-here"),
])
def test_other_commands_refuse_bad_numbers_in_one_line(capsys, argv, fragment):
    code, err = _cli(argv, capsys)
    assert code == 2 and fragment in err and "Traceback" not in err and err.startswith(f"hf-gradfix {argv[0]}"), err


# ------------------------------------------------------------------ issue 26: hostile files, silent acceptances, CLI
# One row per input: (id, surface, input, fragment of the one-line message, exit code, seconds, MiB).  Every row runs
# in this process under tracemalloc: the bound on time and on the Python memory traced while it runs is part of it
# (the old reader took minutes and grew past 18 GB on the alias bomb).  Files go to the library, config check and
# launch alike (the same line); "cli" rows are argv of main().

import json  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

_ACC = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
_FSDP = _ACC.replace("MULTI_CPU", "FSDP")
_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)) + "hf_gradfix: {}\n"

HOSTILE_FILES = [  # (id, file text, fragment, seconds, MiB)
    ("BEL in a comment", _ACC + "# bell \x07\nhf_gradfix: {}\n", "control character U+0007 at line 5, column 8", 5, 20),
    ("NUL in a value", _ACC + 'hf_gradfix: {loss: {count_rule: "a\x00"}}\n', "control character U+0000", 5, 20),
    ("C1 control", _ACC + "hf_gradfix: {}\n# \x85ok \x9b\n", "control character U+009B", 5, 20),
    ("5000-deep lists", "hf_gradfix:\n  loss: " + "[" * 5000 + "]" * 5000 + "\n", "nesting", 5, 20),
    ("3000-deep mappings", "a: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nesting", 5, 20),
    ("block nesting 70 deep", "".join("  " * i + f"k{i}:\n" for i in range(70)) + "  " * 70 + "v: 1\n", "nesting deeper than 64", 5, 20),
    ("alias bomb 9**9", _BOMB, "more than 100,000 values (aliases expanded)", 5, 20),
    ("120k values", "hf_gradfix:\n  optimizer:\n    exclude:\n" + "    - a\n" * 120_000, "more than 100,000 values", 60, 60),
    ("2 MiB file", _ACC + "hf_gradfix: {}\n" + ("# " + "x" * 1020 + "\n") * 2048, "a configuration file is at most 1,048,576 bytes", 5, 20),
    ("sexagesimal", _ACC + "hf_gradfix:\n  optimizer: {name: galore_adamw, update_proj_gap: 1:30}\n", "hf_gradfix.optimizer.update_proj_gap: '1:30' is read by YAML 1.1 as the base-60 number 90", 5, 20),
    ("octal", _ACC + "hf_gradfix:\n  optimizer: {name: galore_adamw, seed: 0777}\n", "hf_gradfix.optimizer.seed: '0777' is read by YAML 1.1 as the octal number 511", 5, 20),
    ("binary", _ACC + "hf_gradfix:\n  optimizer: {name: galore_adamw, seed: 0b101}\n", "hf_gradfix.optimizer.seed: '0b101' is read by YAML 1.1 as the binary number 5; write 5", 5, 20),
    ("underscored number", _ACC + "hf_gradfix:\n  packing: {enabled: true, token_budget: 4_096}\n", "hf_gradfix.packing.token_budget: '4_096' is read by YAML 1.1 as the number 4096", 5, 20),
    ("yes as a bool", _ACC + "hf_gradfix:\n  log_fixes: yes\n", "hf_gradfix.log_fixes: 'yes' is read by YAML 1.1 as the boolean true; write true", 5, 20),
    ("on as a section", _ACC + "hf_gradfix:\n  packing: on\n", "hf_gradfix.packing: 'on' is read by YAML 1.1 as the boolean true", 5, 20),
    ("fsdp_config typo", _FSDP + "fsdp_config: {fsdp_version: 2, fsdp_versoin: 2}\nhf_gradfix: {}\n", "fsdp_config.fsdp_versoin: unknown key (did you mean 'fsdp_version'?)", 60, 400),
    ("fsdp_config unprefixed typo", _FSDP + "fsdp_config: {version: 2, reshard_after_forwrd: true}\nhf_gradfix: {}\n", "fsdp_config.reshard_after_forwrd: unknown key (did you mean 'fsdp_reshard_after_forward'?)", 60, 400),
    ("deepspeed_config typo", _ACC.replace("MULTI_CPU", "DEEPSPEED") + "deepspeed_config: {zero_stag: 2}\nhf_gradfix: {}\n", "deepspeed_config.zero_stag: unknown key (did you mean 'zero_stage'?)", 60, 400),
    ("parallelism_config typo", _ACC + "parallelism_config: {parallelism_config_tp_sise: 2}\nhf_gradfix: {}\n", "parallelism_config.parallelism_config_tp_sise: unknown key (did you mean 'parallelism_config_tp_size'?)", 60, 400),
    ("dynamo_config typo", _ACC + "dynamo_config: {dynamo_backnd: inductor}\nhf_gradfix: {}\n", "dynamo_config.dynamo_backnd: unknown key (did you mean 'dynamo_backend'?)", 60, 400),
    ("scale_type on GaLore", _ACC + "hf_gradfix:\n  optimizer: {name: galore_adamw, scale_type: tensor}\n", "hf_gradfix.optimizer.scale_type: invalid value 'tensor'; scale_type applies to APOLLO only", 5, 20),
    ("apollo_mini at rank 64", _ACC + "hf_gradfix:\n  optimizer: {name: apollo_mini, rank: 64}\n", "hf_gradfix.optimizer.rank: invalid value 64; apollo_mini is rank 1 by definition", 5, 20),
    ("lowrank_grads on APOLLO", _ACC + "hf_gradfix:\n  optimizer: {name: apollo_adamw, lowrank_grads: true}\n", "lowrank_grads is GaLore-only", 5, 20),
    ("proj_method on APOLLO", _ACC + "hf_gradfix:\n  optimizer: {name: apollo_adamw, proj_method: svd}\n", "proj_method applies to GaLore only", 5, 20),
    ("token_budget 2**40", _ACC + "hf_gradfix:\n  packing: {enabled: true, token_budget: 1099511627776}\n", "hf_gradfix.packing.token_budget: invalid value 1099511627776; it must be >= 8 and <= 16777216", 5, 20),
]


def _bounded(call, seconds, mib):
    import accelerate.commands.launch  # noqa: F401 - imported before the measure: the bound is on the row's own work

    import hf_gradfix.config.resolve  # noqa: F401
    import hf_gradfix.parallel  # noqa: F401
    from hf_gradfix.config.loader import _launch_argument_names

    _launch_argument_names()
    tracemalloc.start()
    started = time.process_time()  # CPU seconds of this process: the row's work, not how busy the machine is
    try:
        result = call()
    finally:
        elapsed = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    assert elapsed <= seconds, f"took {elapsed:.1f} CPU s (bound {seconds} s)"
    assert peak <= mib, f"traced {peak:.0f} MiB (bound {mib} MiB)"
    return result


@pytest.mark.parametrize("name, text, fragment, seconds, mib", HOSTILE_FILES, ids=[r[0] for r in HOSTILE_FILES])
def test_hostile_and_surprising_files(tmp_path, capsys, name, text, fragment, seconds, mib):
    path = _write(tmp_path, text)
    with pytest.raises(HfGradfixError) as info:
        _bounded(lambda: load_config(path), seconds, mib)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    for argv, prefix in ((["config", "check", path], "hf-gradfix config check: "),
                         (["launch", "--config_file", path, "no_such_script.py"], "hf-gradfix launch: ")):
        code = _bounded(lambda: main(argv), seconds, mib)
        err = capsys.readouterr().err
        assert code == 2 and err == prefix + str(info.value) + "\n", err


def test_quoted_values_and_anchors_within_the_bound_are_accepted(tmp_path):
    path = _write(tmp_path, "hf_gradfix:\n  optimizer: {targets: &t ['0777', '1:30', 'yes'], exclude: *t}\n")
    cfg = load_config(path)
    assert cfg.optimizer.targets == cfg.optimizer.exclude == ["0777", "1:30", "yes"]


def test_a_file_launch_cannot_run_is_refused_by_config_check_with_the_same_line(tmp_path, capsys):
    path = _write(tmp_path, "num_processes: 2\nhf_gradfix: {}\n")
    assert load_config(path) == GradFixConfig()  # the library reads the plugin's settings: nothing to refuse
    lines = []
    for argv in (["config", "check", path], ["launch", "--config_file", path, "no_such_script.py"]):
        assert main(argv) == 2
        lines.append(capsys.readouterr().err.split(": ", 1)[1])
    assert lines[0] == lines[1] and "distributed_type: missing" in lines[0], lines


@pytest.mark.parametrize("text", ["", "hf_gradfix:\n", "REPO"], ids=["empty file", "bare section", "configs/hf_gradfix.yaml"])
def test_what_config_check_accepts_launch_runs(tmp_path, capsys, text):
    import pathlib

    if text == "REPO":
        text = (pathlib.Path(__file__).resolve().parents[2] / "configs" / "hf_gradfix.yaml").read_text()
    path = _write(tmp_path, text)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello', os.environ.get('HF_GRADFIX_CONFIG', 'unset') != 'unset')\n")
    assert main(["config", "check", path]) == 0
    capsys.readouterr()
    assert main(["launch", "--config_file", path, str(script)]) == 0, capsys.readouterr().err


def test_a_failing_script_under_launch_is_one_line_with_its_exit_code(tmp_path, capsys):
    path = _write(tmp_path, "distributed_type: 'NO'\nnum_processes: 1\nhf_gradfix: {}\n")
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    assert main(["launch", "--config_file", path, str(script)]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hf-gradfix launch: the script exited with status 3 (its output is above)"


_DIR = "{tmp}"
CLI_ROWS = [  # (id, argv with {tmp}, fragment, seconds, MiB)
    ("launch missing script", ["launch", "--config_file", "{tmp}/ok.yaml", "{tmp}/nope.py"], "training script '{tmp}/nope.py' not found", 60, 400),
    ("plan --gpu-memory 0GiB", ["plan", "--model", "tiny-llama", "--gpu-memory", "0GiB"], "--gpu-memory '0GiB': invalid size", 60, 400),
    ("plan --gpu-memory 1.2.3GiB", ["plan", "--model", "tiny-llama", "--gpu-memory", "1.2.3GiB"], "invalid size", 60, 400),
    ("plan --seq-len 10**12", ["plan", "--model", "tiny-llama", "--seq-len", str(10**12)], "--seq-len 1000000000000: invalid value; it must be a whole number >= 1 and <= 16777216", 60, 400),
    ("plan --update-proj-gap 0", ["plan", "--model", "tiny-llama", "--update-proj-gap", "0"], "--update-proj-gap 0: invalid value", 60, 400),
    ("plan --rank 1e9", ["plan", "--model", "tiny-llama", "--rank", "1000000000"], "--rank 1000000000: invalid value; it must be a whole number >= 1 and <= 65536", 60, 400),
    ("plan --num-gpus 1e9", ["plan", "--model", "tiny-llama", "--num-gpus", "1000000000"], "--num-gpus 1000000000: invalid value", 60, 400),
    ("plan --plot missing folder", ["plan", "--model", "tiny-llama", "--plot", "{tmp}/no/x.png"], "--plot {tmp}/no/x.png: the folder {tmp}/no does not exist", 60, 400),
    ("plan --plot unknown type", ["plan", "--model", "tiny-llama", "--plot", "{tmp}/x.xyz"], "unknown image type .xyz", 60, 400),
    ("plan --timeline missing folder", ["plan", "--model", "tiny-llama", "--timeline", "{tmp}/no/t.png"], "--timeline {tmp}/no/t.png: the folder", 60, 400),
    ("plan config.json list", ["plan", "--model", "{tmp}/list.json"], "expected a JSON object (a model's config.json), got a list", 60, 400),
    ("plan config.json zero sizes", ["plan", "--model", "{tmp}/zero.json"], "hidden_size=0: invalid value", 60, 400),
    ("plan config dir zero sizes", ["plan", "--model", "{tmp}/zerodir"], "hidden_size=0: invalid value", 60, 400),
    ("plan config.json negative", ["plan", "--model", "{tmp}/neg.json"], "hidden_size=-64: invalid value", 60, 400),
    ("plan huge model config", ["plan", "--model", "{tmp}/huge.json"], "num_hidden_layers=100000: invalid value; it must be a whole number >= 1 and <= 4096", 60, 400),
    ("verify --data missing", ["verify", "--data", "{tmp}/missing.jsonl"], "--data {tmp}/missing.jsonl: file not found", 60, 400),
    ("verify --data bad JSON line", ["verify", "--data", "{tmp}/bad.jsonl"], "--data {tmp}/bad.jsonl:2: not JSON", 60, 400),
    ("verify --data no input_ids", ["verify", "--data", "{tmp}/nokey.jsonl"], "--data {tmp}/nokey.jsonl:1: input_ids: expected a non-empty list of token ids", 60, 400),
    ("verify --data folder", ["verify", "--data", "{tmp}"], "is a folder", 60, 400),
    ("verify --data empty", ["verify", "--data", "{tmp}/empty.jsonl"], "no samples", 60, 400),
    ("verify --data negative id", ["verify", "--data", "{tmp}/neg.jsonl"], "--data {tmp}/neg.jsonl:1: input_ids holds -4", 60, 400),
    ("verify --data short labels", ["verify", "--data", "{tmp}/short.jsonl"], "labels have 2 entries, input_ids 3", 60, 400),
    ("verify --data label -5", ["verify", "--data", "{tmp}/lab.jsonl"], "labels holds -5", 60, 400),
    ("verify --data out of vocabulary", ["verify", "--data", "{tmp}/oov.jsonl"], "token id 100000 is outside the model's vocabulary", 120, 800),
    ("verify -m missing module", ["verify", "--", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found", 60, 400),
    ("plan heads not dividing hidden", ["plan", "--model", "{tmp}/heads.json"], "hidden_size=100 is not a multiple of num_attention_heads=3", 60, 400),
    ("plan more KV heads than heads", ["plan", "--model", "{tmp}/kv.json"], "num_key_value_heads=8 does not divide num_attention_heads=4", 60, 400),
    ("plan --rank with adamw", ["plan", "--model", "tiny-llama", "--optimizer", "adamw", "--rank", "8"], "--rank with --optimizer adamw", 60, 400),
    ("plan --offload-optimizer alone", ["plan", "--model", "tiny-llama", "--offload-optimizer"], "--offload-optimizer without DeepSpeed", 60, 400),
    ("plan --simulate too deep", ["plan", "--model", "{tmp}/deep.json", "--simulate"], "--simulate / --timeline with 1024 layers", 60, 600),
    # a named pipe blocked open() until a writer came (config check hung); a device never ends
    ("config check FIFO", ["config", "check", "{tmp}/fifo.yaml"], "{tmp}/fifo.yaml: is a named pipe (FIFO)", 60, 400),
    ("config check /dev/zero", ["config", "check", "/dev/zero"], "/dev/zero: is a character device", 60, 400),
    ("launch --num_processes 0", ["launch", "--num_processes", "0", "x.py"], "--num_processes 0: invalid value; it must be a whole number >= 1", 60, 400),
    ("launch --main_process_port 70000", ["launch", "--main_process_port", "70000", "x.py"], "--main_process_port 70000: invalid value", 60, 400),
    ("verify --data FIFO", ["verify", "--data", "{tmp}/fifo.jsonl"], "--data {tmp}/fifo.jsonl: is a named pipe (FIFO)", 60, 400),
    # issue 50: a FileNotFoundError traceback from the plugin's own code
    ("configs copy into a missing folder", ["configs", "copy", "ep", "{tmp}/no/such/x.yaml"],
     "{tmp}/no/such/x.yaml: the folder {tmp}/no/such does not exist", 60, 400),
    ("configs copy under a file", ["configs", "copy", "ep", "{tmp}/ok.yaml/x.yaml"], "{tmp}/ok.yaml is not a folder", 60, 400),
]


@pytest.mark.parametrize("name, argv, fragment, seconds, mib", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_inputs_are_one_line(tmp_path, capsys, name, argv, fragment, seconds, mib):
    tmp = str(tmp_path)
    (tmp_path / "ok.yaml").write_text("distributed_type: 'NO'\nnum_processes: 1\nhf_gradfix: {}\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    sizes = {"model_type": "llama", "hidden_size": 0, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "vocab_size": 100}
    (tmp_path / "zero.json").write_text(json.dumps(sizes))
    (tmp_path / "zerodir").mkdir()
    (tmp_path / "zerodir" / "config.json").write_text(json.dumps(sizes))
    (tmp_path / "neg.json").write_text(json.dumps({**sizes, "hidden_size": -64}))
    (tmp_path / "huge.json").write_text(json.dumps({**sizes, "hidden_size": 65536, "num_hidden_layers": 100000,
                                                    "num_attention_heads": 512, "intermediate_size": 262144}))
    (tmp_path / "heads.json").write_text(json.dumps({**sizes, "hidden_size": 100, "num_attention_heads": 3}))
    (tmp_path / "kv.json").write_text(json.dumps({**sizes, "hidden_size": 96, "num_key_value_heads": 8}))
    (tmp_path / "deep.json").write_text(json.dumps({**sizes, "hidden_size": 64, "num_hidden_layers": 1024}))
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2, 3]}\nnot json\n')
    (tmp_path / "nokey.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "neg.jsonl").write_text('{"input_ids": [5, -4, 6]}\n')
    (tmp_path / "short.jsonl").write_text('{"input_ids": [5, 6, 7], "labels": [5, 6]}\n')
    (tmp_path / "lab.jsonl").write_text('{"input_ids": [5, 6, 7], "labels": [5, -5, 7]}\n')
    (tmp_path / "oov.jsonl").write_text('{"input_ids": [5, 100000, 7]}\n')
    os.mkfifo(tmp_path / "fifo.yaml")
    os.mkfifo(tmp_path / "fifo.jsonl")
    argv = [a.replace(_DIR, tmp) for a in argv]
    import accelerate.commands.launch  # noqa: F401 - imported before the measure: the bound is on the row's own work
    import hf_gradfix.plan.estimate  # noqa: F401
    import hf_gradfix.verify.builtin  # noqa: F401

    code = _bounded(lambda: main(argv), seconds, mib)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith(f"hf-gradfix {argv[0]}"), err
    assert fragment.replace(_DIR, tmp) in err, err
    assert not (tmp_path / "no").exists()


def test_every_from_pretrained_refuses_remote_code():
    """Every from_pretrained call of the package passes trust_remote_code=False (transformers would otherwise ask on
    stdin, and a 'y' runs the model directory's own Python)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "hf_gradfix"
    calls = []
    for file in root.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                ok = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
                calls.append((f"{file.relative_to(root)}:{node.lineno}", ok))
    assert calls and all(ok for _, ok in calls), [c for c, ok in calls if not ok]


_REMOTE = """
import io, sys
from hf_gradfix.cli import main
codes = [main(argv) for argv in ({argvs})]
print("codes", codes)
"""


def test_remote_code_never_runs_whatever_is_on_stdin(tmp_path):
    model = tmp_path / "remote"
    model.mkdir()
    marker = tmp_path / "RAN"
    (model / "config.json").write_text(json.dumps({"model_type": "evil_arch", "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "configuration_evil.EvilConfig"}}))
    (model / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_arch'\n")
    cfg = _write(tmp_path, BASE)
    argvs = [["config", "check", cfg, "--model", str(model)], ["plan", "--model", str(model)],
             ["verify", "--model", str(model)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = hang_bound.run([sys.executable, "-c", _REMOTE.format(argvs=repr(argvs)[1:-1] + ",")], input="y\n" * 50,
                          capture_output=True, text=True, env=env, step="CLI on a model directory with remote code")
    assert not marker.exists(), "the model directory's own code ran"
    assert "codes [2, 2, 2]" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("never runs remote code") == 3 and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_under_launch_is_one_line_and_exit_130(tmp_path):
    import signal

    path = _write(tmp_path, "distributed_type: 'NO'\nnum_processes: 1\nhf_gradfix: {}\n")
    script = tmp_path / "sleep.py"
    # 'started' is printed inside the try: a Ctrl-C that lands right after it is the script's own quiet exit,
    # never a traceback of the test script (CI caught the signal between the print and the try).
    script.write_text("import time\ntry:\n    print('started', flush=True)\n    time.sleep(300)\n"
                      "except KeyboardInterrupt:\n    raise SystemExit(130)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A terminal's foreground job has Ctrl-C at its default; a suite started as a background job (`cmd &` in a script)
    # or after a test that ignored SIGINT hands it on *ignored* through exec, and the script would sleep on: reset it.
    proc = subprocess.Popen([sys.executable, "-m", "hf_gradfix", "launch", "--config_file", path, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "started"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        # the readiness signal above is what the test waits on; this bound only catches a hang (under a load
        # average of 6-16 importing transformers alone took ~35 s: a 120 s bound failed once in 2,180 tests)
        _, err = hang_bound.communicate(proc, step="hf-gradfix launch interrupted by Ctrl-C")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hf-gradfix launch: interrupted (Ctrl-C)", err


def test_launch_help_shows_every_accelerate_option(capsys):
    text = _help(["launch", "--help"], capsys)
    for option in ("--config_file", "-m, --module", "--cpu", "--num_processes", "--use_fsdp", "--fsdp_version",
                   "--zero_stage", "--parallelism_config_tp_size", "--mixed_precision"):
        assert option in text, option


def test_quickstart_install_line_covers_what_its_snippets_import():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    deps = {"torch", "transformers", "accelerate", "yaml", "hf_gradfix"}
    for page in (root / "docs" / "quickstart.md", root / "README.md"):
        text = page.read_text()
        install = " ".join(line for line in text.splitlines() if line.startswith("pip install -e"))
        chosen = set(re.findall(r"\[([a-z0-9,]+)\]", install)[0].split(",")) if "[" in install else set()
        extras = {name: name for name in chosen}
        snippets = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
        imported = set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", snippets, flags=re.M))
        missing = [m for m in imported if m not in deps and m not in extras and m not in install.split()
                   and m not in sys.stdlib_module_names]
        assert not missing, (page.name, missing, install)


def test_readme_and_quickstart_share_one_install_text_and_its_extras_exist():
    """One install text for README and quickstart (they differed: unpinned torch vs 2.13.0, . vs .[peft]); every extra
    they name is an extra of pyproject.toml."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    texts = [[line for line in (root / page).read_text().splitlines() if line.startswith("pip install")]
             for page in ("README.md", "docs/quickstart.md")]
    readme = [line for line in texts[0] if "[docs]" not in line]  # README's docs section installs the docs extra
    assert readme == texts[1] and len(readme) == 2, texts
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.findall(r"\[([a-z0-9,]+)\]", readme[1])[0].split(",") + re.findall(r"extras: (.*)$", readme[1])[0].replace(
        "plot (matplotlib: plan --timeline, verify --plot)", "plot").split(", ")
    assert {n.strip() for n in named} <= set(extras), (named, sorted(extras))


def test_fresh_install_check_reads_the_readme_install_lines_and_every_snippet():
    """scripts/fresh_install_check.py (CI's fresh-venv phase) runs the README's own install lines: its --dry-run
    names exactly the README's pip lines (read here with a plain filter of the page) and a snippet count per page."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    proc = hang_bound.run([sys.executable, str(root / "scripts" / "fresh_install_check.py"), "--dry-run"],
                          capture_output=True, text=True, step="fresh_install_check.py --dry-run")
    assert proc.returncode == 0, proc.stderr
    readme = [re.split(r"\s+#", line)[0].strip() for line in (root / "README.md").read_text().splitlines()
              if line.startswith("pip install") and "[docs]" not in line]
    listed = [line.strip() for line in proc.stdout.splitlines()[1:1 + len(readme)]]
    assert listed == readme, (listed, readme)
    assert re.search(r"README\.md \([1-9]\d* python snippets\), docs/quickstart\.md \([1-9]\d* python snippets\)",
                     proc.stdout), proc.stdout
    assert "--timeline" in proc.stdout


def test_verify_model_with_a_malicious_pickle_is_one_line_and_never_runs_it(tmp_path, capsys):
    """A model folder whose pytorch_model.bin unpickles os.system: torch.load(weights_only=True) refuses it; verify
    says so in one line (was UnpicklingError's traceback; 4.57 wraps it in an OSError about TF checkpoints) and the
    payload never ran."""
    import torch
    from transformers import LlamaConfig

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "evil"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(folder)
    torch.save({"x": Evil()}, folder / "pytorch_model.bin")
    assert main(["verify", "--model", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "its weights file is a pickle that holds more than tensors" in err and "posix.system" in err, err
    assert not marker.exists()


# ------------------------------------------------------------------ issue 50: settings that do nothing where they are
# A setting that does nothing in the combination given is refused in one line naming the key, its value, why and the
# fix (the rule optimizer.* follows), from the library (a file, and the dict) and config check / launch alike; what
# depends on the model or the trainer, before the first optimizer step. Each path that reads the setting was read:
# aux_bias_rate only under aux_loss: bias; the router-loss conventions and the lean head inside the loss fix only;
# packing.balance where a packed dataset's rows are dealt; cp_balance where packed rows are split over cp > 1 ranks.

SILENT_CASES = [  # (id, section, key fragment, fragment)
    ("aux_bias_rate under micro", {"loss": {"aux_bias_rate": 0.01}},
     "hf_gradfix.loss.aux_bias_rate: invalid value 0.01", "aux_loss: micro would ignore it"),
    ("aux_bias_rate under global", {"loss": {"aux_loss": "global", "aux_bias_rate": 0.01}},
     "hf_gradfix.loss.aux_bias_rate: invalid value 0.01", "aux_loss: global would ignore it"),
    ("bias at rate 0", {"loss": {"aux_loss": "bias", "aux_bias_rate": 0.0}},
     "hf_gradfix.loss.aux_bias_rate: invalid value 0", "never moves the router biases"),
    ("global with the loss fix off", {"loss": {"enabled": False, "aux_loss": "global"}},
     "hf_gradfix.loss.aux_loss: invalid value 'global'", "loss.enabled: false turns off"),
    ("bias with the loss fix off", {"loss": {"enabled": False, "aux_loss": "bias"}},
     "hf_gradfix.loss.aux_loss: invalid value 'bias'", "set loss.enabled: true or remove aux_loss"),
    ("lean head with the loss fix off", {"loss": {"enabled": False, "head": "lean"}},
     "hf_gradfix.loss.head: invalid value 'lean'", "loss.enabled: false turns off"),
    ("balance compute with packing off", {"packing": {"balance": "compute"}},
     "hf_gradfix.packing.balance: invalid value 'compute'", "set packing.enabled: true or remove balance"),
    ("balance compute with rl_forwards only", {"packing": {"rl_forwards": True, "balance": "compute"}},
     "hf_gradfix.packing.balance: invalid value 'compute'", "not dataset rows"),
    ("long_documents on the section's cp 1 mesh", {"parallel": {"dp_shard": 2, "cp_balance": "long_documents"}},
     "hf_gradfix.parallel.cp_balance: invalid value 'long_documents'", "this section's mesh has cp: 1"),
]

#: the same keys where they act: accepted (the control)
ACTING_CASES = [
    {"loss": {"aux_loss": "bias", "aux_bias_rate": 0.01}},
    {"loss": {"enabled": False, "aux_loss": "as_is", "on_nonfinite": "skip"}},  # as_is is stock; on_nonfinite acts
    {"packing": {"enabled": True, "balance": "compute"}},
    {"parallel": {"cp_balance": "long_documents"}},  # a dict: cp may come from the launch, decided on the trainer
]


@pytest.mark.parametrize("name, section, key_fragment, fragment", SILENT_CASES, ids=[c[0] for c in SILENT_CASES])
def test_a_setting_that_does_nothing_here_is_one_line(tmp_path, capsys, name, section, key_fragment, fragment):
    path = _write(tmp_path, {**BASE, "hf_gradfix": section})
    _same_everywhere(path, capsys, [key_fragment, fragment])
    with pytest.raises(ConfigError) as info:  # the dict path of the library (patch(dict), GradFixCallback(dict))
        load_config(section)
    assert str(info.value).startswith(key_fragment) and fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("section", ACTING_CASES, ids=lambda s: str(s))
def test_the_same_settings_where_they_act_are_accepted(section):
    load_config(section)


def test_long_documents_is_refused_where_the_launch_has_cp_1(tmp_path, capsys):
    """cp from the file's accelerate keys: cp 1 refused by the library and config check / launch alike; accelerate's
    parallelism_config_cp_size: 2 is accepted (the control)."""
    section = {"parallel": {"cp_balance": "long_documents"}, "packing": {"enabled": True}}
    path = _write(tmp_path, {**BASE, "hf_gradfix": section})
    _same_everywhere(path, capsys, ["hf_gradfix.parallel.cp_balance: invalid value 'long_documents'",
                                    "the launch this file describes has cp 1"])
    gpu = {k: v for k, v in BASE.items() if k != "use_cpu"}
    path = _write(tmp_path, {**gpu, "distributed_type": "MULTI_GPU",
                             "parallelism_config": {"parallelism_config_cp_size": 2}, "hf_gradfix": section})
    assert load_config(path).parallel.cp_balance == "long_documents"
    assert main(["config", "check", path]) == 0
    assert "cp_balance: long_documents" in capsys.readouterr().out


def _plain_trainer(model=None, **args):
    import harness as H

    model = model if model is not None else H.build_model("llama")
    return H.make_trainer(model, H.make_samples("causal", n=8, seed=1), "causal",
                          extra_args={"max_steps": 1, "per_device_train_batch_size": 2, **args})


def _refused_at_construction(config, fragments):
    import hf_gradfix
    from hf_gradfix.errors import GradFixError

    for how in ("patch", "callback"):
        if how == "patch":
            hf_gradfix.patch(config)
        try:
            with pytest.raises(GradFixError) as info:
                if how == "patch":
                    _plain_trainer()
                else:
                    import harness as H

                    H.make_trainer(H.build_model("llama"), H.make_samples("causal", n=4),
                                   "causal", callbacks=[hf_gradfix.GradFixCallback(config)])
        finally:
            hf_gradfix.unpatch()
        message = str(info.value)
        assert "\n" not in message and all(f in message for f in fragments), (how, message)


def test_rl_forwards_on_a_trainer_without_trl_forwards_is_one_line():
    """packing.rl_forwards packs TRL GRPO / RLOO log-prob forwards: on a plain Trainer it would do nothing (it was
    silent); refused when the trainer is built, by patch() and GradFixCallback alike. Control: the same trainer
    without it is built and fixed."""
    import hf_gradfix

    _refused_at_construction({"packing": {"rl_forwards": True}},
                             ["hf_gradfix.packing.rl_forwards: invalid value True", "Trainer has not",
                              "remove packing.rl_forwards"])
    hf_gradfix.patch({})
    try:
        assert hf_gradfix.state_of(_plain_trainer()) is not None
    finally:
        hf_gradfix.unpatch()


def test_long_documents_on_a_trainer_without_cp_is_one_line():
    """A dict cannot know the launch's cp: the trainer's mesh decides, at construction (cp 1: refused)."""
    _refused_at_construction({"parallel": {"cp_balance": "long_documents"}},
                             ["hf_gradfix.parallel.cp_balance: invalid value 'long_documents'",
                              "this trainer's mesh has cp 1 (no parallel mesh)"])


@pytest.mark.parametrize("conv", ["global", "previous", "none"])
def test_a_router_loss_convention_on_a_model_without_router_loss_is_one_line(conv):
    """aux_loss: global / previous / none on a MoE model with output_router_logits=False (no router loss to act on) trained
    as if nothing was asked; refused on the first batch, before any optimizer step, weights untouched. Control: the
    same model with output_router_logits=True trains its step."""
    import harness as H

    import hf_gradfix
    from hf_gradfix.errors import GradFixError

    hf_gradfix.patch({"loss": {"aux_loss": conv}, "log_fixes": False})
    try:
        model = H.build_moe("qwen3_moe")
        model.config.output_router_logits = False
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = _plain_trainer(model)
        with pytest.raises(GradFixError) as info:
            trainer.train()
        message = str(info.value)
        assert "\n" not in message and f"hf_gradfix.loss.aux_loss: invalid value {conv!r}" in message, message
        assert "output_router_logits=True" in message and "remove aux_loss" in message, message
        assert trainer.state.global_step == 0
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        control = _plain_trainer(H.build_moe("qwen3_moe"))
        control.train()
        assert control.state.global_step == 1
    finally:
        hf_gradfix.unpatch()
