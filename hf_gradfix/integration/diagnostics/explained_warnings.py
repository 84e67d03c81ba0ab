"""Third-party warnings that hf_gradfix knows to be harmless on its own paths, explained in place, once.

A user reading "Gradient accumulation steps mismatch" or "does not expose input embeddings. Gradients cannot flow
back..." cannot tell that the run is fine; hf_gradfix can, on the paths it set up itself. Each explanation is a
logging filter on the emitting library's logger that appends a bracketed note to the first matching record of the
process (the record is kept: the library's own words stay; with ``once_per_run``, a warning every rank of a launch
prints alike is shown by rank 0 only). A path installs its explanation when it
is set up (:func:`explain`, idempotent); :func:`forget_all` (called by ``hf_gradfix.unpatch()``) takes every one
off. Logging filters are the one public door these libraries give: their messages are not otherwise hookable.

>>> import logging
>>> explain("demo.library", "looks alarming", " [hf_gradfix: expected here]")
>>> record = logging.LogRecord("demo.library", logging.WARNING, __file__, 1, "this looks alarming", None, None)
>>> _ = logging.getLogger("demo.library").filter(record); record.getMessage()
'this looks alarming [hf_gradfix: expected here]'
>>> forget_all()

``once_per_run``: rank 0 shows the record (with the note), every other rank of the launch drops it:

>>> import os
>>> explain("demo.library", "every rank says", " [hf_gradfix: once]", once_per_run=True)
>>> record = logging.LogRecord("demo.library", logging.WARNING, __file__, 1, "every rank says this", None, None)
>>> os.environ["RANK"] = "1"; logging.getLogger("demo.library").filter(record)
False
>>> os.environ["RANK"] = "0"; bool(logging.getLogger("demo.library").filter(record)), record.getMessage()
(True, 'every rank says this [hf_gradfix: once]')
>>> del os.environ["RANK"]; forget_all()
"""

from __future__ import annotations

import logging


def _other_rank() -> bool:
    """A launched process other than rank 0, unless every rank's lines are asked for (``HF_GRADFIX_ALL_RANKS=1``)."""
    import os

    raw = os.environ.get("RANK", "0") or "0"
    every = os.environ.get("HF_GRADFIX_ALL_RANKS", "") not in ("", "0")
    return raw.isdigit() and int(raw) != 0 and not every


class _Explanation(logging.Filter):
    """Appends ``note`` to the first record (per process) whose message holds ``fragment``; passes every record, except
    with ``once_per_run`` a matching record on a rank other than 0 (every rank would print the same words)."""

    def __init__(self, fragment: str, note: str, once_per_run: bool = False) -> None:
        super().__init__(f"hf_gradfix.explain:{fragment[:40]}")
        self.fragment, self.note, self.once_per_run = fragment, note, once_per_run
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.explained and not self.once_per_run:
            return True
        message = record.getMessage()
        if self.fragment not in message:  # launchers may prefix the message ("[RANK r] "): a substring match
            return True
        if self.once_per_run and _other_rank():
            return False
        if not self.explained:
            record.msg, record.args = message + self.note, None
            self.explained = True
        return True


#: (logger name, fragment) -> the installed filter
_installed: dict[tuple[str, str], _Explanation] = {}


def explain(logger_name: str, fragment: str, note: str, *, once_per_run: bool = False) -> None:
    """Append ``note`` to the first warning of ``logger_name`` holding ``fragment`` (idempotent per pair);
    ``once_per_run``: under a launch, only rank 0 shows it (a warning every rank prints alike)."""
    key = (logger_name, fragment)
    if key not in _installed:
        _installed[key] = _Explanation(fragment, note, once_per_run)
    target = logging.getLogger(logger_name)
    if _installed[key] not in target.filters:
        target.addFilter(_installed[key])


def installed(logger_name: str, fragment: str) -> _Explanation | None:
    """The explanation on ``logger_name`` for ``fragment`` (None when not installed)."""
    return _installed.get((logger_name, fragment))


def forget_all() -> None:
    """Take every explanation off its logger (``unpatch()``); a later :func:`explain` starts afresh."""
    for (name, _fragment), explanation in _installed.items():
        logging.getLogger(name).removeFilter(explanation)
    _installed.clear()


__all__ = ["explain", "forget_all", "installed"]
