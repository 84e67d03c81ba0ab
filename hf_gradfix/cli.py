"""The hf-gradfix command: launch, config check, verify and plan.

accelerate rejects any unknown top-level key of its YAML ("had unknown keys (['hf_gradfix'])") and its ranks
cannot see which file was used.  hf-gradfix launch takes exactly the arguments of accelerate launch, reads the
file through the plugin's one validating loader (hf_gradfix.config.read_config_file), hands accelerate's keys to
accelerate's own launcher through a temporary file and makes the hf_gradfix: section visible to every rank through
$HF_GRADFIX_CONFIG, which hf_gradfix.patch() and GradFixCallback() read on each rank.

    hf-gradfix launch --config_file configs/accelerate/cpu_multiprocess.yaml train.py --my-arg 1
    hf-gradfix config check configs/accelerate/fsdp2_tp.yaml --micro-batch 4 --grad-accum 8 --seq-len 4096
    hf-gradfix verify --steps 2 [--json] [--plot errors.png] -- python train.py ARGS
    hf-gradfix plan --model llama-3.1-8b --config run.yaml --seq-len 4096 --micro-batch 2 --gpu h100

Every error the plugin diagnoses (hf_gradfix.errors.HfGradfixError) is printed as one line,
"hf-gradfix <command>: <what is wrong and the fix>", with exit code 2; a traceback means a bug in the plugin.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Sequence

import yaml

from .config import ENV_VAR, SECTION, ConfigError, config_from_dict, config_to_dict
from .config.sources import ORIGIN_ENV_VAR
from .config.resolve import ResolvedConfig, resolve_config, split_config  # noqa: F401  (re-exported: documented here)
from .errors import HfGradfixError, InvalidArgumentError, model_load_error

__all__ = ["main", "build_parser", "split_config", "resolve_config", "ResolvedConfig"]

def _load_model_config(spec: str | None) -> Any:
    if spec is None:
        return None
    p = Path(spec)
    if p.suffix == ".json" and p.is_file():
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, OSError) as err:
            raise model_load_error(spec, err) from None
        if not isinstance(data, dict):
            raise ConfigError(f"--model {spec}: expected a JSON object (a model's config.json)")
        return argparse.Namespace(**data)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=False)  # never run a model's own code
    except (OSError, ValueError, KeyError) as err:
        raise model_load_error(spec, err) from None


def _cmd_config_check(ns: argparse.Namespace) -> int:
    if ns.file and ns.config_file and ns.file != ns.config_file:
        raise ConfigError(f"two files given ({ns.file!r} and --config_file {ns.config_file!r}); "
                          "fix: name one")
    if not (ns.file or ns.config_file):
        raise ConfigError("no file given; fix: hf-gradfix config check FILE (or --config_file FILE; "
                          "a shipped one by name: hf-gradfix configs list)")
    resolved = resolve_config(
        ns.file or ns.config_file,
        num_processes=ns.num_processes,
        micro_batch=ns.micro_batch,
        seq_len=ns.seq_len,
        grad_accum=ns.grad_accum,
        model_config=_load_model_config(ns.model),
        for_launch=True,
    )
    if ns.json:
        m = resolved.mesh
        print(json.dumps({
            "config": resolved.path, "world_size": resolved.world_size, "distributed_type": resolved.distributed_type,
            "mesh": {"pp": m.pp, "dp_replicate": m.dp_replicate, "dp_shard": m.dp_shard, "tp": m.tp, "cp": m.cp, "dp": m.dp, "dp_cp": m.dp_cp, "ep": m.ep, "efsdp": m.efsdp},
            "mesh_source": resolved.mesh_source, "global_batch_tokens": resolved.global_batch_tokens,
            "hf_gradfix": config_to_dict(resolved.gradfix),
            "deepspeed": None if resolved.deepspeed is None else dataclasses.asdict(resolved.deepspeed),
        }, indent=2))
    else:
        print("\n".join(resolved.lines()))
    return 0


_LAUNCH_DESCRIPTION = """\
accelerate launch, with a YAML that may carry an hf_gradfix: section.

The file given with --config_file (default: accelerate's default config file) holds accelerate's own keys
(distributed_type, num_processes, parallelism_config, ...) and, optionally, the plugin's settings under one
hf_gradfix: key:

    distributed_type: MULTI_CPU
    num_processes: 4
    use_cpu: true
    hf_gradfix:
      loss: {count_rule: auto, on_nonfinite: warn}   # exact token-mean loss; NaN steps: warn | skip | error
      packing: {enabled: true, token_budget: 4096}   # padding-free packing, rows of <= 4096 tokens
      optimizer: {name: galore_adamw, rank: 128}      # GaLore / APOLLO for the Trainer
      parallel: {dp_shard: 2, tp: 2}                 # ND mesh; product = num_processes

Before any process starts the whole file is validated (the same loader as hf_gradfix.patch(config=file) and
hf-gradfix config check): a bad key or value is one line naming file, line, key, value and the fix, exit code 2.
accelerate gets its keys through a temporary file; every rank sees the section through $HF_GRADFIX_CONFIG, which
hf_gradfix.patch() and GradFixCallback() read. Every setting with its default: hf-gradfix config check FILE --json.

Then accelerate's own options, unchanged (hyphens or underscores: --num-processes=2 / --num_processes=2):
"""

_LAUNCH_EPILOG = """\
example:
  hf-gradfix config check run.yaml --micro-batch 4 --seq-len 2048 --grad-accum 8   # what this file will run
  hf-gradfix launch --config_file run.yaml train.py --my-arg 1
"""


def _launch_parser():
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    base = parser.formatter_class

    class _Formatter(base):  # keep accelerate's option layout; our description and example keep their lines
        def _fill_text(self, text, width, indent):
            return "".join(indent + line for line in text.splitlines(keepends=True))

        def add_argument(self, action):
            # accelerate's formatter hides every engine group (and --config_file, -m, --cpu, ...) unless argv[0]
            # says "accelerate": show them all, as `accelerate launch --help` does; keep its one spelling per option
            shown = copy.copy(action)
            shown.option_strings = [s for s in action.option_strings if "-" not in s[2:]]
            argparse.HelpFormatter.add_argument(self, shown)

    parser.prog = "hf-gradfix launch"
    parser.description = _LAUNCH_DESCRIPTION
    parser.epilog = _LAUNCH_EPILOG
    parser.formatter_class = _Formatter
    return parser


def _cpu_launch_env(acc: dict, resolved: ResolvedConfig) -> dict[str, str]:
    """Environment a ``use_cpu: true`` launch exports to every rank (empty for a GPU launch).

    accelerate does not export use_cpu on the torchrun path; scripts that build Accelerator / TrainingArguments
    without cpu=True would otherwise run N independent single-process jobs, so ACCELERATE_USE_CPU=true is exported.
    Under DeepSpeed that variable turns DeepSpeed off inside accelerate (ZeRO-2 runs as plain data parallel, ZeRO-3
    crashes), so DeepSpeed gets its CPU accelerator instead (DS_ACCELERATOR=cpu: collectives over gloo).
    """
    if not acc.get("use_cpu"):
        return {}
    if resolved.deepspeed is None:
        return {"ACCELERATE_USE_CPU": "true"}
    if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"{resolved.path}: ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']} in the environment turns DeepSpeed "
            "off inside accelerate (ZeRO-2 would run as plain data parallel, ZeRO-3 crash). Fix: unset "
            "ACCELERATE_USE_CPU; use_cpu: true in the YAML is enough"
        )
    return {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}


#: accelerate's numeric launch flags and their range (accelerate runs 0 or -3 processes as one, silently)
_LAUNCH_NUMBERS = {"num_processes": (1, 2**20), "num_machines": (1, 2**20), "machine_rank": (0, 2**20),
                   "main_process_port": (1, 65535), "num_cpu_threads_per_process": (1, 4096),
                   "gradient_accumulation_steps": (1, 2**20)}


def _check_launch_numbers(args: argparse.Namespace) -> None:
    for name, (low, high) in _LAUNCH_NUMBERS.items():
        value = getattr(args, name, None)
        if value is not None and not low <= value <= high:
            raise InvalidArgumentError(f"--{name} {value}: invalid value; it must be a whole number >= {low} and "
                                       f"<= {high}")


def launch(argv: Sequence[str]) -> int:
    """``accelerate launch`` with exactly its arguments; the ``hf_gradfix:`` section reaches every rank.

    Raises :class:`~hf_gradfix.errors.HfGradfixError` for a file or setting it refuses (``main`` prints it).
    """
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command

    args = _launch_parser().parse_args(list(argv))
    _check_launch_numbers(args)
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    tmp, summary = None, None
    saved_env = {k: os.environ.get(k) for k in (ENV_VAR, ORIGIN_ENV_VAR, "ACCELERATE_USE_CPU", "DS_ACCELERATOR",
                                                "ACCELERATE_ALLOW_CP_STANDALONE")}
    try:
        if path is not None:
            # validate everything (file, accelerate keys, section, mesh) before any process starts
            resolved = resolve_config(path, num_processes=args.num_processes, for_launch=True)
            summary = (f"hf-gradfix launch: {resolved.distributed_type}, {resolved.mesh.describe()} "
                       f"[{resolved.mesh_source}]; loss "
                       f"{'exact over the window' if resolved.gradfix.loss.enabled else 'left to transformers'}"
                       f"{', packing' if resolved.gradfix.packing.enabled else ''} ({path})")
            acc, section = split_config(path)
            tmp = tempfile.mkdtemp(prefix="hf_gradfix_launch_")
            if acc:
                acc_path = os.path.join(tmp, "accelerate.yaml")
                with open(acc_path, "w", encoding="utf-8") as fh:
                    yaml.safe_dump(acc, fh)
                args.config_file = acc_path
            else:  # only the plugin's section: accelerate's own defaults (its default config file, if any)
                args.config_file = None if path != default_config_file else args.config_file
            if section is not None:
                ours = os.path.join(tmp, "hf_gradfix.yaml")
                with open(ours, "w", encoding="utf-8") as fh:
                    # the keys as the file names them (validated above): every rank's patch() / GradFixCallback
                    # combines them with its own by the rule of hf_gradfix.config.sources, which needs to know which
                    # keys the file set (an expanded dict would set every key to its default)
                    config_from_dict(section)
                    yaml.safe_dump({SECTION: section}, fh)
                os.environ[ENV_VAR] = ours  # inherited by every rank
                os.environ[ORIGIN_ENV_VAR] = str(path)  # named in the start line and in conflict messages
            os.environ.update(_cpu_launch_env(acc, resolved))
            if resolved.deepspeed is not None:  # issue 39: minutes of silence otherwise, on a first CPU launch
                from .integration.diagnostics.first_run import deepspeed_cpu_build_notice

                notice = deepspeed_cpu_build_notice()
                if notice:
                    print(notice, file=sys.stderr, flush=True)
            if resolved.mesh.cp > 1:
                # accelerate refuses parallelism_config cp > 1 without its FSDP plugin; hf_gradfix shards the
                # model itself (FSDP2 over dp_shard x cp), as axolotl does
                os.environ["ACCELERATE_ALLOW_CP_STANDALONE"] = "true"
        script = args.training_script  # after the file: its problems first, then the script's
        own = [a for a in args.training_script_args if a.split("=", 1)[0] in ("--config_file", "--config-file",
                                                                            "--num_processes", "--num-processes")]
        if own:  # after the script, launch's options go to the script: accelerate would run without them
            print(f"hf-gradfix launch: note: {own[0]} comes after the script {script!r}, so the script gets it, not "
                  "launch; put launch's options before the script", file=sys.stderr, flush=True)
        if not (args.module or args.no_python) and not os.path.isfile(script):
            raise InvalidArgumentError(f"training script {script!r} not found (resolved to {os.path.abspath(script)}); "
                                       "give the path of your .py file, or -m package.module for a module")
        if summary:  # the resolved mesh in one line, once every check passed, before any process starts
            print(summary, file=sys.stderr, flush=True)
        try:
            launch_command(args)
        except subprocess.CalledProcessError as err:  # the script failed: its own traceback is above
            if err.returncode in (130, -2):  # the script stopped on Ctrl-C before this process saw it
                raise KeyboardInterrupt from None
            print(f"hf-gradfix launch: the script exited with status {err.returncode} (its output is above)",
                  file=sys.stderr)
            return err.returncode if 0 < err.returncode < 256 else 1
        except Exception as err:  # noqa: BLE001 - torch elastic's ChildFailedError (several processes): it printed the failures
            if type(err).__name__ != "ChildFailedError":
                raise
            first = getattr(err, "get_first_failure", None)  # the rank that failed first: its exit code (the
            code = getattr(first()[1], "exitcode", None) if callable(first) else None  # others were ended after it)
            code = code if isinstance(code, int) and 0 < code < 256 else 1
            if args.module and script == "hf_gradfix" and args.training_script_args[:1] == ["verify"] and code in (1, 2):
                # verify's exit codes are its verdict (1 NOT EXACT, 2 nothing checked), not a crash: its report or its
                # one-line reason is above
                print(f"hf-gradfix launch: hf-gradfix verify exited with {code} "
                      f"({'NOT EXACT' if code == 1 else 'nothing checked'}; see its last line above)", file=sys.stderr)
                return code
            print("hf-gradfix launch: a process of the script failed (torch elastic's report is above)", file=sys.stderr)
            return code
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for key, value in saved_env.items():  # the ranks had them; this process (a test, a notebook) gets its own back
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default (unless its help already names it), and examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _para(text: str) -> str:
    return textwrap.fill(text, width=100)


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


def _cmd_configs(ns: argparse.Namespace) -> int:
    """``hf-gradfix configs list | show NAME | copy NAME [DEST]``."""
    from .config.shipped import shipped_names, shipped_path

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


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-gradfix`` argument parser (``launch`` and ``plan`` parse their own arguments)."""
    parser = argparse.ArgumentParser(prog="hf-gradfix", description=_TOP_DESCRIPTION, epilog=_TOP_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"hf-gradfix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("env", help="versions of the stack and the device, for a bug report (like accelerate env)")
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
    sub.add_parser("launch", help="accelerate launch with a YAML that carries an hf_gradfix: section (same arguments)")
    sub.add_parser("plan", help="per-rank memory for a model and a configuration (closed form, --simulate, --suggest)")
    sub.add_parser("verify", help="prove a run exact: your script's gradients vs the one-process ground truth "
                   "(hf-gradfix verify -- python train.py ARGS)")
    cfg = sub.add_parser("config", help="configuration tools (config check)", description="Configuration tools.")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = cfg_sub.add_parser(
        "check", formatter_class=_Help,
        help="validate a YAML and print the resolved settings",
        description=_para("Validate a YAML file the way launch and hf_gradfix.patch(config=FILE) read it (accelerate's "
        "keys with their types and ranges, the hf_gradfix: section, duplicate keys) and print what a launch with it "
        "will run: world size, mesh, loss, packing, optimizer and the global batch in tokens. Exit code 0 when the "
        "file is valid, 2 (one line naming file, line, key, value and the fix) when not."),
        epilog="examples:\n  hf-gradfix config check run.yaml\n"
        "  hf-gradfix config check run.yaml --micro-batch 4 --seq-len 4096 --grad-accum 8\n"
        "  hf-gradfix config check run.yaml --model config.json --json",
    )
    check.add_argument("file", nargs="?", help="accelerate YAML, with or without an hf_gradfix: section")
    # accelerate's habit (accelerate launch / env / test --config_file FILE): the same file, named as launch names it
    check.add_argument("--config_file", "--config-file", dest="config_file", default=None, metavar="FILE",
                       help="the same file, as `hf-gradfix launch --config_file FILE` names it")
    check.add_argument("--num-processes", type=int, default=None, help="override num_processes from the file")
    check.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch")
    check.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    check.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    check.add_argument("--model", default=None, help="config.json, local model dir or hub id: check tp against its heads")
    check.add_argument("--json", action="store_true", help="machine-readable output")
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
            from .verify_cli import verify_main

            return verify_main(argv[1:])
        if argv and argv[0] == "plan":
            from .plan_cli import plan_main

            return plan_main(argv[1:])
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.command == "config" and ns.config_command == "check":
            return _cmd_config_check(ns)
        if ns.command == "configs":
            return _cmd_configs(ns)
        if ns.command == "env":
            from .env_report import environment_lines

            print("Copy-and-paste the text below in your GitHub issue\n")
            print("\n".join(environment_lines()))
            return 0
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
