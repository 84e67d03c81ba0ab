"""Tests of hf_gradfix.config: sources, precedence, strict validation, readable errors."""

from __future__ import annotations

import dataclasses
import doctest
import pathlib
import subprocess
import sys
import textwrap
import typing
from dataclasses import dataclass, field

import pytest

import hf_gradfix.config as config_pkg
from hf_gradfix.config import (
    ENV_VAR,
    ConfigError,
    GradFixConfig,
    LossConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from hf_gradfix.config import loader as loader_mod
from hf_gradfix.config import schema as schema_mod

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
hf_gradfix:
  loss:
    count_rule: shifted
    on_undetermined: error
  log_fixes: false
"""


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def write(tmp_path: pathlib.Path, text: str, name: str = "cfg.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(source) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return str(info.value)


# ----------------------------------------------------------------------------- sources


def test_defaults():
    cfg = load_config()
    assert cfg == GradFixConfig()
    assert cfg.loss == LossConfig()
    assert cfg.loss.enabled is True
    assert cfg.loss.count_rule == "auto"
    assert cfg.loss.eval_token_mean is True
    assert cfg.loss.on_undetermined == "warn"
    assert cfg.loss.aux_loss == "micro"
    assert cfg.log_fixes is True
    assert config_from_dict({}) == GradFixConfig()
    assert config_from_dict(None) == GradFixConfig()


def test_env_var_empty_means_defaults(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "  ")
    assert load_config() == GradFixConfig()


def test_dict_section():
    cfg = load_config({"loss": {"count_rule": "shifted", "enabled": False}, "log_fixes": False})
    assert cfg.loss.count_rule == "shifted"
    assert cfg.loss.enabled is False
    assert cfg.loss.eval_token_mean is True  # untouched -> default
    assert cfg.log_fixes is False


def test_dict_with_hf_gradfix_key_ignores_other_keys():
    cfg = load_config({"distributed_type": "MULTI_GPU", "num_processes": 8, "hf_gradfix": {"loss": {"aux_loss": "as_is"}}})
    assert cfg.loss.aux_loss == "as_is"
    assert load_config({"num_processes": 8, "hf_gradfix": None}) == GradFixConfig()


def test_null_nested_section_means_defaults():
    assert load_config({"loss": None}) == GradFixConfig()


def test_dataclass_instance_is_validated_and_copied():
    given = GradFixConfig(loss=LossConfig(count_rule="elements"), log_fixes=False)
    cfg = load_config(given)
    assert cfg == given
    assert cfg is not given and cfg.loss is not given.loss


def test_nested_dataclass_instance_inside_dict():
    cfg = load_config({"loss": LossConfig(count_rule="unshifted")})
    assert cfg.loss == LossConfig(count_rule="unshifted")


def test_invalid_dataclass_instance_rejected():
    bad = GradFixConfig(loss=LossConfig(count_rule="shift"))  # dataclasses do not check types
    msg = error_of(bad)
    assert "hf_gradfix.loss.count_rule" in msg and "did you mean 'shifted'?" in msg


def test_yaml_file_with_accelerate_keys(tmp_path):
    path = write(tmp_path, ACCELERATE_YAML)
    cfg = load_config(path)  # os.PathLike
    assert cfg.loss.count_rule == "shifted"
    assert cfg.loss.on_undetermined == "error"
    assert cfg.log_fixes is False
    assert load_config(str(path)) == cfg  # str path


def test_standalone_yaml_file(tmp_path):
    path = write(
        tmp_path,
        """\
        loss:
          count_rule: unshifted
          eval_token_mean: false
        """,
    )
    cfg = load_config(path)
    assert cfg.loss.count_rule == "unshifted"
    assert cfg.loss.eval_token_mean is False
    assert cfg.log_fixes is True


@pytest.mark.parametrize(
    "text",
    ["", "# only a comment\n", "hf_gradfix:\n", "num_processes: 2\nhf_gradfix: null\n"],
)
def test_empty_yaml_gives_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == GradFixConfig()


def test_env_var(tmp_path, monkeypatch):
    path = write(tmp_path, ACCELERATE_YAML)
    monkeypatch.setenv(ENV_VAR, str(path))
    cfg = load_config()
    assert cfg.loss.count_rule == "shifted"
    # An explicit source wins over the environment variable.
    assert load_config({}) == GradFixConfig()


def test_env_var_missing_file(tmp_path, monkeypatch):
    missing = tmp_path / "nope.yaml"
    monkeypatch.setenv(ENV_VAR, str(missing))
    msg = error_of(None)
    assert ENV_VAR in msg and str(missing) in msg and "not found" in msg


def test_env_var_file_with_bad_value_names_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(write(tmp_path, "log_fixes: maybe\n")))
    msg = error_of(None)
    assert "hf_gradfix.log_fixes" in msg and ENV_VAR in msg


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key_suggests_closest():
    msg = error_of({"log_fix": True})
    assert msg.startswith("hf_gradfix.log_fix: unknown key")
    assert "'loss', 'packing', 'optimizer', 'parallel', 'log_fixes'" in msg  # allowed keys at that level
    assert "did you mean 'log_fixes'?" in msg


def test_unknown_nested_key_suggests_closest():
    msg = error_of({"loss": {"count_rul": "shifted"}})
    assert msg.startswith("hf_gradfix.loss.count_rul: unknown key")
    for key in ("enabled", "count_rule", "eval_token_mean", "on_undetermined", "aux_loss"):
        assert repr(key) in msg
    assert "did you mean 'count_rule'?" in msg


def test_unknown_key_in_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "num_processes: 2\nhf_gradfix:\n  loss:\n    count_rul: shifted\n")
    msg = error_of(path)
    assert f"{path}:4:" in msg
    assert "hf_gradfix.loss.count_rul" in msg and "did you mean 'count_rule'?" in msg


def test_accelerate_file_without_section_gets_hint(tmp_path):
    path = write(tmp_path, "compute_environment: LOCAL_MACHINE\nnum_processes: 2\n")
    msg = error_of(path)
    assert "accelerate" in msg and "hf_gradfix:" in msg


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config({"loss": {"count_rul": "x", "enabled": "no"}, "log_fixes": 0})
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems")


# ----------------------------------------------------------------------------- bad values


def test_bad_literal_value_message():
    msg = error_of({"loss": {"count_rule": "shift"}})
    assert msg == (
        "hf_gradfix.loss.count_rule: invalid value 'shift'; allowed values: "
        "'auto', 'shifted', 'unshifted', 'elements' (did you mean 'shifted'?)"
    )


def test_literal_value_is_case_sensitive_with_hint():
    msg = error_of({"loss": {"on_undetermined": "WARN"}})
    assert "did you mean 'warn'?" in msg


def test_yaml_bool_for_literal_gets_quote_hint(tmp_path):
    msg = error_of(write(tmp_path, "loss:\n  on_undetermined: no\n"))
    assert "hf_gradfix.loss.on_undetermined" in msg and "quote" in msg


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, 1.0])
def test_bad_bool(value):
    msg = error_of({"log_fixes": value})
    assert msg.startswith("hf_gradfix.log_fixes: invalid value")
    assert repr(value) in msg and "expected a bool" in msg


def test_bad_nested_bool_from_yaml(tmp_path):
    msg = error_of(write(tmp_path, "loss:\n  enabled: 'yes'\n"))
    assert "hf_gradfix.loss.enabled" in msg and "'yes'" in msg and ":2:" in msg


@pytest.mark.parametrize("value", ["shifted", 3, ["a"]])
def test_section_given_as_non_mapping(value):
    msg = error_of({"loss": value})
    assert msg.startswith("hf_gradfix.loss: expected a mapping")


def test_a_bool_switches_a_section_with_an_enabled_key():
    assert load_config({"packing": True}).packing.enabled is True
    assert load_config({"loss": False}).loss.enabled is False
    assert load_config({"packing": True}).packing.token_budget == 4096


def test_top_level_non_mapping(tmp_path):
    assert "top level" in error_of(write(tmp_path, "- a\n- b\n"))
    assert "hf_gradfix" in error_of({"hf_gradfix": "on"})


def test_non_string_key():
    assert "not a string" in error_of({1: True})


def test_unsupported_source_type():
    with pytest.raises(ConfigError) as info:
        load_config(42)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    for word in ("GradFixConfig", "dict", "path"):
        assert word in msg


# ----------------------------------------------------------------------------- file errors


def test_missing_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    msg = error_of(missing)
    assert str(missing) in msg and "not found" in msg


def test_directory_instead_of_file(tmp_path):
    assert "directory" in error_of(tmp_path)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "hf_gradfix:\n  loss:\n    count_rule: [shifted\n  log_fixes: true\n")
    msg = error_of(path)
    assert str(path) in msg
    assert "invalid YAML" in msg and "line 4" in msg


def test_yaml_tab_indentation(tmp_path):
    path = write(tmp_path, "loss:\n\tcount_rule: shifted\n")
    msg = error_of(path)
    assert "line 2" in msg and "tabs" in msg


def test_duplicate_key_in_section(tmp_path):
    path = write(tmp_path, "hf_gradfix:\n  loss:\n    count_rule: shifted\n    count_rule: auto\n")
    msg = error_of(path)
    assert "duplicate" in msg and "hf_gradfix.loss.count_rule" in msg and f"{path}:4:" in msg


# ----------------------------------------------------------------------------- round trip, schema


def test_round_trip():
    cfg = GradFixConfig(
        loss=LossConfig(enabled=False, count_rule="elements", eval_token_mean=False, on_undetermined="warn", aux_loss="as_is"),
        log_fixes=False,
    )
    d = config_to_dict(cfg)
    assert d == {
        "loss": {
            "enabled": False,
            "count_rule": "elements",
            "eval_token_mean": False,
            "on_undetermined": "warn",
            "aux_loss": "as_is",
            "aux_bias_rate": 0.001,
            "head": "stock",
            "on_nonfinite": "warn",
        },
        "packing": {"enabled": False, "token_budget": 4096, "mode": "varlen", "attention": "auto", "guard": True,
                    "balance": "tokens", "buffer_size": 1000, "rl_forwards": False},
        "optimizer": {
            "name": "none", "targets": None, "exclude": [], "rank": None, "update_proj_gap": 200, "scale": None,
            "proj_side": "auto", "proj_method": "auto", "on_switch": "keep", "min_size": 0, "stagger": False,
            "scale_type": None, "seed": 0, "lowrank_grads": False, "initial_basis": "accumulated",
        },
        "parallel": {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, "pp": 1, "ep": 1, "pp_schedule": "1f1b", "pp_virtual_stages": 1,
                     "cp_balance": "per_document", "cp_balance_threshold": None},
        "log_fixes": False,
    }
    assert type(d["loss"]) is dict
    assert config_from_dict(d) == cfg
    assert config_from_dict(config_to_dict(GradFixConfig())) == GradFixConfig()


def test_optimizer_section_bounds_and_values():
    assert "optimizer.update_proj_gap: invalid value 0; it must be >= 1" in error_of({"optimizer": {"update_proj_gap": 0}})
    assert "optimizer.rank: invalid value -2; it must be >= 1" in error_of({"optimizer": {"rank": -2}})
    msg = error_of({"optimizer": {"name": "galore"}})
    assert "optimizer.name: invalid value 'galore'" in msg and "did you mean 'galore_adamw'" in msg
    cfg = config_from_dict({"optimizer": {"name": "apollo_mini", "targets": ["attn", "mlp"]}})
    assert cfg.optimizer.targets == ["attn", "mlp"] and cfg.optimizer.rank is None


def test_round_trip_through_yaml_file(tmp_path):
    import yaml

    cfg = GradFixConfig(loss=LossConfig(count_rule="unshifted"), log_fixes=False)
    path = tmp_path / "dump.yaml"
    path.write_text(yaml.safe_dump({"num_processes": 2, "hf_gradfix": config_to_dict(cfg)}), encoding="utf-8")
    assert load_config(path) == cfg


def test_config_to_dict_rejects_non_dataclass():
    with pytest.raises(TypeError):
        config_to_dict({"loss": {}})


@dataclass
class OptimConfig:  # stand-in for a future section (module level so its hints resolve)
    fused: bool = False
    lr_scale: float = 1.0
    steps: int = 1
    groups: list[str] = field(default_factory=list)
    mode: typing.Optional[typing.Literal["a", "b"]] = None


@dataclass
class Extended(GradFixConfig):
    optim: OptimConfig = field(default_factory=OptimConfig)


def test_new_section_gets_validation_for_free():
    """A future section (packing, optim, ...) is validated just by being a dataclass field."""
    build = loader_mod._build_root
    cfg = build(Extended, {"optim": {"lr_scale": 2, "steps": 3, "groups": ["x"], "mode": "b"}})
    assert cfg.optim == OptimConfig(lr_scale=2.0, steps=3, groups=["x"], mode="b")
    assert isinstance(cfg.optim.lr_scale, float)
    assert build(Extended, {"optim": {"mode": None}}).optim.mode is None
    with pytest.raises(ConfigError, match=r"hf_gradfix\.optim\.steps: invalid value True; expected an int"):
        build(Extended, {"optim": {"steps": True}})
    with pytest.raises(ConfigError, match=r"hf_gradfix\.optim\.lr_scale: invalid value '1e-5'"):
        build(Extended, {"optim": {"lr_scale": "1e-5"}})
    with pytest.raises(ConfigError, match=r"hf_gradfix\.optim\.groups\[1\]: invalid value 2; expected a string"):
        build(Extended, {"optim": {"groups": ["x", 2]}})
    with pytest.raises(ConfigError, match=r"did you mean 'fused'\?"):
        build(Extended, {"optim": {"fuse": True}})
    # An instance of the subclass keeps its type through load_config.
    assert type(load_config(Extended())) is Extended


def test_schema_uses_only_supported_types():
    """Every field of every section has a type the generic validator understands."""

    def walk(cls, path=()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, path + (f.name,))
            # Validating the default must succeed (raises TypeError for unsupported types).
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            v = loader_mod._Validator()
            assert v.convert(tp, default, path + (f.name,)) is not loader_mod._INVALID, v.problems
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"

    walk(GradFixConfig)


def test_public_api():
    assert set(config_pkg.__all__) >= {
        "GradFixConfig", "LossConfig", "ConfigError", "load_config", "config_from_dict", "config_to_dict", "ENV_VAR",
    }
    assert ENV_VAR == "HF_GRADFIX_CONFIG"
    assert issubclass(ConfigError, ValueError)


def test_docstring_examples_run():
    for module in (config_pkg, loader_mod, schema_mod):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__


def test_imports_no_heavy_dependencies():
    code = (
        "import sys, hf_gradfix.config as c; c.load_config({'loss': {'count_rule': 'shifted'}}); "
        "bad = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_a_long_list_of_problems_is_capped_with_a_count(tmp_path, capsys):
    """40,000 unknown keys are not 40,000 lines: the first 20 problems, then how many more (library and CLI)."""
    import yaml

    from hf_gradfix.cli import main
    from hf_gradfix.config.loader import MAX_LISTED_PROBLEMS
    from hf_gradfix.config.resolve import resolve_config

    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump({"hf_gradfix": {"loss": {f"key{i}": 1 for i in range(500)}}}))
    with pytest.raises(ConfigError) as err:
        resolve_config(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"500 problems in {path}:" and len(lines) == 1 + MAX_LISTED_PROBLEMS + 1
    assert lines[-1].startswith(f"  ... and {500 - MAX_LISTED_PROBLEMS} more problems")
    assert len(err.value.problems) == 500  # the full list stays on the exception
    assert main(["config", "check", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == len(lines)
