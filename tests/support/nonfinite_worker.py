"""Worker for test_nonfinite's two-process run: one rank's micro-batch has a NaN loss, on_nonfinite=skip.

Run under torch.distributed.run (gloo, CPU).  Rank r writes ``rank{r}.json``: per optimizer step whether the
parameters are bit-equal to the previous step's and finite, and the NonFiniteWarning messages it saw.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

for _p in (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import harness as H  # noqa: E402
from multiproc import finish_distributed  # noqa: E402
import hf_gradfix  # noqa: E402
from hf_gradfix.integration.diagnostics.nonfinite import NonFiniteWarning  # noqa: E402

MARK = 3


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class Record(TrainerCallback):
    def __init__(self):
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({k: v.detach().clone() for k, v in model.named_parameters()})


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    samples = H.make_samples("causal", n=8, seed=0, lo=4, hi=12)
    # accelerate shards sequential batches of 1 round-robin: rank 1 gets samples 1, 3, 5, 7; with ga 2 its
    # step-2 micro-batch 2 is sample 7, the only one with the marker (rank 0 never sees a NaN loss itself)
    samples[7]["input_ids"] = [MARK] + list(samples[7]["input_ids"][1:])
    model = H.build_model("llama", seed=0)
    model.get_input_embeddings().register_forward_hook(
        lambda m, a, o: o * float("nan") if (a[0] == MARK).any() else o
    )
    hf_gradfix.patch({"loss": {"on_nonfinite": "skip"}})
    rec = Record()
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), optim="adamw_torch", learning_rate=1e-2, max_grad_norm=0.0,
        gradient_accumulation_steps=2, per_device_train_batch_size=1, max_steps=3, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=3, remove_unused_columns=False, logging_steps=1,
    )
    trainer = InOrder(model=model, args=args, train_dataset=H.TokenDataset(samples), callbacks=[rec])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(rec.params, rec.params[1:])]
    finite = [all(bool(torch.isfinite(v).all()) for v in p.values()) for p in rec.params]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "same_as_previous": same, "finite": finite,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NonFiniteWarning)],
    }))
    finish_distributed()


if __name__ == "__main__":
    main()
