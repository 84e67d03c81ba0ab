"""What the CLI may open: a regular file. A named pipe blocks ``open()`` until a writer comes (``config check`` on a
FIFO hung), a device never ends (``/dev/zero``); both are refused before opening, with what the path is.

>>> not_a_regular_file("/dev/null")
'is a character device'
>>> not_a_regular_file(__file__) is None
True
"""

from __future__ import annotations

import os
import stat

__all__ = ["not_a_regular_file"]


def not_a_regular_file(path: str | os.PathLike) -> str | None:
    """None for a regular file (or a path that does not exist: the caller's own "not found" applies), else what the
    path is, e.g. ``"is a named pipe (FIFO)"``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot be inspected ({type(err).__name__}: {err})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "is a folder"), (stat.S_ISFIFO, "is a named pipe (FIFO)"),
             (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"), (stat.S_ISSOCK, "is a socket"))
    return next((what for test, what in kinds if test(mode)), "is not a regular file")
