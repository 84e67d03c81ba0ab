"""``hf-gradfix launch``: ``accelerate launch`` with exactly its arguments and a YAML that may carry an
``hf_gradfix:`` section.

accelerate rejects any unknown top-level key of its YAML ("had unknown keys (['hf_gradfix'])") and its ranks
cannot see which file was used.  hf-gradfix launch takes exactly the arguments of accelerate launch, reads the
file through the plugin's one validating loader (hf_gradfix.config.read_config_file), hands accelerate's keys to
accelerate's own launcher through a temporary file and makes the hf_gradfix: section visible to every rank through
$HF_GRADFIX_CONFIG, which hf_gradfix.patch() and GradFixCallback() read on each rank.

    hf-gradfix launch --config_file configs/accelerate/cpu_multiprocess.yaml train.py --my-arg 1
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Sequence

import yaml

from ..config import ENV_VAR, SECTION, ConfigError, config_from_dict
from ..config.resolve import ResolvedConfig, resolve_config, split_config
from ..config.sources import ORIGIN_ENV_VAR
from ..errors import InvalidArgumentError


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
                from ..integration.diagnostics.first_run import deepspeed_cpu_build_notice

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
