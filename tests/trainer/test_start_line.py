"""Issue 39: the start line a user sees, read from a real run's stderr (tqdm bar on, as `python train.py` shows it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hang_bound

HERE = Path(__file__).parents[1] / "support"
PREFIX = "[hf_gradfix] INFO: hf_gradfix (patch(); settings from: defaults)"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("HF_GRADFIX_CONFIG", None)
    return env


def _stderr_of(mode: str) -> str:
    done = hang_bound.run([sys.executable, str(HERE / "start_line_run.py"), mode], capture_output=True, text=True,
                          env=_env(), step="start line run (captured)")
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


def _terminal_output_of(mode: str) -> str:
    """The run's output as a terminal receives it: stdout and stderr on a pseudo-terminal (160 columns)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, str(HERE / "start_line_run.py"), mode], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the child's side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert hang_bound.wait(proc, step="start line run on a terminal") == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")


def _screen(raw: str) -> list[str]:
    """What a terminal shows: carriage returns overwrite the line from its first column, ANSI escapes dropped."""
    import re

    lines, col = [[]], 0
    for ch in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw):
        if ch == "\n":
            lines.append([])
            col = 0
        elif ch == "\r":
            col = 0
        else:
            line = lines[-1]
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(line).rstrip() for line in lines]


def test_start_line_shows_above_the_progress_bar_on_a_terminal():
    """On a terminal the bar is cleared, the line written and the bar redrawn below it: nothing of the bar above."""
    screen = _screen(_terminal_output_of("override"))
    starts = [i for i, line in enumerate(screen) if line.startswith(PREFIX)]
    bars = [i for i, line in enumerate(screen) if "%|" in line]
    assert len(starts) == 1 and bars, "\n".join(screen[-40:])
    assert starts[0] < bars[0], "\n".join(screen[-40:])
    # control: the same screen for a line that only ends the bar's line first (a file's way) shows the bar above
    old = _screen("  0%|          | 0/4 [00:00<?, ?it/s]\r\n" + PREFIX + " on X.\r\n 25%|##   | 1/4\r 50%|#### | 2/4")
    assert "%|" in old[0] and old[1].startswith(PREFIX)


def test_start_line_of_a_stock_wrong_run_names_the_fix():
    line = _start_line(_stderr_of("override"))
    assert "Fixes: " in line and "_MeanOfMeansTrainer.compute_loss ignores num_items_in_batch" in line, line
    assert "rescaling its per-micro-batch mean" in line.split("Already exact")[0], line
