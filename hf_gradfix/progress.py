"""Progress lines for commands that run for minutes (``hf-gradfix verify``, ``hf-gradfix plan``).

A command that can run long says so from its first second and never goes quiet for long: one line per phase, each
stamped with the seconds since the command started, and a heartbeat thread that repeats the running phase ("still
...") whenever nothing was said for ``interval`` seconds (a user's script importing its libraries, a reference
computation, a simulation). Lines go to the plugin's log (stderr, rank 0 only under a launch: ``hf_gradfix``'s
handler), so ``--json`` output on stdout stays clean.

API (``name`` is the command, e.g. ``"verify"``)::

    from hf_gradfix.progress import Progress, report

    with Progress("verify") as progress:         # clock starts, heartbeat on; nested sessions reuse the outer one
        progress.phase("running train.py ...")   # "[hf_gradfix] INFO: verify: [0.0 s] running train.py ..."
        ...                                      # every <= 15 s of silence: "verify: [15.0 s] still running train.py ..."
        report("verify", "reference step 1/2")   # from code that has no handle: the active session's line (or a plain
                                                 # one when no session is open), the phase unchanged
        report("verify", "the reference ...", phase=True)   # the same, and the heartbeat now repeats this phase

>>> lines, now = [], [0.0]
>>> with Progress("demo", emit=lines.append, clock=lambda: now[0], heartbeat=False) as p:
...     p.phase("loading ...")
...     now[0] = 2.5
...     p.line("loaded")
>>> lines
['demo: [0.0 s] loading ...', 'demo: [2.5 s] loaded']
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["Progress", "report", "active", "HEARTBEAT_S"]

#: Seconds of silence after which the heartbeat repeats the running phase (a line at most every ~16 s: the thread
#: checks once a second).
HEARTBEAT_S = 15.0

_log = logging.getLogger("hf_gradfix")
_sessions: dict[str, "Progress"] = {}
_lock = threading.Lock()


def _log_line(text: str) -> None:
    _log.info("%s", text)


class Progress:
    """One command's progress: ``phase`` and ``line`` print at once with the elapsed seconds; inside ``with``, a
    daemon thread prints ``still <phase>`` after ``interval`` seconds without a line. ``emit`` (default: the plugin's
    log at INFO) and ``clock`` (default ``time.monotonic``) are for tests; ``heartbeat=False`` runs no thread."""

    def __init__(self, name: str, *, interval: float = HEARTBEAT_S, emit: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat: bool = True, tick: float | None = None):
        self.name, self.interval, self.clock = name, float(interval), clock
        self.emit = emit or _log_line
        self.heartbeat = heartbeat
        self.tick = tick if tick is not None else min(1.0, self.interval / 4)
        self.start = clock()
        self.last = self.start
        self.current: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outer: Progress | None = None
        self._say = threading.Lock()

    # -- lines
    def elapsed(self) -> float:
        return self.clock() - self.start

    def line(self, text: str) -> None:
        """Say ``text`` now, stamped with the elapsed seconds (the running phase is unchanged)."""
        with self._say:
            self.last = self.clock()
            self.emit(f"{self.name}: [{self.last - self.start:.1f} s] {text}")

    def phase(self, text: str) -> None:
        """A new phase: said now, and repeated by the heartbeat (``still ...``) while it runs silently."""
        self.current = text
        self.line(text)

    def beat(self) -> bool:
        """One heartbeat check (the thread's, every ``tick`` s): ``still <phase>`` when the phase has been silent for
        ``interval`` seconds; True when it spoke. The longest silence is therefore ``interval + tick`` (16 s)."""
        if self.current is not None and self.clock() - self.last >= self.interval:
            self.line(f"still {self.current}")
            return True
        return False

    def _beat(self) -> None:
        while not self._stop.wait(self.tick):
            self.beat()

    # -- session
    def __enter__(self) -> "Progress":
        with _lock:
            outer = _sessions.get(self.name)
            if outer is not None:  # a nested session (verify_trainer under the CLI's): the outer one speaks
                self._outer = outer
                return outer
            _sessions[self.name] = self
        if self.heartbeat:
            self._thread = threading.Thread(target=self._beat, name=f"hf_gradfix-{self.name}-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._outer is not None:
            self._outer = None
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with _lock:
            if _sessions.get(self.name) is self:
                del _sessions[self.name]


def active(name: str) -> Progress | None:
    """The open session of command ``name``, or None."""
    return _sessions.get(name)


def report(name: str, text: str, *, phase: bool = False) -> None:
    """A progress line of command ``name`` from code that holds no session: through the open one (stamped, and with
    ``phase`` the heartbeat's new phase), else a plain log line.

    >>> report("demo", "no session open: a plain line")
    """
    session = active(name)
    if session is None:
        _log.info("%s: %s", name, text)
    elif phase:
        session.phase(text)
    else:
        session.line(text)
