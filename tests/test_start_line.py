"""Issue 39: the start line a user sees, read from a real run's stderr (tqdm bar on, as `python train.py` shows it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PREFIX = "[hf_gradfix] INFO: hf_gradfix (patch(); settings from: defaults)"


def _stderr_of(mode: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("HF_GRADFIX_CONFIG", None)
    done = subprocess.run([sys.executable, str(HERE / "start_line_run.py"), mode], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _start_line(err: str) -> str:
    # on a line of its own: a filter on the line's start (grep '^\[hf_gradfix\]') finds it, and only once
    lines = [line for line in err.split("\n") if line.startswith(PREFIX)]
    assert len(lines) == 1, err[-3000:]
    # control: the bar really was drawn before it (without the line break the line would continue the bar's line)
    assert "0%|" in err[: err.index(PREFIX)], err[-3000:]
    return lines[0]


def test_start_line_of_a_stock_exact_trl_sft_run_says_unchanged():
    pytest.importorskip("trl")
    line = _start_line(_stderr_of("sft"))
    assert "Already exact, unchanged" in line and "SFTTrainer.compute_loss honours num_items_in_batch" in line, line
    assert "Fixes:" not in line, line


def test_start_line_of_a_stock_wrong_run_names_the_fix():
    line = _start_line(_stderr_of("override"))
    assert "Fixes: " in line and "_MeanOfMeansTrainer.compute_loss ignores num_items_in_batch" in line, line
    assert "rescaling its per-micro-batch mean" in line.split("Already exact")[0], line
