"""Multi-process test plumbing shared by the gloo suites (pp, nd, cp, DeepSpeed): one launch runs a worker script
over a list of named cases; every rank writes ``OUT/<case>/rank<r>.pt`` (or ``FAILED_rank<r>`` with its traceback).

Test side::

    runs, proc = launch_cases("pp_worker.py", ["pp2_1f1b_ga4"], nproc=2, via_config=REPO_ROOT / "configs/cpu_pp.yaml")
    runs["pp2_1f1b_ga4"][0]  # rank 0's record

Worker side (after the worker set up its process group)::

    run_cases(names, out, rank, lambda name: run_case(name, out, rank, world), cleanup=lambda name: hf_gradfix.unpatch())
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Iterable

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[1]


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict:
    """The launched processes' environment: one thread each (2 cores here), the repository and tests importable,
    offline, no hf_gradfix section inherited from the test process."""
    env = dict(os.environ)
    env.pop("HF_GRADFIX_CONFIG", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank killed by a signal prints its Python stack (a native abort)
    env.update(extra)
    return env


def torchrun(script: str | os.PathLike, *args: str, nproc: int = 2, python: str | None = None) -> list[str]:
    """The ``torch.distributed.run`` command line every test launch uses: ``nproc`` processes on one node, rendezvous
    on 127.0.0.1 at a free port (``run_launch`` swaps it for a fresh one on a relaunch)."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *map(str, args)]


_KILLED_RANK = re.compile(r"failed \(exitcode: -(\d+)\) local_rank: (\d+)")
_PORT_FLAGS = ("--master_port", "--main_process_port")


def run_launch(cmd: list[str], *, step: str, env: dict | None = None, cwd: str | os.PathLike | None = None,
               before_relaunch: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` for a multi-process launch (``torch.distributed.run`` or ``hf-gradfix launch``),
    output captured, relaunched once, on a fresh port, when a rank was killed by a signal. ``step``: its name in
    ``hang_bound.STEPS`` (the launch's hang bound; a hang kills the launch with its ranks and says ``HANG: ...``).

    A rank killed by a signal (SIGABRT inside gloo at exit, "terminate called without an active exception": about
    once in 100 launches on a loaded 2-core machine, in CP, ZeRO-3, DDP and Trainer launches alike, until workers
    ended with :func:`finish_distributed`; kept for what that does not cover) is not a verdict on the code under
    test: one relaunch, said aloud with the first launch's stderr tail. A Python exception (an assertion, a refusal,
    a wrong number) is never relaunched. ``before_relaunch`` clears what the first launch wrote.
    """
    import hang_bound

    proc = hang_bound.run(cmd, step=step, cwd=cwd, env=env, capture_output=True, text=True)
    killed = _KILLED_RANK.search(proc.stderr)
    if proc.returncode == 0 or not killed:
        return proc
    import warnings

    script = next((Path(a).name for a in cmd if a.endswith(".py")), " ".join(cmd[:3]))
    warnings.warn(f"{script}: rank {killed[2]} died by signal {killed[1]}; "
                  f"relaunched once. Its stderr tail:\n{proc.stderr[-3000:]}")
    if before_relaunch is not None:
        before_relaunch()
    cmd = list(cmd)
    for flag in _PORT_FLAGS:
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = str(free_port())
    return hang_bound.run(cmd, step=step, cwd=cwd, env=env, capture_output=True, text=True)


def finish_distributed() -> None:
    """A worker's last step, after its records are written: every rank reaches it, the process group is destroyed
    and the process ends with exit code 0 *without* running Python's teardown (``os._exit``).

    Why the exit: a DDP-wrapped model (a Trainer's) keeps the gloo group alive past ``destroy_process_group``; when
    it is collected, ``~ProcessGroupGloo`` joins gloo's run-loop thread while holding the GIL, and that thread may
    still be freeing a finished work's tensor, which needs the GIL. Seen in gdb on a hung rank (stock transformers
    4.57, no hf_gradfix): deadlock; during interpreter finalization the same thread's GIL request ends in
    "terminate called without an active exception" (SIGABRT), 2 launches in 8 under load. A torch issue
    (pytorch#190489, pytorch PR #179291), not the code under test. Call it only on success: an exception must reach
    the launcher."""
    import logging

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()  # file handlers (a job's rank log) flushed and closed, as teardown would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_cases(
    worker: str,
    names: list[str],
    *,
    nproc: int,
    flag: str = "--cases",
    via_config: str | os.PathLike | None = None,
    env: dict | None = None,
    keep_env: str = "HGF_KEEP_RUNS",
    step: str | None = None,
) -> tuple[dict[str, list[dict]], subprocess.CompletedProcess]:
    """Run ``tests/<worker> --out DIR <flag> a,b,...`` on ``nproc`` gloo processes and load every rank's record.

    ``via_config``: launch through ``hf-gradfix launch --config_file`` (what users run; the file's ``hf_gradfix:``
    section reaches every rank), else ``torch.distributed.run``. A failed launch fails the test with the first
    rank traceback and the tail of stderr. Set the environment variable ``keep_env`` to 1 to keep the records.
    ``step``: the launch's name in ``hang_bound.STEPS`` (default ``"<worker> launch"``; its hang bound).
    """
    import pytest
    import torch

    out = Path(tempfile.mkdtemp(prefix=f"hgf_{Path(worker).stem}_"))
    worker_args = ["--out", str(out), flag, ",".join(names)]
    if via_config is not None:
        cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(via_config),
               "--main_process_port", str(free_port()), str(TESTS_DIR / worker), *worker_args]
    else:
        cmd = torchrun(TESTS_DIR / worker, *worker_args, nproc=nproc)

    def fresh_out() -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()

    proc = run_launch(cmd, step=step or f"{worker} launch", cwd=str(REPO_ROOT),
                      env=env if env is not None else worker_env(), before_relaunch=fresh_out)
    if proc.returncode != 0:
        failed = sorted(str(p) for p in out.glob("*/FAILED_rank*"))
        detail = "\n".join(Path(p).read_text()[-4000:] for p in failed[:1])
        pytest.fail(f"{worker} failed (rc {proc.returncode}); {failed}\n{detail}\n{proc.stderr[-6000:]}")
    runs = {name: [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(nproc)] for name in names}
    if os.environ.get(keep_env) != "1":
        shutil.rmtree(out, ignore_errors=True)
    return runs, proc


def run_cases(names: Iterable[str], out: Path, rank: int, run_one: Callable[[str], None],
              cleanup: Callable[[str], None] | None = None) -> None:
    """The worker's loop: each case in order, its traceback into ``OUT/<case>/FAILED_rank<r>`` (then re-raised, so
    the launch fails), ``cleanup(name)`` after every case, a barrier between cases, :func:`finish_distributed` at the
    end (the process exits there)."""
    import torch

    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
        try:
            run_one(name)
        except Exception:
            (out / name / f"FAILED_rank{rank}").write_text(traceback.format_exc())
            raise
        finally:
            if cleanup is not None:
                cleanup(name)
        torch.distributed.barrier()
    finish_distributed()
