"""Issue 39: a notice before the silent minutes of a first DeepSpeed-on-CPU launch (its all-reduce op build)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_gradfix.cli import main
from hf_gradfix.integration.diagnostics.first_run import SHM_OP, extension_build_dir

CONFIG = str(Path(__file__).parents[2] / "configs" / "accelerate" / "cpu_deepspeed.yaml")


@pytest.fixture
def launched(tmp_path, monkeypatch, capsys):
    """``hf-gradfix launch`` as a user types it, with accelerate's launcher replaced by a marker (the op build happens
    in the ranks it would start): returns the launcher's stderr up to and including that marker."""
    import sys

    import accelerate.commands.launch as accelerate_launch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("HF_GRADFIX_CONFIG", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: print("<ranks start>", file=sys.stderr))
    script = tmp_path / "train.py"
    script.write_text("")

    def run() -> str:
        assert main(["launch", "--config_file", CONFIG, str(script)]) == 0
        return capsys.readouterr().err

    return run


def test_first_deepspeed_cpu_launch_announces_the_op_build_before_the_ranks_start(launched, tmp_path):
    err = launched()
    assert "<ranks start>" in err
    before = err[: err.index("<ranks start>")]
    assert f"compiles its shared-memory all-reduce op ({SHM_OP})" in before and "minutes" in before, err
    assert str(tmp_path / "ext" / SHM_OP) in before, err  # where the build is cached


def test_a_cached_op_is_not_announced(launched, tmp_path, monkeypatch):
    # torch.utils.cpp_extension's cache: <TORCH_EXTENSIONS_DIR>/<name>/<name>.so, loaded in seconds when present
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    built = Path(extension_build_dir(SHM_OP))
    assert built == tmp_path / "ext" / SHM_OP
    built.mkdir(parents=True)
    (built / f"{SHM_OP}.so").write_bytes(b"")
    err = launched()
    assert "<ranks start>" in err and SHM_OP not in err, err


def test_build_dir_is_the_one_torch_builds_into(tmp_path, monkeypatch):
    # ground truth: torch.utils.cpp_extension's own (private) rule, with its default root moved under tmp_path
    import torch.utils.cpp_extension as cpp

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp, "get_default_build_root", lambda: str(tmp_path))
    assert extension_build_dir(SHM_OP) == cpp._get_build_directory(SHM_OP, verbose=False)


def test_accelerate_deepspeed_accumulation_line_is_explained_once_and_unpatch_removes_it(capsys):
    """accelerate warns "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has
    N. Using DeepSpeed's value." for every Trainer under DeepSpeed with GA > 1 (transformers' Trainer runs accelerate
    at 1 and fills DeepSpeed's value): the line gets one explanation per process, nothing is hidden, and unpatch()
    takes the explanation off. The wording is read from the installed accelerate (a changed line fails here), and
    the real DeepSpeed runs of tests/parallel/test_deepspeed.py show the explained line beside their exact gradients."""
    import inspect
    import logging

    import accelerate.accelerator as accelerate_accelerator
    from accelerate.logging import get_logger

    import hf_gradfix
    from hf_gradfix.integration.parallel import deepspeed as ds

    source = inspect.getsource(accelerate_accelerator.Accelerator._prepare_deepspeed)
    assert "Gradient accumulation steps mismatch: GradientAccumulationPlugin has" in source
    assert "DeepSpeed config has" in source
    from accelerate.state import PartialState

    PartialState()  # accelerate's logger needs its state
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    from hf_gradfix.integration.diagnostics import explained_warnings

    target = logging.getLogger("accelerate.accelerator")
    keep = Keep()
    target.addHandler(keep)
    explained_warnings.forget_all()
    try:
        line = f"{ds.GA_MISMATCH}4. Using DeepSpeed's value."
        ds.explain_accelerate_warnings()
        ds.explain_accelerate_warnings()  # idempotent
        explainer = explained_warnings.installed(ds.ACCELERATE_LOGGER, ds.GA_MISMATCH)
        assert explainer is not None and target.filters.count(explainer) == 1
        get_logger("accelerate.accelerator").warning(line)
        get_logger("accelerate.accelerator").warning(line)
        # accelerate's adapter may prefix "[RANK 0] "
        assert records[0].endswith(line + ds.GA_MISMATCH_NOTE) and records[1].endswith(line), records
        assert ds.GA_MISMATCH_NOTE not in records[1]
        other = "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 2, DeepSpeed config has 4."
        explainer.explained = False
        get_logger("accelerate.accelerator").warning(other)
        assert records[2].endswith(other) and ds.GA_MISMATCH_NOTE not in records[2]  # not the Trainer's own case
        hf_gradfix.patch()
        hf_gradfix.unpatch()
        assert explainer not in target.filters
    finally:
        target.removeHandler(keep)
        explained_warnings.forget_all()


def test_docstring_examples_run():
    import doctest

    from hf_gradfix.integration.diagnostics import explained_warnings, first_run

    for module in (explained_warnings, first_run):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
