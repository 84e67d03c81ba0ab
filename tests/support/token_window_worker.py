"""2-process worker for ``tests/loss/test_token_window.py`` (gloo, CPU, launched with ``torch.distributed.run``).

A plain accelerate loop (``Accelerator(cpu=True, gradient_accumulation_steps=GA)``, prepared DDP model, SGD lr 0)
over hand-made per-rank micro-batches (bs 1, GA 3, no dataloader sharding, so the data per rank is fixed here):

* rank 0: the 4 shortest samples; the first three have every label -100 (an empty window), so its windows are
  [3 empty], [1 real + 2 padding], [2 padding] (it runs out of data before rank 1);
* rank 1: the 8 longest samples: windows [3], [3], [2] (a partial last window).

Pass ``model``: ``model(**batch, num_items_in_batch=micro.num_items_in_batch)`` + ``micro.model_loss``.
Pass ``mean_aux``: ``micro.loss_from_mean(out.loss)`` + ``micro.mean_term(AUX_COEF * aux)`` with
``aux = logits.pow(2).mean()`` of the micro-batch (a per-micro-batch mean).

Writes ``OUT/rank{r}.pt``: samples, per-rank idx lists, initial state, and per pass and window: real idx batches,
gradient (after the DDP all-reduce), ``window.loss``, ``window.num_items``, ``window.mean_terms``; plus the number
of optimizer steps that really ran.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import harness as H  # noqa: E402

GA = 3
AUX_COEF = 0.5
EMPTY = (0, 1, 2)  # positions (in length order) whose labels are all -100


def rank_data(samples: list[dict]) -> list[list[int]]:
    """idx of each rank's samples (one sample per micro-batch): 4 shortest for rank 0, 8 longest for rank 1."""
    order = [s["idx"] for s in sorted(samples, key=lambda s: (len(s["input_ids"]), s["idx"]))]
    return [order[:4], order[4:]]


def build_samples() -> list[dict]:
    samples = H.make_samples("causal", n=12, seed=0)
    short = rank_data(samples)[0]
    for pos in EMPTY:
        s = samples[short[pos]]
        s["labels"] = [H.IGNORE_INDEX] * len(s["labels"])
    return samples


def aux_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().pow(2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from accelerate import Accelerator

    from hf_gradfix import TokenWindow

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GA)  # backward divides by GA: TokenWindow undoes it
    rank = accelerator.process_index
    assert accelerator.num_processes == 2, accelerator.num_processes
    model = H.build_model("llama", seed=0)
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    samples = build_samples()
    by_idx = {s["idx"]: s for s in samples}
    mine = rank_data(samples)[rank]
    collate = H.RecordingCollator("causal", H.pad_id_of(model)).collate
    batches = [dict(collate([by_idx[i]]), idx=[i]) for i in mine]

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps_run = [0]
    optimizer.register_step_post_hook(lambda *a, **k: steps_run.__setitem__(0, steps_run[0] + 1))
    ddp_model, optimizer = accelerator.prepare(model, optimizer)

    passes = {}
    for mode in ("model", "mean_aux"):
        windows = []
        tw = TokenWindow(accelerator, batches, GA, model=ddp_model, count_rule="shifted")
        for window in tw:
            real = []
            for batch, micro in window:
                if not micro.is_padding:
                    real.append(list(batch["idx"]))
                inputs = {k: v for k, v in batch.items() if k != "idx"}
                if mode == "model":
                    out = ddp_model(**inputs, num_items_in_batch=micro.num_items_in_batch)
                    loss = micro.model_loss(out.loss)
                else:
                    out = ddp_model(**inputs)
                    loss = micro.loss_from_mean(out.loss) + micro.mean_term(AUX_COEF * aux_of(out.logits))
                accelerator.backward(loss)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            windows.append(dict(idx_batches=real, grads=grads, loss=window.loss, num_items=window.num_items,
                                mean_terms=window.mean_terms, num_micro=window.num_micro_batches))
            optimizer.step()
            optimizer.zero_grad()
        passes[mode] = windows

    torch.save(dict(samples=samples, rank_idx=rank_data(samples), initial_state=initial_state, passes=passes,
                    steps_run=steps_run[0]), Path(args.out) / f"rank{rank}.pt")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    from multiproc import finish_distributed

    finish_distributed()


if __name__ == "__main__":
    main()
