"""2-process gloo worker for the VLM loss check (``vlm_loss.py``): every case of ``--cases`` in turn, in this one
launch. Each rank trains the case (SGD lr 0, bs 2, GA 2, the harness's sequential sampler; accelerate gives rank r
the micro-batches r, r + 2, ...) and writes ``OUT/<case>/rank<r>.pt``: ``meta``, ``steps`` (the idx of every
micro-batch this rank trained in window k, the gradient at ``on_pre_optimizer_step``, the summed training_step
returns), ``logged_losses``; rank 0 adds ``initial_state``.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/vlm_loss_worker.py --out DIR --cases a,b
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import harness as H  # noqa: E402
import vlm  # noqa: E402
import vlm_loss as VL  # noqa: E402


class RecordingVLMCollator:
    """Records each micro-batch's sample idx (``.batches``, for the harness's recorder), strips ``idx`` and hands
    the rest to ``inner`` (``vlm.collate_processed`` or TRL's vision collator)."""

    def __init__(self, inner):
        self.inner = inner
        self.batches: list[list[int]] = []

    def __call__(self, features):
        self.batches.append([int(f["idx"]) for f in features])
        return self.inner([{k: v for k, v in f.items() if k != "idx"} for f in features])


def run_case(case: str, out: Path, rank: int) -> None:
    import transformers

    import time

    t0 = time.perf_counter()
    path, family, mode, tower = VL.parse(case)
    if mode == "patched":
        import hf_gradfix

        hf_gradfix.patch()
    model = VL.build_model(family, tower)
    processor = vlm.build_processor(family)
    samples = VL.samples_for(path, family)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = dict(output_dir=tempfile.mkdtemp(prefix="hgf_vlm_"), per_device_train_batch_size=VL.BS,
                gradient_accumulation_steps=VL.GA, num_train_epochs=1, optim="sgd", learning_rate=0.0,
                weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                save_strategy="no", use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False,
                remove_unused_columns=False, disable_tqdm=True, seed=0)
    recorder = H._make_recorder()
    if path == "trainer":
        pad = processor.tokenizer.pad_token_id
        collator = RecordingVLMCollator(lambda feats: vlm.collate_processed(family, feats, pad))
        data = VL.trainer_features(family, samples, processor)
        cls, targs = H._subclass(transformers.Trainer), transformers.TrainingArguments(**args)
        kw = dict(data_collator=collator)
    else:
        from trl import SFTConfig, SFTTrainer

        import datasets

        data = datasets.Dataset.from_list(samples)  # SFTTrainer takes datasets only; PNG-encoded images: lossless
        cls = H._subclass(SFTTrainer)
        targs = SFTConfig(**args, assistant_only_loss=(path == "trl"), completion_only_loss=(path == "trlpc"),
                          max_length=None, bf16=False)  # TRL defaults bf16=True (CPU autocast): fp32 is compared
        kw = dict(processing_class=processor)
        collator = None
    dataset = H.ListDataset(data) if path == "trainer" else data
    trainer = cls(model=model, args=targs, train_dataset=dataset, callbacks=[recorder], **kw)
    if collator is None:  # TRL built its own vision collator: record around it
        collator = RecordingVLMCollator(trainer.data_collator)
        trainer.data_collator = collator
    recorder.trainer, recorder.collator = trainer, collator
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    meta = dict(case=case, rank=rank, model_accepts_loss_kwargs=getattr(trainer, "model_accepts_loss_kwargs", None),
                collator=type(getattr(collator, "inner", collator)).__name__,
                inner_collator=type(trainer.data_collator.inner).__name__, seconds=time.perf_counter() - t0)
    payload = dict(meta=meta, steps=recorder.steps, logged_losses=logged)
    if rank == 0:
        payload["initial_state"] = initial
    torch.save(payload, out / case / f"rank{rank}.pt")


def main() -> None:
    from multiproc import run_cases

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    out = Path(a.out)

    def cleanup(_name):
        import hf_gradfix

        hf_gradfix.unpatch()

    run_cases(a.cases.split(","), out, rank, lambda name: run_case(name, out, rank), cleanup=cleanup)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
