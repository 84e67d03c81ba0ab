"""Third-party warnings that hf_gradfix knows to be harmless on its own paths, explained in place, once.

A user reading "Gradient accumulation steps mismatch" or "does not expose input embeddings. Gradients cannot flow
back..." cannot tell that the run is fine; hf_gradfix can, on the paths it set up itself. Each explanation is a
logging filter on the emitting library's logger that appends a bracketed note to the first matching record of the
process (the record is kept, never dropped: the library's own words stay). A path installs its explanation when it
is set up (:func:`explain`, idempotent); :func:`forget_all` (called by ``hf_gradfix.unpatch()``) takes every one
off. Logging filters are the one public door these libraries give: their messages are not otherwise hookable.

>>> import logging
>>> explain("demo.library", "looks alarming", " [hf_gradfix: expected here]")
>>> record = logging.LogRecord("demo.library", logging.WARNING, __file__, 1, "this looks alarming", None, None)
>>> _ = logging.getLogger("demo.library").filter(record); record.getMessage()
'this looks alarming [hf_gradfix: expected here]'
>>> forget_all()
"""

from __future__ import annotations

import logging


class _Explanation(logging.Filter):
    """Appends ``note`` to the first record (per process) whose message holds ``fragment``; passes every record."""

    def __init__(self, fragment: str, note: str) -> None:
        super().__init__(f"hf_gradfix.explain:{fragment[:40]}")
        self.fragment, self.note = fragment, note
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.explained:
            message = record.getMessage()
            if self.fragment in message:  # launchers may prefix the message ("[RANK r] "): a substring match
                record.msg, record.args = message + self.note, None
                self.explained = True
        return True


#: (logger name, fragment) -> the installed filter
_installed: dict[tuple[str, str], _Explanation] = {}


def explain(logger_name: str, fragment: str, note: str) -> None:
    """Append ``note`` to the first warning of ``logger_name`` holding ``fragment`` (idempotent per pair)."""
    key = (logger_name, fragment)
    if key not in _installed:
        _installed[key] = _Explanation(fragment, note)
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
