"""DDP worker for packed training (gloo, CPU): run as
``python -m torch.distributed.run --nproc_per_node 2 tests/support/ddp_packing_worker.py OUT_DIR``.

Every rank trains a tiny Llama with ``hf_gradfix.patch({"packing": ...})``, SGD lr 0, GA 2, and writes
its gradients at every optimizer step (after the DDP all-reduce) and its logged losses to OUT_DIR.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import harness as H  # noqa: E402
import hf_gradfix  # noqa: E402

BUDGET, GA, SEED, N = 64, 2, 3, 20


def samples():
    return H.make_samples("causal", n=N, seed=0)


STREAM_BUFFER, STREAM_STEPS = 8, 2
END_GA = 3  # "stream_end": the stream's last window of each pass is shorter than GA; two passes


def stream():
    """The samples as a ``datasets`` streaming dataset (3 shards)."""
    import datasets

    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples()]
    return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3)


def _stream_end_steps() -> int:
    from hf_gradfix.packing.stream import StreamingPacker

    rows = len(list(StreamingPacker(stream(), BUDGET, buffer_size=STREAM_BUFFER, num_replicas=2)))
    return 2 * -(-rows // (2 * END_GA))


def main(out: str, streaming: bool = False, stream_end: bool = False, balance: str = "tokens") -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": STREAM_BUFFER,
                                  "balance": balance}})
    model = H.build_model("llama", attn_implementation="sdpa")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    capture = H.GradCapture()
    args = transformers.TrainingArguments(
        output_dir=f"{out}/trainer{rank}", optim="sgd", learning_rate=0.0, max_grad_norm=0.0,
        gradient_accumulation_steps=END_GA if stream_end else GA,
        per_device_train_batch_size=1, num_train_epochs=1, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=SEED, remove_unused_columns=False,
        max_steps=_stream_end_steps() if stream_end else STREAM_STEPS if streaming else -1,
    )
    dataset = stream() if streaming or stream_end else H.TokenDataset(samples())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[capture])
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    imbalance = [{k: v for k, v in h.items() if k.startswith("packing/")} for h in trainer.state.log_history
                 if "loss" in h]
    torch.save({"grads": capture.grads, "logged": logged, "init": init, "imbalance": imbalance},
               f"{out}/rank{rank}.pt")
    from multiproc import finish_distributed

    finish_distributed()


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    main(sys.argv[1], streaming=mode == "stream", stream_end=mode == "stream_end",
         balance="compute" if mode == "compute" else "tokens")
