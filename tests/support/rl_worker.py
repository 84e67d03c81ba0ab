"""RL worker (gloo on CPU) for ``tests/rl/test_rl.py``: each case one TRL GRPO run under ``hf_gradfix.patch()`` on every
rank of one ``torch.distributed.run`` launch; rank r writes ``DIR/<case>/rank{r}.pt`` with its gradients, the
micro-batches its loss function was given, its logged losses and the initial model.

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/rl_worker.py --out DIR --cases dapo_spg4,...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import multiproc  # noqa: E402
import rl_runs  # noqa: E402

# name -> run_rl keyword arguments
CASES = {
    "dapo_spg4": dict(loss_type="dapo", ga=2, spg=4),
    "bnpo_spg2": dict(loss_type="bnpo", ga=2, spg=2),
    "grpo_spg4": dict(loss_type="grpo", ga=2, spg=4),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    ns = parser.parse_args()
    out, rank = Path(ns.out), int(os.environ["RANK"])

    def run_one(name: str) -> None:
        # per_device 2, num_generations 4: a generation batch's groups straddle the two ranks
        mode = os.environ.get("HGF_RL_MODE", "patch")  # benchmarks/rl_report.py measures stock TRL with "stock"
        run = rl_runs.run_rl(**CASES[name], per_device=2, steps=2, mode=mode)
        torch.save({"grads": run.grads, "micro_batches": run.micro_batches, "logged": run.logged,
                    "config": run.config, "ga": run.ga, "initial": run.initial}, out / name / f"rank{rank}.pt")

    multiproc.run_cases(ns.cases.split(","), out, rank, run_one)


if __name__ == "__main__":
    main()
