"""The start line: what hf_gradfix changed (or found already exact), logged on a line of its own.

The loss check needs a real batch, so the line is written inside the first training step, after transformers'
ProgressCallback has drawn its tqdm bar (``0%| | 0/10 [...]`` with no newline). On a terminal the bar is cleared,
the line written and the bar redrawn below it (tqdm's own ``external_write_mode``, what ``tqdm.write`` does): the
screen shows the line above the bar. Into a file or pipe (a log) a cleared bar would leave its text and carriage
returns at the start of the line, so there the bar's line is ended first: a filter on ``^[hf_gradfix]`` finds it.
"""

from __future__ import annotations

import logging
import sys


def _tqdm():
    try:  # tqdm is a transformers dependency; without it there is no bar to break
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm


def _open_bars() -> bool:
    tqdm = _tqdm()
    return tqdm is not None and any(not getattr(bar, "disable", False) for bar in list(getattr(tqdm, "_instances", ())))


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def log_on_own_line(logger: logging.Logger, message: str, *args) -> None:
    """``logger.info(message, *args)`` on a line of its own while a tqdm bar is drawn on the stream it writes to:
    above the bar on a terminal (the bar is cleared and redrawn), after the bar's line ended in a file or pipe."""
    if not (_open_bars() and logger.isEnabledFor(logging.INFO)):
        logger.info(message, *args)
        return
    streams = {getattr(h, "stream", None) for h in logger.handlers} or {sys.stderr}
    shared = [stream for stream in streams if stream in (sys.stderr, sys.__stderr__)]  # tqdm's default stream
    if shared and all(_isatty(stream) for stream in shared):
        with _tqdm().external_write_mode(file=shared[0]):
            logger.info(message, *args)
        return
    for stream in shared:
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
