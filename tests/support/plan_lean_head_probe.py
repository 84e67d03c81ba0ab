"""Peak resident memory of the lean head's forward + backward on real tensors (one process per measurement, so the
peak is this call's alone): tests/plan/test_plan_lean_head.py compares it with hf_gradfix.plan.lean_head's formula.

usage: python tests/support/plan_lean_head_probe.py TOKENS HIDDEN VOCAB fp32|bf16-autocast   (prints one JSON line)

The test's shapes (:data:`TEST_SHAPES`) run in seconds on a CPU (issue 54: a bf16-autocast head of 4,096 x 32,000
took over 300 s on a loaded 2-core machine); the large ones (:data:`BENCH_SHAPES`) run in
``python benchmarks/bench_lean_head.py --formula``. :func:`formula_errors` is the comparison both make.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


#: (tokens, hidden, vocab, mode) the test measures: torch's op path (fp32) with its kept gradients well above the
#: resident set's noise (18 MiB); the chunks path (bf16 autocast) over two chunks of FALLBACK_ROWS tokens, so that
#: one chunk's transient, not the whole micro-batch's, is what the formula must count (24 MiB); ~4 s of CPU each
#: after the imports
TEST_SHAPES = [(2048, 128, 16000, "fp32"), (2048, 16, 2000, "bf16-autocast")]
#: the large shapes (the test's before issue 54): benchmarks/bench_lean_head.py --formula
BENCH_SHAPES = [(4096, 256, 32000, "fp32"), (4096, 256, 32000, "bf16-autocast")]


def formula_errors(tokens: int, hidden: int, vocab: int, mode: str, got: dict) -> dict:
    """The planner's formula (``hf_gradfix.plan.lean_head``) against a measurement ``got`` (this probe's JSON):
    ``{"path", "err", "control_err"}``: the relative error of the formula plus the gradients the probe's tensors
    receive, and (the control) of the other path's formula for the same shapes."""
    from hf_gradfix.plan.lean_head import FALLBACK_ROWS, lean_head_bytes, torch_chunk_rows

    compute = 4 if mode == "fp32" else 2
    this = lean_head_bytes(tokens, hidden, vocab, compute_bytes=compute, weight_bytes=4)
    if this["path"] == "torch":  # control: the chunks path's count for the same shapes
        other = {"kept": 0.0, "transient": float(min(tokens, FALLBACK_ROWS) * vocab * 12)}
    else:  # control: torch's op's count (its precomputed gradients and scratch) in the compute dtype
        rows = torch_chunk_rows(tokens, hidden, vocab)
        other = {"kept": float(compute * (tokens * hidden + vocab * hidden)),
                 "transient": float(compute * (vocab * hidden + rows * vocab + rows))}

    # torch's op keeps its precomputed gradients and hands them back as the gradients; the chunks keep their input
    # (the probe's own hidden states, allocated before the measurement) and the backward allocates the gradients
    def err(b, torch_path):
        held = b["kept"] if torch_path else got["grads"]
        return abs(held + b["transient"] - got["peak"]) / got["peak"]

    return {"path": this["path"], "err": err(this, this["path"] == "torch"),
            "control_err": err(other, this["path"] != "torch")}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def main(tokens: int, hidden: int, vocab: int, mode: str) -> None:
    import torch

    from hf_gradfix.loss.lean_head import head_cross_entropy_sum

    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16-autocast" else torch.float32
    h = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()  # stored fp32 (autocast casts it)
    t = torch.randint(0, vocab, (tokens,))

    def step():
        h.grad = w.grad = None
        loss = head_cross_entropy_sum(h, w, None, t, compute_dtype=None if dtype == torch.float32 else dtype)
        loss.backward()

    step()  # warm-up: allocator pools, kernels
    h.grad = w.grad = None
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    step()
    peak = (_kib("VmHWM") - before) * 1024
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    print(json.dumps({"peak": peak, "grads": grads}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
