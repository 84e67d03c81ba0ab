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
        (["launch", "--config_file", path, "--num_processes", "0", "x.py"], "--num-processes 0"),
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
        proc = subprocess.run([sys.executable, "-m", "hf_gradfix", *argv], capture_output=True, text=True, env=env, timeout=300)
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
