"""``hf-gradfix configs list | show NAME | copy NAME [DEST]``: the configurations installed with the package
(:mod:`hf_gradfix.config.shipped`); wherever a config file is read, a shipped one can be given by name.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from ..errors import InvalidArgumentError


def run(ns: argparse.Namespace) -> int:
    """``hf-gradfix configs list | show NAME | copy NAME [DEST]``."""
    from ..config.shipped import shipped_names, shipped_path

    if ns.configs_command == "list":
        for name, path in shipped_names().items():
            first = next((line.lstrip("# ").strip() for line in path.read_text(encoding="utf-8").splitlines()
                          if line.startswith("#") and line.strip("# ")), "")
            print(f"{name:34s} {first[:90]}")
        return 0
    path = shipped_path(ns.name)
    if path is None:
        raise InvalidArgumentError(f"{ns.name!r}: no shipped configuration of that name; hf-gradfix configs list names "
                                   "them all")
    if ns.configs_command == "show":
        print(path.read_text(encoding="utf-8"), end="")
        return 0
    if not ns.dest.strip():
        raise InvalidArgumentError("DEST is empty; give a file or a folder to copy into (default: this folder)")
    dest = os.path.join(ns.dest, path.name) if os.path.isdir(ns.dest) else ns.dest
    if os.path.lexists(dest):
        raise InvalidArgumentError(f"{dest}: exists; copy refuses to overwrite (give another DEST)")
    folder = os.path.dirname(dest) or "."
    if not os.path.isdir(folder):
        what = f"{folder} is not a folder" if os.path.exists(folder) else f"the folder {folder} does not exist"
        raise InvalidArgumentError(f"{dest}: {what}; give an existing folder, or a file path in one")
    try:
        with open(path, "rb") as src, open(dest, "xb") as out:  # "x": never overwrite, even a file made meanwhile
            shutil.copyfileobj(src, out)
    except OSError as err:  # no permission, a read-only or full disk, a name too long: one line, not a traceback
        raise InvalidArgumentError(f"{dest}: cannot write it ({err.strerror or err}); give another DEST") from None
    print(f"copied {ns.name} to {dest}")
    return 0


def add_parser(sub: Any) -> None:
    """``configs`` and its subcommands, on the top-level parser's subcommands ``sub``."""
    shipped = sub.add_parser("configs", help="the configurations shipped with hf_gradfix: list, show NAME, copy NAME [DEST]",
                             description="The configurations installed with the package. Wherever a config file is "
                             "read, a shipped one can be given by name (e.g. --config_file cpu_pp).")
    shipped_sub = shipped.add_subparsers(dest="configs_command", required=True, metavar="SUBCOMMAND")
    shipped_sub.add_parser("list", help="every shipped configuration by name, with its first comment line")
    show = shipped_sub.add_parser("show", help="print one")
    show.add_argument("name")
    copy = shipped_sub.add_parser("copy", help="copy one into a file or folder to edit it (never overwrites)")
    copy.add_argument("name")
    copy.add_argument("dest", nargs="?", default=".")
