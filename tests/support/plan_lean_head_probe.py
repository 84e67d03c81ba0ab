"""Peak resident memory of the lean head's forward + backward on real tensors (one process per measurement, so the
peak is this call's alone): tests/plan/test_plan_lean_head.py compares it with hf_gradfix.plan.lean_head's formula.

usage: python tests/support/plan_lean_head_probe.py TOKENS HIDDEN VOCAB fp32|bf16-autocast   (prints one JSON line)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
