"""``hf-gradfix config check``: validate a YAML (accelerate's keys and the ``hf_gradfix:`` section) the way launch
and ``hf_gradfix.patch(config=FILE)`` read it, and print what a launch with it will run (world size, mesh, loss,
packing, optimizer, global batch in tokens); ``--json`` for every setting with its default.

>>> from hf_gradfix.cli import main
>>> main(["config", "check", "configs/does-not-exist.yaml"])
2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

from ..config import ConfigError, config_to_dict
from ..config.resolve import resolve_config
from ..errors import model_load_error


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


def run(ns: argparse.Namespace) -> int:
    """``hf-gradfix config check``: 0 when the file is valid (a diagnosed problem raises, as one line)."""
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


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default (unless its help already names it), and examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _para(text: str) -> str:
    return textwrap.fill(text, width=100)


def add_parser(sub: Any) -> None:
    """``config`` and its ``check`` subcommand, on the top-level parser's subcommands ``sub``."""
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
