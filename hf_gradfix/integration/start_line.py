"""The start line: what hf_gradfix changed (or found already exact), logged on a line of its own.

The loss check needs a real batch, so the line is written inside the first training step, after transformers'
ProgressCallback has drawn its tqdm bar (``0%| | 0/10 [...]`` with no newline). Written as is, the line would
continue the bar's line and a filter on ``^[hf_gradfix]`` would drop it; so an open bar's line is ended first.
"""

from __future__ import annotations

import logging
import sys


def _open_bars() -> bool:
    try:  # tqdm is a transformers dependency; without it there is no bar to break
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return False
    return any(not getattr(bar, "disable", False) for bar in list(getattr(tqdm, "_instances", ())))


def log_on_own_line(logger: logging.Logger, message: str, *args) -> None:
    """``logger.info(message, *args)``, starting a new line first if a tqdm bar is mid-line on a stream it writes to."""
    if _open_bars() and logger.isEnabledFor(logging.INFO):
        streams = {getattr(h, "stream", None) for h in logger.handlers} or {sys.stderr}
        for stream in streams:
            if stream in (sys.stderr, sys.__stderr__):  # tqdm's default stream; the bar was drawn there
                stream.write("\n")
                stream.flush()
    logger.info(message, *args)


def split_changes(entries: list[str], unchanged_markers: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(changed, unchanged): an entry holding one of ``unchanged_markers`` is what stock already does."""
    unchanged = [e for e in entries if any(m in e for m in unchanged_markers)]
    return [e for e in entries if e not in unchanged], unchanged


def summary(changed: list[str], unchanged: list[str]) -> str:
    """The tail of the start line: 'Fixes: ...' for what hf_gradfix changed, 'already exact, unchanged' otherwise."""
    parts = []
    if changed:
        parts.append("Fixes: " + "; ".join(changed))
    if unchanged:
        parts.append("Already exact, unchanged: " + "; ".join(unchanged))
    if not parts:
        parts.append("Already exact, unchanged")
    return ". ".join(parts)
