"""hf-gradfix verify: run your training script unchanged and check its Trainer's first optimizer steps against a
one-process ground truth (exit 0 EXACT, 1 NOT EXACT, 2 nothing checked).

Usage:

    hf-gradfix verify [--steps 2] [--tolerance 1e-5] [--json] [--plot FILE.png] -- python train.py ARGS...
    hf-gradfix verify [options] -- -m my_package.train ARGS...
    hf-gradfix launch --config_file run.yaml -m hf_gradfix verify [options] -- train.py ARGS...   # every rank
    hf-gradfix verify --model tiny --grad-accum 4 --steps 2     # the built-in run (no script)

With a script, the script runs unchanged in this process (``runpy``, its own ``sys.argv``); the first
``transformers.Trainer`` (any subclass, TRL trainers) whose ``train()`` it calls is checked by
:func:`hf_gradfix.verify.verify_trainer` for ``--steps`` optimizer steps, and the script is stopped there.
Exit code 0 when EXACT, 1 when NOT EXACT, 2 when nothing could be checked (the script failed or trained no
Trainer, bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import pickle
import runpy
import sys
import traceback
from typing import Any, Callable, Iterator, Sequence

from ..errors import HfGradfixError, InvalidArgumentError, model_load_error
from ..progress import Progress

__all__ = ["verify_main", "add_verify_arguments", "trainer_train_hook", "run_script", "ScriptFailed",
           "format_script_failure"]

_BUILTIN_ONLY = ("model", "config", "data", "grad_accum", "batch_size", "packing", "inject", "plot_curves", "bf16")


def add_verify_arguments(ver: argparse.ArgumentParser) -> None:
    """The options of ``hf-gradfix verify`` (the script's own command line goes after ``--``)."""
    ver.add_argument("--steps", type=int, default=2, help="optimizer steps to check (default: 2)")
    ver.add_argument("--tolerance", type=float, default=1e-5,
                     help="relative gradient and loss error that counts as exact (default: 1e-05); a bf16 / fp16 run is "
                     "judged within max(this, 4 x its measured rounding floor)")
    ver.add_argument("--json", action="store_true", help="print the report as JSON (the script's own output goes to stderr)")
    ver.add_argument("--plot", default=None, metavar="FILE.png", help="draw the run's error against every reference")
    ver.add_argument("--all-ranks", action="store_true",
                     help="under a multi-process launch, show every rank's log lines and Python warnings (default: rank 0's; "
                          "same as HF_GRADFIX_ALL_RANKS=1)")
    built = ver.add_argument_group("built-in run (no script after --)")
    built.add_argument("--model", default=None, help="'tiny' (the default), a local directory or a hub id (causal LM)")
    built.add_argument("--config", default=None, help="YAML with the hf_gradfix section (default: $HF_GRADFIX_CONFIG)")
    built.add_argument("--data", default=None, help=".jsonl of input_ids/labels or a text file (default: synthetic)")
    built.add_argument("--grad-accum", type=int, default=None, help="gradient accumulation steps (default: 4)")
    built.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch and rank (default: 2)")
    built.add_argument("--packing", action="store_true", default=None, help="force packing on")
    built.add_argument("--bf16", action="store_true", default=None,
                       help="train under the Trainer's bf16 autocast (the reference computes the same way, fp32 beside it)")
    built.add_argument("--inject", default=None, help="plant a known bug to see it caught: " + ", ".join(
        ("mean_of_means", "ga_scaled", "world_scaled", "count_unshifted", "cross_attention")))
    built.add_argument("--plot-curves", default=None, metavar="FILE.png",
                       help="also draw loss curves with and without hf_gradfix")
    built.add_argument("--plot-steps", type=int, default=20, help="steps of the --plot-curves runs (default: 20)")


class _HardExit(BaseException):
    """``os._exit(code)`` called by the user's script under verify (raised instead of ending the process unchecked)."""

    def __init__(self, code: int):
        super().__init__(f"os._exit({code})")
        self.code = code


class _Checked(BaseException):
    """Raised out of the hooked ``Trainer.train`` to stop the user's script once its trainer is checked
    (a BaseException, so that the script's own ``except Exception`` does not swallow it)."""

    def __init__(self, report: Any):
        super().__init__("hf-gradfix verify: trainer checked")
        self.report = report


@contextlib.contextmanager
def trainer_train_hook(on_train: Callable[[Any, Callable[[], Any]], Any]) -> Iterator[None]:
    """Within the block, the first ``transformers.Trainer.train`` call (of any subclass that reaches it) runs
    ``on_train(trainer, run_train)`` instead; ``run_train()`` is that call, unhooked.

    The only change verify makes to transformers: installed here, removed here (also on errors), once only.

    >>> import transformers
    >>> before = transformers.Trainer.train
    >>> with trainer_train_hook(lambda trainer, run: None):
    ...     transformers.Trainer.train is before
    False
    >>> transformers.Trainer.train is before
    True
    """
    import transformers

    original = transformers.Trainer.train
    fired = []

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        if fired:
            return original(self, *args, **kwargs)
        fired.append(True)
        transformers.Trainer.train = original
        return on_train(self, lambda: original(self, *args, **kwargs))

    transformers.Trainer.train = train
    try:
        yield
    finally:
        transformers.Trainer.train = original


class ScriptFailed(Exception):
    """The user's script raised (``error``): before its Trainer's ``train()``, or inside the checked steps.

    ``phase`` says where in words ("before its Trainer's train() was called", "in step 2 of Trainer.train() under
    verify"); :func:`verify_main` prints the script's own traceback (its innermost frames, verify's machinery left
    out) and one last line naming the exception, its file and line, and the phase."""

    def __init__(self, error: BaseException, phase: str, step: int | None = None):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.phase, self.step = error, phase, step


# frames of the machinery between the user's script and its error: runpy, this module, verify's trainer hook (the
# modules that were hf_gradfix/verify.py before it became a package: the hook's progress wrapper is in report.py)
_MACHINERY = tuple(os.path.join("hf_gradfix", "verify", f"{m}.py")
                   for m in ("command", "trainer", "report", "reference", "builtin")) + ("runpy.py", "<frozen runpy>")
_INNERMOST = 12  # frames kept below the script's own (the error's neighbourhood), besides the script's frames


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _script_frames(error: BaseException) -> list:
    """The traceback's frames without verify's machinery (runpy, this command, verify's trainer hook)."""
    frames = traceback.extract_tb(error.__traceback__)
    return [f for f in frames if not any(f.filename.endswith(m) for m in _MACHINERY)]


def format_script_failure(failure: ScriptFailed) -> tuple[str, str]:
    """``(traceback text, last line)`` for a failure of the user's script: the traceback keeps the script's own
    frames and the innermost ones (where it was raised); the line names exception, file, line and phase."""
    error = failure.error
    frames = _script_frames(error)
    if len(frames) > _INNERMOST + 2:  # the outermost (the script's call) and the innermost frames
        frames = frames[:2] + frames[-_INNERMOST:]
        skipped = "  ... (frames in between left out by hf-gradfix verify)\n"
    else:
        skipped = ""
    body = traceback.format_list(frames)
    if skipped:
        body.insert(2, skipped)
    message = "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
    text = "Traceback of the script (innermost frames):\n" + "".join(body) + message
    where = ""
    if frames:
        raise_site = frames[-1]
        where = f" at {_short_path(raise_site.filename)}:{raise_site.lineno}"
        user = [f for f in frames if "site-packages" not in f.filename and f is not raise_site]
        if "site-packages" in raise_site.filename and user:
            where += f" (from {_short_path(user[-1].filename)}:{user[-1].lineno})"
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    exc = type(error).__name__ + (f": {detail}" if detail else "")
    line = f"hf-gradfix verify: the script raised {exc}{where}, {failure.phase}; nothing was checked"
    return text, line


def _split_command(command: Sequence[str]) -> tuple[str, str, list[str]]:
    """``("path"|"module", target, args)`` from ``python [-u] train.py ARGS`` / ``train.py ARGS`` / ``-m mod ARGS``."""
    cmd = list(command)
    if cmd and os.path.basename(cmd[0]).startswith("python"):
        cmd = cmd[1:]
        while cmd and cmd[0].startswith("-") and cmd[0] != "-m":
            if cmd[0] in ("-c", "-"):
                raise InvalidArgumentError("hf-gradfix verify: `python -c` / stdin scripts are not supported; pass a script file or -m module")
            cmd = cmd[1:]
    if not cmd:
        raise InvalidArgumentError("hf-gradfix verify: nothing to run after --; e.g. hf-gradfix verify -- python train.py ARGS")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise InvalidArgumentError("hf-gradfix verify: -m needs a module name")
        _check_module(cmd[1])
        return "module", cmd[1], cmd[2:]
    if not os.path.isfile(cmd[0]):
        raise InvalidArgumentError(f"hf-gradfix verify: script {cmd[0]!r} not found")
    return "path", cmd[0], cmd[1:]


def _check_module(name: str) -> None:
    """Refuse, in one line, a ``-m`` module that cannot be found (before anything runs)."""
    import importlib.util

    saved = sys.path[:]
    if "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m (and run_script) will: the current folder first
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package is missing, or an empty / relative name
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        raise InvalidArgumentError(f"hf-gradfix verify: module {name!r} not found (from {os.getcwd()}); give an "
                                   "importable module (python -m NAME works) or a script path")


def _check_data(path: str, vocab_size: int | None = None) -> None:
    """One line for a ``--data`` file that cannot be read: missing, a folder, not UTF-8, a bad JSON Lines row."""
    import json

    if not os.path.exists(path):
        raise InvalidArgumentError(f"--data {path}: file not found (resolved to {os.path.abspath(path)})")
    from ..files import not_a_regular_file

    kind = not_a_regular_file(path)
    if kind is not None:  # a folder, a FIFO (open() would block), a device (never ends)
        raise InvalidArgumentError(f"--data {path}: {kind}; give a .jsonl of input_ids (and labels) or a text file")
    try:
        with open(path, encoding="utf-8") as fh:
            if not path.endswith(".jsonl"):
                fh.read()
                return
            rows = 0
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as err:
                    raise InvalidArgumentError(f"--data {path}:{number}: not JSON ({err}); each line is one JSON object "
                                               'such as {"input_ids": [1, 2, 3]}') from None
                ids = row.get("input_ids") if isinstance(row, dict) else None
                labels = row.get("labels", ids) if isinstance(row, dict) else None
                for key, value in (("input_ids", ids), ("labels", labels)):
                    if not (isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                                     for v in value)):
                        raise InvalidArgumentError(
                            f"--data {path}:{number}: {key}: expected a non-empty list of token ids, got "
                            f"{'no ' + key if value is None else type(value).__name__}; each line is one JSON object "
                            'such as {"input_ids": [1, 2, 3]}')
                if len(labels) != len(ids):
                    raise InvalidArgumentError(
                        f"--data {path}:{number}: labels have {len(labels)} entries, input_ids {len(ids)}; labels are "
                        "unshifted and aligned with input_ids (the model shifts them), -100 where there is no target")
                bad_id = next((v for v in ids if v < 0), None)
                if bad_id is not None:
                    raise InvalidArgumentError(f"--data {path}:{number}: input_ids holds {bad_id}; a token id is >= 0")
                bad_label = next((v for v in labels if v < 0 and v != -100), None)
                if bad_label is not None:
                    raise InvalidArgumentError(f"--data {path}:{number}: labels holds {bad_label}; a label is a token id "
                                               ">= 0 or -100 (no target)")
                top = max(max(ids), max(labels))
                if vocab_size is not None and top >= vocab_size:
                    raise InvalidArgumentError(f"--data {path}:{number}: token id {top} is outside the model's vocabulary "
                                               f"({vocab_size} tokens: ids 0-{vocab_size - 1})")
                rows += 1
            if rows == 0:
                raise InvalidArgumentError(f"--data {path}: no samples (the file is empty)")
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(f"--data {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise InvalidArgumentError(f"--data {path}: cannot read it ({err.strerror or err})") from None


def run_script(command: Sequence[str], *, steps: int = 2, tolerance: float = 1e-5, quiet_stdout: bool = False) -> Any:
    """Run the user's command in this process and return the :class:`~hf_gradfix.verify.VerifyReport` of the
    first Trainer it trains.  Raises ``RuntimeError`` when the script trains none."""
    from .trainer import verify_trainer

    kind, target, args = _split_command(command)
    progress: dict[str, Any] = {"phase": "before"}  # before -> train (the checked steps) -> compare (verify's own)

    def on_train(trainer, run_train):
        progress["phase"] = "setup"  # verify's own work around the checked steps: its errors are its own

        def run():
            progress.update(phase="train", trainer=trainer)
            result = run_train()
            progress["phase"] = "compare"
            return result

        progress["report"] = verify_trainer(trainer, steps, tolerance=tolerance, run_train=run)
        progress["phase"] = "checked"
        raise _Checked(progress["report"])

    def hard_exit(code=0):  # os._exit skips every handler: the process would end with the script's code, unchecked
        raise _HardExit(code)

    from ..integration.patching import is_patched, unpatch

    was_patched = is_patched()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    redirect = contextlib.redirect_stdout(sys.stderr) if quiet_stdout else contextlib.nullcontext()
    real_exit = os._exit  # verify's own process, for the script's run only (restored below): see hard_exit
    os._exit = hard_exit
    try:
        with redirect, trainer_train_hook(on_train):
            if kind == "module":
                sys.argv = [target, *args]
                if "" not in sys.path:
                    sys.path.insert(0, os.getcwd())
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
    except _Checked as done:
        return done.report
    except _HardExit as ex:
        if "report" in progress:
            return progress["report"]
        raise RuntimeError(f"the script called os._exit({ex.code}) {_phase_words(progress)}: nothing was checked") from None
    except SystemExit as ex:
        if "report" in progress:  # the check ran; the script caught its stop and exited: the report stands
            return progress["report"]
        if ex.code not in (None, 0):
            raise RuntimeError(f"the script exited with status {ex.code} {_phase_words(progress)}") from None
    except Exception as err:
        if "report" in progress:  # the check ran; what the script did after it does not change the report
            return progress["report"]
        if progress["phase"] in ("setup", "compare"):  # verify's own work (the reference, the comparison): its own
            raise
        raise ScriptFailed(err, _phase_words(progress), progress.get("step")) from err
    finally:
        os._exit = real_exit
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if is_patched() and not was_patched:  # the script's hf_gradfix.patch() ends with the script
            unpatch()
    if "report" in progress:  # the script caught verify's stop (a bare except) and went on: the report stands
        return progress["report"]
    if progress["phase"] != "before":
        raise RuntimeError(f"the script left {_phase_words(progress)} before verify could compare (it caught the "
                           "stop, or returned from train() early): nothing was checked")
    raise RuntimeError("the script finished without calling train() on a transformers.Trainer: nothing to verify")


def _phase_words(progress: dict) -> str:
    """Where the script was when it stopped: before its Trainer's train(), or in which checked step."""
    if progress["phase"] in ("before", "setup"):
        return "before its Trainer's train() was called"
    trainer = progress.get("trainer")
    state = getattr(trainer, "state", None)
    step = int(getattr(state, "global_step", 0) or 0) + 1
    progress["step"] = step
    return f"in step {step} of {type(trainer).__name__}.train() under verify"


def _print_report(report: Any, ns: argparse.Namespace) -> None:
    from .report import plot_report

    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(report.to_json() if ns.json else "\n".join(report.lines()), flush=True)
    if ns.plot:
        plot_report(report, ns.plot)
        if not ns.json:
            print(f"plot: {ns.plot}")


def _one_voice(all_ranks: bool) -> None:
    """Under a launch every rank runs verify: rank 0 speaks (the plugin's log is filtered by rank in
    ``hf_gradfix/__init__.py``; here the Python warnings too, which every rank would repeat), unless asked."""
    import warnings

    from .. import ALL_RANKS_ENV

    if all_ranks:
        os.environ[ALL_RANKS_ENV] = "1"
    elif int(os.environ.get("RANK", "0") or 0) != 0 and os.environ.get(ALL_RANKS_ENV, "") in ("", "0"):
        warnings.simplefilter("ignore")


def verify_main(argv: Sequence[str]) -> int:
    """``hf-gradfix verify ...``; returns the exit code (0 EXACT, 1 NOT EXACT, 2 nothing checked)."""
    argv = list(argv)
    command: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="hf-gradfix verify", description="\n\n".join(__doc__.split("\n\n")[:3]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="hf-gradfix verify [options] -- python train.py ARGS... | -m module ARGS...",
                                     epilog="examples:\n"
                                     "  hf-gradfix verify -- python examples/train_causal_lm.py --loss tutorial\n"
                                     "  hf-gradfix verify --steps 3 --json -- python train.py --my-arg 1\n"
                                     "  hf-gradfix verify --model tiny --grad-accum 4 --steps 2   # the built-in run")
    add_verify_arguments(parser)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        # the common slip: the script's command without the `--` that separates it from verify's own options
        start = next((i for i, a in enumerate(unknown) if not a.startswith("-")), None)
        looks_like_command = start is not None and (os.path.basename(unknown[start]).startswith("python")
                                                    or unknown[start].endswith(".py"))
        if looks_like_command or (unknown and unknown[0] == "-m"):
            if unknown[0] == "-m":
                command_text = " ".join(unknown)
            else:
                command_text = " ".join(unknown[start:])
                if not os.path.basename(unknown[start]).startswith("python"):
                    command_text = "python " + command_text
            print(f"hf-gradfix verify: {' '.join(unknown)!r}: a command needs `--` before it: "
                  f"hf-gradfix verify [options] -- {command_text}", file=sys.stderr)
            return 2
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _one_voice(ns.all_ranks)
    for flag, value in (("--steps", ns.steps), ("--grad-accum", ns.grad_accum), ("--batch-size", ns.batch_size),
                        ("--plot-steps", ns.plot_steps)):
        if value is not None and value < 1:
            print(f"hf-gradfix verify: {flag} {value}: invalid value; it must be a whole number >= 1", file=sys.stderr)
            return 2
    if not (math.isfinite(ns.tolerance) and ns.tolerance > 0):
        print(f"hf-gradfix verify: --tolerance {ns.tolerance}: invalid value; it must be a finite number > 0",
              file=sys.stderr)
        return 2
    if command is not None:
        given = [f"--{k.replace('_', '-')}" for k in _BUILTIN_ONLY if getattr(ns, k) is not None]
        if given:
            print(f"hf-gradfix verify: {', '.join(given)} only apply to the built-in run; with a script, its own "
                  "model, data and configuration are used (set the hf_gradfix configuration with hf-gradfix launch "
                  "or $HF_GRADFIX_CONFIG)", file=sys.stderr)
            return 2
        with Progress("verify") as progress:  # a first line now, then one per phase, a heartbeat in between
            try:
                _, target, _ = _split_command(command)
                progress.phase(f"running {target} under verify: the script's own setup until its Trainer's train(), "
                               f"then {ns.steps} step(s) checked against the ground truth ...")
                report = run_script(command, steps=ns.steps, tolerance=ns.tolerance, quiet_stdout=ns.json)
            except ScriptFailed as failure:
                if isinstance(failure.error, HfGradfixError):  # hf_gradfix refused the run: the plugin's line, once
                    _say_failure([f"hf-gradfix verify: hf_gradfix stopped the script's run {failure.phase}: "
                                  f"{failure.error}; nothing was checked"])
                    return 2
                text, line = format_script_failure(failure)  # the script raised: its traceback, then one line
                # an error of runpy itself (no such module) has no frames of the script
                _say_failure(([text] if _script_frames(failure.error) else []) + [line])
                return 2
            except HfGradfixError as err:  # verify's own refusal (the same on every rank): one line
                _say_failure([_ours(str(err))])
                return 2
            except (ValueError, RuntimeError) as err:
                _say_failure([_ours(str(err))])
                return 2
            except Exception as err:  # verify's own comparison failed after the script's steps ran
                _say_failure([traceback.format_exc().rstrip(),
                              f"hf-gradfix verify: the comparison with the ground truth failed after the checked steps "
                              f"ran ({type(err).__name__}: {err}); traceback above"])
                return 2
        _print_report(report, ns)
        return _leave_together(_exit_code(report))
    with Progress("verify") as progress:
        progress.phase(f"the built-in run: loading the model ({ns.model or 'tiny'}) and its samples ...")
        try:
            return _leave_together(_builtin(ns))
        except HfGradfixError as err:  # a refusal (the same on every rank): one line per run
            _say_failure([_ours(str(err))])
            return 2


#: Seconds a rank other than 0 waits before it says its failure: when every rank failed alike, rank 0 said it and
#: the launcher ended the others before then (torch elastic stops every rank once one exits with an error); a rank
#: that failed alone still says it, with its rank
_OTHER_RANKS_GRACE_S = 10.0


def _ours(message: str) -> str:
    """``message`` as verify's own line (prefixed once)."""
    return message if message.startswith("hf-gradfix verify:") else f"hf-gradfix verify: {message}"


def _say_failure(lines: Sequence[str]) -> None:
    """A failure said once per run: rank 0 at once; another rank only after a grace period (then prefixed with its
    rank), so that a failure of every rank is one line, and a failure of one rank alone is still said."""
    from .. import ALL_RANKS_ENV

    rank = int(os.environ.get("RANK", "0") or 0)
    every = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
    if rank and not every:
        import time

        time.sleep(_OTHER_RANKS_GRACE_S)
    prefix = f"[rank {rank}] " if rank else ""
    for text in lines:
        print("\n".join(prefix + part for part in text.splitlines()), file=sys.stderr, flush=True)


def _leave_together(code: int) -> int:
    """Under a launch every rank has the report: each waits until rank 0 printed it (a rank that exits first with the
    verdict's code, 1 for NOT EXACT, makes the launcher end the others, rank 0 too), then the process ends without
    Python's teardown (``os._exit``: a gloo process group may hang or abort in it, pytorch#190489; the script was
    stopped already). One process: ``code`` back to the caller."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)  # torch is loaded when a script or run trained
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return code
    import logging

    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank already gone: end anyway, with the verdict's code
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(report: Any) -> int:
    """0 EXACT, 1 NOT EXACT, 2 nothing checked (no step, or 0 targets: the report's last line says which)."""
    if report.nothing_checked() is not None:
        return 2
    return 0 if report.exact else 1


def _builtin(ns: argparse.Namespace) -> int:
    from .builtin import load_model, load_samples, plot_loss_curves, verify

    spec = ns.model or "tiny"
    if ns.data is not None:
        _check_data(ns.data)  # before the model loads
    grad_accum = ns.grad_accum or 4
    batch_size = ns.batch_size or 2
    try:
        model = load_model(spec)
    except (OSError, ValueError, KeyError, pickle.UnpicklingError) as err:  # one line (remote code or a pickle
        if isinstance(err, HfGradfixError):                                # refused, not found, ...), exit code 2
            raise
        raise model_load_error(spec, err) from None
    if ns.data is not None and str(ns.data).endswith(".jsonl"):  # ids against the loaded model's vocabulary
        _check_data(ns.data, int(getattr(model.config, "vocab_size", 0) or 0) or None)
    n = batch_size * grad_accum * max(1, int(os.environ.get("WORLD_SIZE", "1"))) * ns.steps * 2
    samples = load_samples(ns.data, model, spec, n)
    # --json: stdout carries the report only; what libraries print while the run imports them (DeepSpeed's
    # accelerator notice, for one) goes to stderr, as the script's own output does under run_script
    with contextlib.redirect_stdout(sys.stderr) if ns.json else contextlib.nullcontext():
        report = verify(lambda: model, samples, config=ns.config, grad_accum=grad_accum, batch_size=batch_size,
                          steps=ns.steps, packing=ns.packing, inject=ns.inject, tolerance=ns.tolerance,
                          bf16=bool(ns.bf16))
    _print_report(report, ns)
    if ns.plot_curves and int(os.environ.get("RANK", "0")) == 0:
        plot_loss_curves(ns.plot_curves, lambda: load_model(spec), samples, steps=ns.plot_steps,
                           grad_accum=grad_accum, batch_size=batch_size, config=ns.config)
        print(f"loss curves: {ns.plot_curves}")
    return _exit_code(report)
