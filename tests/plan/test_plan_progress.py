"""``hf-gradfix plan`` is never silent for long (issue 50, item 6): a progress line on stderr when each phase starts,
from before the first import of torch / transformers on, and a heartbeat while a phase runs long
(``hf_gradfix.progress``); stdout stays the table / the JSON. No wall-time bound here: the phases are checked by
their lines and their order, the heartbeat by a phase made slow on purpose.

Also the one reason ``loss.head: lean`` is not used, where it is not (it listed every possible cause)."""

from __future__ import annotations

import re
import time

import pytest

from hf_gradfix.plan.command import plan_main
from hf_gradfix.progress import Progress


def _texts(lines: list[str]) -> list[str]:
    return [line.split("] ", 1)[1] for line in lines]


def test_every_phase_says_a_line_when_it_starts_the_first_before_any_import(monkeypatch, capsys):
    """The phases of `hf-gradfix plan --simulate` in order, stamped with the seconds since the command started; the
    first (loading the config, which imports torch and transformers: 3-15 s) at 0.0 s, said before that import."""
    import hf_gradfix.plan.command as cli

    lines: list[str] = []
    seen = {}
    real = cli.load_model_config

    def load(spec):  # what was said when the config (and with it torch / transformers) starts loading
        seen["before_loading"] = list(lines)
        return real(spec)

    monkeypatch.setattr(cli, "load_model_config", load)
    with Progress("plan", emit=lines.append, heartbeat=False):  # the command's own session nests into this one
        # --seq-len 24: a shape no other test traces, so the closed form's trace runs here (it is cached per process)
        assert plan_main(["--model", "tiny-llama", "--seq-len", "24", "--dtype", "fp32", "--simulate", "--json"]) == 0
    assert seen["before_loading"] == ["plan: [0.0 s] loading tiny-llama's config (the first use imports torch and "
                                      "transformers) ..."]
    stamps = [float(re.match(r"plan: \[(\d+\.\d) s\] ", x)[1]) for x in lines]
    assert stamps == sorted(stamps), lines
    texts = _texts(lines)
    starts = ["loading tiny-llama's config", "counting tiny-llama's parameters", "the closed form",
              "tracing one forward and backward of 1 x 24", "simulating one training step", "model built",
              "step 1/2 traced", "step 2/2 traced"]
    at = [next(i for i, line in enumerate(texts) if line.startswith(s)) for s in starts]
    assert at == sorted(at), texts
    assert capsys.readouterr().out.lstrip().startswith("{")  # stdout: the JSON alone


def test_a_heartbeat_fires_while_a_phase_runs_long(monkeypatch):
    """The closed form made slow (its estimate sleeps 1 s) under a 0.1 s heartbeat: "still" lines repeat that phase
    while it runs; the control, the same slow phase with the heartbeat off, says it once. (The heartbeat's own rule
    on a fake clock: tests/verify/test_verify.py, the same module.)"""
    import hf_gradfix.plan.command as cli

    real = cli.estimate

    def slow(*args, **kwargs):
        time.sleep(1.0)  # sleeping releases the GIL: the heartbeat's thread runs meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "estimate", slow)
    still = "still the closed form: counting the activations ..."
    for heartbeat in (True, False):
        lines: list[str] = []
        with Progress("plan", interval=0.1, tick=0.02, emit=lines.append, heartbeat=heartbeat):
            assert plan_main(["--model", "tiny-llama", "--seq-len", "32"]) == 0
        beats = [x for x in _texts(lines) if x == still]
        assert len(beats) >= 3 if heartbeat else beats == [], lines  # about 10 in the second of sleep


def test_library_calls_write_nothing(caplog):
    """Without the command's session open, the library's phases (a fresh trace here) write nothing: a script that
    calls estimate() gets no progress lines."""
    import logging

    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, load_model_config

    logger = logging.getLogger("hf_gradfix")
    monkey = logger.propagate
    logger.propagate = True  # the plugin's logger does not propagate; caplog listens at the root
    try:
        with caplog.at_level(logging.INFO, logger="hf_gradfix"):
            estimate(load_model_config("tiny-llama"), ParallelDims(1), Settings(seq_len=20, dtype="fp32"))
    finally:
        logger.propagate = monkey
    assert not [r for r in caplog.records if "tracing" in r.getMessage()], caplog.records


@pytest.mark.parametrize("case, reason, others", [
    ("rl", "TRL's GRPOTrainer computes its loss with its own fused LM head", ("tensor parallel", "zero-bubble")),
    ("tp", "tp=2: tensor parallel shards the head", ("TRL", "zero-bubble", "FSDP2")),
    ("zero_bubble", "the zero-bubble schedule runs the last stage's backward twice", ("TRL", "tensor parallel")),
    ("pp_fsdp", "FSDP2 (dp_shard > 1) shards the last pipeline stage's head", ("TRL", "zero-bubble")),
])
def test_lean_not_used_names_the_one_reason_that_applied(case, reason, others):
    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, load_model_config
    from hf_gradfix.plan.rl import RLRun

    cfg = load_model_config("tiny-qwen2" if case == "rl" else "tiny-llama")
    base = dict(dtype="fp32", seq_len=32, loss_head="lean")
    mesh, s = {
        "rl": (ParallelDims(1), Settings(**base, recompute="full", rl=RLRun(prompt_len=8, completion_len=8,
                                                                            num_generations=1))),
        "tp": (ParallelDims(2, dp_shard=1, tp=2), Settings(**base)),
        "zero_bubble": (ParallelDims(1), Settings(**base, pp=2, pp_schedule="zero_bubble", grad_accum=2)),
        "pp_fsdp": (ParallelDims(2, dp_shard=2), Settings(**base, pp=2, grad_accum=2)),
    }[case]
    plan = estimate(cfg, mesh, s)
    how = plan.explain["activations"]
    assert f"loss.head lean is not used here ({reason}" in how, how
    tail = how.split("loss.head lean is not used here", 1)[1]
    assert not any(o in tail for o in others), tail
    assert plan.extra["stock_head_reason"].startswith(reason), plan.extra["stock_head_reason"]
