"""Every time bound of the tests, in one place: each is a *hang bound*, never a speed bound.

A test waits on a subprocess, a launch of ranks, a collective or a polling loop; a bound on that wait exists only so
that a hang ends the test instead of the CI run. So each bound is at least ``FACTOR`` (10) times the step's measured
time alone on the slower 2-core host and never under ``FLOOR_S`` (600 s): a shared, loaded machine (a user's, CI's,
``bash scripts/test.sh --under-load N``) stretches a step 3-4x and must not fail it. Each step is named in
:data:`STEPS` with its measured time; a bound that fires says so in one line::

    HANG: step 'plan lean head probe' exceeded its hang bound of 600 s (measured ~25 s alone on the slower 2-core host)

and kills the step's whole process group (a launch's ranks with it). docs/testing.md lists the same table
(``tests/project/test_time_bounds.py`` checks that it does, and that no other time bound is left in tests/).

Use::

    import hang_bound
    proc = hang_bound.run([sys.executable, "probe.py"], step="plan lean head probe", capture_output=True, text=True)
    out, err = hang_bound.communicate(popen, step="hf-gradfix launch interrupted by Ctrl-C")
    hang_bound.wait(popen, step="start line run on a terminal")
    until = hang_bound.deadline("heartbeat thread speaks twice"); while not done: until.check(detail)

:data:`NOT_HANG_BOUNDS`: the few time limits in tests/ that are what a test proves (a product requirement: "the
refusal comes before any work", "a 1M-length pack in 5 s"), not a wait on a step; each with what it proves. They are
measured in CPU time of the test's own process where they can be (a busy machine does not stretch it), and they are
the only clock comparisons the checking test accepts outside this module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

#: no hang bound is shorter than this (seconds)
FLOOR_S = 600.0
#: a hang bound is at least this many times the step's measured time alone on the slower 2-core host
FACTOR = 10


@dataclass(frozen=True)
class Step:
    """One step a test waits on: ``measured_s``, its time alone on the slower 2-core host (seconds; ``how``: how it
    was measured, ``used_by``: where)."""

    measured_s: float
    used_by: str
    how: str

    @property
    def bound_s(self) -> float:
        return max(FLOOR_S, FACTOR * self.measured_s)


#: how the times were measured (issue 54, one session; no step was timed alone: each is at least its time alone)
_L = "one run of its test, this 2-core host shared (load average 6-9)"
_S = "its launch alone on the slower host (docs/testing.md, the slowest setups)"
_G = "estimated from a similar launch (not measured alone yet)"

#: every step a test waits on with a bound: name -> Step (docs/testing.md lists the same table)
STEPS: dict[str, Step] = {
    # ---- one process: the CLI, probes, scripts
    "hf-gradfix CLI command": Step(10, "tests/config/test_bad_inputs.py, tests/config/test_cli.py (--version, env, "
                                       "configs, a reader that leaves early; 26 s for the 3 commands of "
                                       "test_console_script_subprocess)", how=_L),
    "accelerate launch of a 1-process probe": Step(17, "tests/config/test_cli.py::test_launch_hands_accelerate_its_keys_and_every_rank_the_section", how=_L),
    "hf-gradfix launch of a 2-rank probe": Step(25, "tests/config/test_cli.py::test_launch_hands_accelerate_its_keys_and_every_rank_the_section (42 s with the one above)", how=_L),
    "pip wheel of the repository": Step(13, "tests/config/test_cli.py::test_the_wheel_carries_the_shipped_configs", how=_L),
    "CLI on a model directory with remote code": Step(21, "tests/config/test_bad_inputs.py::test_remote_code_never_runs_whatever_is_on_stdin", how=_L),
    "hf-gradfix launch interrupted by Ctrl-C": Step(15, "tests/config/test_bad_inputs.py::test_ctrl_c_under_launch_is_one_line_and_exit_130", how=_L),
    "fresh_install_check.py --dry-run": Step(3, "tests/config/test_bad_inputs.py::test_fresh_install_check_reads_the_readme_install_lines_and_every_snippet (1 s alone)", how=_L),
    "start line run (captured)": Step(57, "tests/trainer/test_start_line.py (a TRL SFT or Trainer run of 2 steps)", how=_L),
    "start line run on a terminal": Step(47, "tests/trainer/test_start_line.py (the same on a pseudo-terminal)", how=_L),
    "crash-safe checkpoint worker": Step(50, "tests/trainer/test_crash_safe_checkpoints.py::crashed (forks, kills during "
                                             "saves; 236 s here under load 6-9)", how=_S),
    "plan --timeline subprocess": Step(60, "tests/plan/test_plan_cli.py::test_timeline_with_the_default_dtype_traces_and_prints_one_unit", how=_L),
    "plan lean head probe": Step(25, "tests/plan/test_plan_lean_head.py (one forward + backward of the head at "
                                     "TEST_SHAPES; the 4096 x 32000 shapes: benchmarks/bench_lean_head.py --formula)", how=_L),
    "transformers 4.57 venv refuses tp": Step(49, "tests/parallel/test_nd_parallel.py::test_transformers_457_refuses_tensor_parallel_with_versions_named", how=_L),
    "kernel hand-off checks (own pytest)": Step(123, "tests/packing/test_packing_hybrid_kernels.py", how=_L),
    "gpu_check.py on the CPU": Step(40, "tests/project/test_gpu_check.py (the driver without CUDA, the offline install "
                                        "of its set-up script)", how=_L),
    "setup_env.sh refuses a missing lock": Step(30, "tests/project/test_lock.py::test_setup_env_passes_the_lock_as_constraints_and_refuses_a_missing_one", how=_L),
    "mkdocs build --strict": Step(66, "tests/project/test_docs.py::site", how="the build alone, this host shared (load 6-9)"),
    # ---- launches of ranks (torch.distributed.run / hf-gradfix launch), gloo on 127.0.0.1
    "signal probe launch, 1 rank": Step(13, "tests/trainer/test_harness_selfcheck.py::test_a_launch_is_relaunched_once_for_a_rank_killed_by_a_signal_never_for_an_exception (38 s for its 3 launches)", how=_L),
    "ddp_worker.py launch": Step(68, "tests/trainer/test_harness_selfcheck.py::test_c_ddp_llama_stock_exact, "
                                     "benchmarks/exactness_report.py (harness.run_ddp)", how=_L),
    "ddp_worker.py --jobs launch": Step(120, "tests/parallel/test_ddp.py (harness.run_ddp_many: every DDP job in one launch)", how=_G),
    "nonfinite_worker.py launch": Step(74, "tests/trainer/test_nonfinite.py::test_two_ranks_agree_to_skip_when_one_rank_sees_a_nan", how=_L),
    "ddp_packing_worker.py launch": Step(59, "tests/packing/test_packing_stream.py, tests/packing/test_packing_trainer.py", how=_L),
    "vlm_loss_worker.py launch": Step(290, "tests/loss/test_vlm_families.py, benchmarks/bench_vlm_loss.py (18 VLM cases in one 2-rank launch)",
                                      how="one run of its test, this 2-core host shared (load average 8-10)"),
    "token_window_worker.py launch": Step(56, "tests/loss/test_token_window.py", how=_L),
    "gns DDP worker launch": Step(73, "tests/diagnostics/test_noise_scale.py::test_ddp_small_batches_are_local_and_big_batch_global", how=_L),
    "hf-gradfix launch of ZeRO-3": Step(70, "tests/parallel/test_deepspeed_config.py::test_hf_gradfix_launch_runs_zero3_on_cpu", how=_L),
    "verify launch under hf-gradfix launch": Step(74, "tests/verify/test_verify.py::test_two_ranks_through_hf_gradfix_launch, "
                                                       "tests/verify/test_verify.py::test_user_script_on_two_ranks_through_hf_gradfix_launch, "
                                                       "tests/verify/test_verify.py::_launch_verify", how=_L),
    "optim_dist_worker.py launch": Step(84, "tests/optim/test_optim_distributed.py", how=_L),
    "optim_dist_worker.py gloo collective": Step(84, "tests/support/optim_dist_worker.py (dist.init_process_group's "
                                                     "timeout: a rank waiting on a collective the other never joins)",
                                                 how="the whole launch's time (no collective waits longer): " + _L),
    "cp_worker.py launch": Step(89, "tests/parallel/test_context_parallel.py (2 and 4 ranks)", how=_S),
    "ep_worker.py launch": Step(55, "tests/parallel/test_ep.py", how=_S),
    "deepspeed_worker.py launch": Step(108, "tests/parallel/test_deepspeed.py", how=_S),
    "nd_worker.py launch": Step(106, "tests/parallel/test_nd_parallel.py (4 ranks)", how=_S),
    "pp_worker.py launch": Step(65, "tests/parallel/test_pipeline.py (2 ranks; pp x dp_replicate on 4)", how=_S),
    "rl_worker.py launch": Step(120, "tests/rl/test_rl.py, benchmarks/rl_report.py", how=_G),
    "rl_async_runs.py launch": Step(120, "tests/rl/test_rl_async.py", how=_G),
    # ---- polling loops
    "heartbeat thread speaks twice": Step(0.2, "tests/verify/test_verify.py::test_progress_heartbeat_speaks_after_a_silent_interval_and_only_then",
                                          how="0.05 s interval: two lines in ~0.1-0.2 s"),
}

#: the time limits in tests/ that are what a test proves, not a hang bound: "path::function" -> what it proves.
#: tests/project/test_time_bounds.py accepts a clock comparison only in these functions.
NOT_HANG_BOUNDS: dict[str, str] = {
    "tests/config/test_bad_inputs.py::_bounded": (
        "a hostile configuration file (a billion-laughs YAML, a huge token budget) is refused with bounded work: "
        "CPU seconds of the test's own process (time.process_time), not the wall clock"),
    "tests/plan/test_plan_cli.py::test_missing_matplotlib_is_found_before_any_work": (
        "the missing matplotlib is found before any work (the model is never loaded: a monkeypatched loader "
        "raises); the 5 CPU seconds only back that up"),
    "tests/packing/test_packing_binpack.py::test_fill_on_lognormal_100k": (
        "the packer's speed target (100k lengths in < 5 s): CPU seconds of the process"),
    "tests/packing/test_packing_binpack.py::test_speed_1m": (
        "the packer's speed targets (1M lengths: numpy <= 5 s, numba <= 1 s, best of 3): CPU seconds of the process"),
    "tests/project/test_gpu_check.py::test_a_section_past_its_budget_keeps_its_finished_rows": (
        "a section past its 0.5 s budget is cut where it stands (with 3 <= rows < 100 of its 100 x 0.05 s) and the "
        "next section still runs: the whole run within 30 s of wall clock (the budget is the product's own clock; "
        "the run takes about 1 s)"),
    "tests/project/test_gpu_check.py::test_vlm_section_runs_on_cpu_within_30_s_and_renders": (
        "issue 52: the GPU check's vlm section at --quick on CPU stays a smoke run (< 30 CPU seconds of the process, "
        "time.process_time; about 4-8 s measured)"),
}


def bound(step: str) -> float:
    """The hang bound of ``step`` (seconds): ``max(FLOOR_S, FACTOR x measured)``. A step not in :data:`STEPS` is an
    error (every bound is named and measured)."""
    if step not in STEPS:
        raise KeyError(f"hang_bound: step {step!r} is not in STEPS (tests/support/hang_bound.py); add it with its "
                       "measured time alone on the slower 2-core host")
    return STEPS[step].bound_s


def message(step: str) -> str:
    """The one line a fired bound says."""
    s = STEPS[step]
    return (f"HANG: step {step!r} exceeded its hang bound of {s.bound_s:g} s "
            f"(measured ~{s.measured_s:g} s alone on the slower 2-core host)")


def _kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and, where it leads its own process group (``run`` starts it so), the whole group."""
    if proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _tail(text) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-4000:]


def _fire(step: str, proc: subprocess.Popen, out=None, err=None) -> AssertionError:
    _kill(proc)
    try:
        more_out, more_err = proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        more_out = more_err = None
    out, err = out or more_out, err or more_err
    if out or err:  # the step's output, for the record (pytest shows the captured stderr under the failure)
        print(f"{message(step)}\nstdout tail:\n{_tail(out)}\nstderr tail:\n{_tail(err)}", file=sys.stderr)
    return AssertionError(message(step))


def communicate(proc: subprocess.Popen, *, step: str, input=None):
    """``proc.communicate(input)`` under ``step``'s hang bound; on expiry the process (group) is killed and an
    ``AssertionError`` says ``HANG: ...`` in one line."""
    try:
        return proc.communicate(input, timeout=bound(step))
    except subprocess.TimeoutExpired as e:
        raise _fire(step, proc, e.stdout, e.stderr) from None


def wait(proc: subprocess.Popen, *, step: str) -> int:
    """``proc.wait()`` under ``step``'s hang bound (see :func:`communicate`)."""
    try:
        return proc.wait(timeout=bound(step))
    except subprocess.TimeoutExpired:
        raise _fire(step, proc) from None


def run(cmd, *, step: str, input=None, capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` under ``step``'s hang bound. The command starts its own process group
    (``start_new_session``) so that a hang, or the test's own interruption, kills it with everything it started
    (a launch's ranks)."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kwargs.setdefault("stdin", subprocess.PIPE)
    kwargs.setdefault("start_new_session", True)
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            out, err = communicate(proc, step=step, input=input)
        except BaseException:  # the bound fired, or the test was interrupted (Ctrl-C): nothing left running
            _kill(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Deadline:
    """A polling loop's hang bound: ``check()`` raises the ``HANG: ...`` line once ``step``'s bound has passed."""

    def __init__(self, step: str) -> None:
        self.step, self.until = step, time.monotonic() + bound(step)

    def check(self, detail: object = "") -> None:
        if time.monotonic() >= self.until:
            raise AssertionError(message(self.step) + (f"; {detail}" if detail != "" else ""))


def deadline(step: str) -> Deadline:
    return Deadline(step)
