"""The hf-gradfix command: launch, config check, verify and plan (why launch wraps accelerate launch: in
:mod:`hf_gradfix.commands.launch`).

    hf-gradfix launch --config_file configs/accelerate/cpu_multiprocess.yaml train.py --my-arg 1
    hf-gradfix config check configs/accelerate/fsdp2_tp.yaml --micro-batch 4 --grad-accum 8 --seq-len 4096
    hf-gradfix verify --steps 2 [--json] [--plot errors.png] -- python train.py ARGS
    hf-gradfix plan --model llama-3.1-8b --config run.yaml --seq-len 4096 --micro-batch 2 --gpu h100

Each subcommand is its own module (:mod:`hf_gradfix.commands`: launch, check, configs, env;
:mod:`hf_gradfix.verify.command`; :mod:`hf_gradfix.plan.command`); this entry point builds the top-level parser and
dispatches.

Every error the plugin diagnoses (hf_gradfix.errors.HfGradfixError) is printed as one line,
"hf-gradfix <command>: <what is wrong and the fix>", with exit code 2; a traceback means a bug in the plugin.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .commands import check, configs, env
from .commands.launch import launch
from .config.resolve import ResolvedConfig, resolve_config, split_config  # noqa: F401  (re-exported: documented here)
from .errors import HfGradfixError

__all__ = ["main", "build_parser", "split_config", "resolve_config", "ResolvedConfig"]


_TOP_DESCRIPTION = """\
hf_gradfix: exact loss normalization, packing, low-rank optimizers and ND-parallel meshes for the Hugging Face
Trainer, configured by an hf_gradfix: section in accelerate's YAML. Commands (hf-gradfix COMMAND --help):

  launch        accelerate launch with exactly its arguments; the hf_gradfix: section reaches every rank
  config check  validate a YAML (accelerate's keys and the hf_gradfix: section) and print what it will run
  configs       the shipped configurations: list, show NAME, copy NAME (a name works wherever a file does)
  verify        prove a run exact: configured gradients vs the one-process ground truth
  plan          per-rank memory for a model and a configuration (closed form, --simulate, --suggest)
  env           versions of the stack and the device, for a bug report

A diagnosed error is one line, "hf-gradfix COMMAND: ...", with exit code 2."""

_TOP_EPILOG = """\
examples:
  hf-gradfix config check configs/accelerate/fsdp2_tp.yaml --micro-batch 4 --grad-accum 8 --seq-len 4096
  hf-gradfix launch --config_file configs/accelerate/cpu_multiprocess.yaml train.py --my-arg 1
  hf-gradfix verify --model tiny --grad-accum 4 --steps 2
  hf-gradfix plan --model llama-3.1-8b --config run.yaml --seq-len 4096 --micro-batch 2 --gpu h100"""


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-gradfix`` argument parser (``launch`` and ``plan`` parse their own arguments)."""
    parser = argparse.ArgumentParser(prog="hf-gradfix", description=_TOP_DESCRIPTION, epilog=_TOP_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"hf-gradfix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    env.add_parser(sub)
    configs.add_parser(sub)
    sub.add_parser("launch", help="accelerate launch with a YAML that carries an hf_gradfix: section (same arguments)")
    sub.add_parser("plan", help="per-rank memory for a model and a configuration (closed form, --simulate, --suggest)")
    sub.add_parser("verify", help="prove a run exact: your script's gradients vs the one-process ground truth "
                   "(hf-gradfix verify -- python train.py ARGS)")
    check.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-gradfix`` console script; a diagnosed error is one line and exit code 2.

    >>> main(["config", "check", "configs/does-not-exist.yaml"])
    2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    slips = {"check": "config check", "config-check": "config check", "validate": "config check",
             "configs-list": "configs list", "run": "launch", "train": "launch", "version": "--version"}
    if command in slips:  # the usual slips of accelerate / TRL users, named before argparse's generic error
        print(f"hf-gradfix: {command!r} is not a command; did you mean `hf-gradfix {slips[command]}`? "
              "(hf-gradfix --help lists them)", file=sys.stderr)
        return 2
    if command == "config" and len(argv) > 1 and not argv[1].startswith("-"):
        command = f"config {argv[1]}"
    try:
        if argv and argv[0] == "launch":
            return launch(argv[1:])
        if argv and argv[0] == "verify":
            from .verify.command import verify_main

            return verify_main(argv[1:])
        if argv and argv[0] == "plan":
            from .plan.command import plan_main

            return plan_main(argv[1:])
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.command == "config" and ns.config_command == "check":
            return check.run(ns)
        if ns.command == "configs":
            return configs.run(ns)
        if ns.command == "env":
            return env.run()
        parser.error("unknown command")
    except HfGradfixError as err:
        print(f"hf-gradfix {command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hf-gradfix {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hf-gradfix configs list | head`: the reader left; quiet, like the shell tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again (its docs' recipe)
        return 141
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
