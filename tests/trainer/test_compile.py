"""torch.compile through the plugin (issue 39): the first-compile notice comes before anything is compiled, and the
compiled model's training is exact against the ground truth (plain PyTorch, one process, each sample alone).

The notice's structural check: torch's own dynamo counter of compiled frames is read when the notice is logged (0:
nothing compiled yet) and after training (> 0: the run did compile, so the check could have failed)."""

from __future__ import annotations

import logging

import pytest
import torch

import harness as H
import hf_gradfix
from hf_gradfix.integration.diagnostics.first_run import compile_notice

TOL = 1e-5


class _FramesAtNotice(logging.Handler):
    def __init__(self):
        super().__init__()
        self.frames: list[int] = []

    def emit(self, record):
        if "torch.compile is on" in record.getMessage():
            from torch._dynamo.utils import counters

            self.frames.append(sum(counters["frames"].values()))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_is_exact_and_announced_before_compiling(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen = _FramesAtNotice()
    logging.getLogger("hf_gradfix").addHandler(seen)
    hf_gradfix.patch()
    try:
        samples = H.make_samples("causal", n=8 if backend == "aot_eager" else 4, seed=0)
        record = H.run_trainer(H.build_model("llama"), samples, "causal",
                               extra_args={"torch_compile": True, "torch_compile_backend": backend})
    finally:
        hf_gradfix.unpatch()
        logging.getLogger("hf_gradfix").removeHandler(seen)
    assert seen.frames == [0], seen.frames  # announced once, before the first compiled frame
    assert sum(counters["frames"].values()) > 0  # control: the run did compile
    errors = H.check_against_gt(lambda: H.build_model("llama"), samples, "causal", record)
    assert errors and all(g <= TOL and (l is None or l <= TOL) for g, l in errors), errors


def test_no_compile_no_notice():
    trainer = H.make_trainer(H.build_model("llama"), H.make_samples("causal", n=4, seed=0), "causal")
    assert compile_notice(trainer) is None
    trainer.model_wrapped = torch.compile(trainer.model)  # a model the user compiled before handing it in
    assert "a torch.compile'd model" in compile_notice(trainer)


def test_a_compiled_model_keeps_the_stock_head_under_loss_head_lean_and_says_why():
    """loss.head: lean swaps the head's forward per call, which a compiled graph would retrace every micro-batch: a
    compiled model keeps the stock head (one warning naming torch.compile), exact."""
    import warnings

    from hf_gradfix.integration.state import state_of

    hf_gradfix.patch({"loss": {"head": "lean"}, "log_fixes": False})
    try:
        samples = H.make_samples("causal", n=8, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = H.run_trainer(H.build_model("llama"), samples, "causal",
                                   extra_args={"torch_compile": True, "torch_compile_backend": "aot_eager"})
    finally:
        hf_gradfix.unpatch()
    said = [str(w.message) for w in caught if "loss.head: lean" in str(w.message)]
    plan = state_of(record.trainer).lean
    assert plan.calls == 0 and plan.stock_calls > 0 and len(said) == 1 and "torch.compile'd" in said[0], (plan, said)
    errors = H.check_against_gt(lambda: H.build_model("llama"), samples, "causal", record)
    assert errors and all(g <= TOL and (l is None or l <= TOL) for g, l in errors), errors
