"""DeepSpeed ZeRO worker (CPU, gloo): several cases in sequence inside ONE torch.distributed.run launch of 2 processes.

Run (normally through ``test_deepspeed.py``)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
        --master_port PORT tests/support/deepspeed_worker.py --out DIR --cases z2_llama_stock,z2_llama_ours,...

A case is ``z<stage>_<model case>_<stock|ours>``: the tiny fp32 model of ``harness.build_model`` trained by a
``transformers.Trainer`` with ``TrainingArguments(deepspeed={zero stage ...}, use_cpu=True)``, SGD lr 1, bs 1, GA 2,
``max_grad_norm=0``, 12 samples arranged so rank 0 gets the shortest and rank 1 the longest (very unequal targets).
``ours`` calls ``hf_gradfix.patch()`` first; ``stock`` does not. Each optimizer step's update is read from the full
fp32 weights before and after (gathered under ZeRO-3) and compared by the test with the one-process ground truth of
the samples both ranks consumed in that window. Rank r writes ``DIR/<case>/rank{r}.pt``.

DeepSpeed builds a shared-memory all-reduce op with g++ on its first ``init_distributed`` (330 s measured on 2 busy
cores, then 17 s a launch from the cache); the worker avoids it by telling DeepSpeed the op is not available (its collectives then go through torch's gloo), which
is what it does on any machine where the op cannot be built.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import harness  # noqa: E402
import multiproc  # noqa: E402

N_SAMPLES = 12
LR = 1.0
NAN_POSITION = 5  # arranged position: rank 1, window 2, micro-batch 1

# model case -> (harness arch, options)
MODEL_CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"eval": True}),  # and eval_loss after training
    "nokwargs": ("nokwargs", {}),  # forward without **kwargs: the Trainer passes no token count
    "avgfalse": ("llama", {"args": {"average_tokens_across_devices": False}}),
    "override": ("llama", {"tutorial": True}),  # compute_loss returning outputs.loss (a per-micro-batch mean)
    "tokcls": ("llama_tokcls", {}),  # a token-classification head
    "ga3": ("llama", {"ga": 3}),
    "lora": ("llama", {"lora": True}),  # a PEFT LoRA model (frozen base, partitioned too under ZeRO-3)
    # loss.head: lean (issue 40): the plain head is whole inside its forward (lean); a LoRA head's adapter is not
    # (gathered only by its own call): found in the forward, the stock head
    "lean": ("llama", {"gradfix": {"loss": {"head": "lean"}}}),
    "leanlora": ("llama", {"lora": ["q_proj", "lm_head"], "gradfix": {"loss": {"head": "lean"}}}),
    "sft": ("llama", {"sft": True}),  # TRL's SFTTrainer on pre-tokenized rows of a datasets.Dataset  # GA 3 on 12 samples: the last window of each rank is partial
    "nonfinite_skip": ("llama", {"nan_sample": True, "gradfix": {"loss": {"on_nonfinite": "skip"}}}),
    "nonfinite_warn": ("llama", {"nan_sample": True, "gradfix": {"loss": {"on_nonfinite": "warn"}}}),
    "nonfinite_error": ("llama", {"nan_sample": True, "gradfix": {"loss": {"on_nonfinite": "error"}}}),
    # the accelerate-YAML route (`gradient_clipping: 0.0` in deepspeed_config, no deepspeed= in TrainingArguments):
    # accelerate drops the 0 and DeepSpeed clips at its default 1.0 while max_grad_norm is 0
    "clip_mismatch": ("llama", {"accelerate_env": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                                   "ACCELERATE_GRADIENT_CLIPPING": "0.0",
                                                   "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}}),
    # per-rank memory of the model state under ZeRO, AdamW (for the planner comparison; no exactness check)
    "mem": ("llama", {"args": {"optim": "adamw_torch"}, "memory": True}),
    "memoffload": ("llama", {"args": {"optim": "adamw_torch"}, "memory": True,
                             "ds": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                                    "zero_force_ds_cpu_optimizer": False}}),
    "galore_refused": ("llama", {"gradfix": {"optimizer": {"name": "galore_adamw", "rank": 4}}}),
}


def model_state_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds of parameters, fp32 master partition and optimizer state (DeepSpeed's own tensors)."""
    def nbytes(tensors):
        return int(sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)))

    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() >= 3:
        param_b = nbytes(p.ds_tensor for p in params)
        master = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    else:
        param_b = nbytes(params)
        master = getattr(engine.optimizer, "single_partition_of_fp32_groups", [])
    state = [v for st in engine.optimizer.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    on_cpu = all(t.device.type == "cpu" for t in master)
    return dict(parameters=param_b, master_weights=nbytes(master), optimizer_state=nbytes(state),
                n_params=int(sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)), master_on_cpu=on_cpu)


def build_case_model(model_case: str):
    """The case's model, the same on every rank and in the test's ground truth."""
    arch, opts = MODEL_CASES[model_case]
    model = harness.build_model(arch, 0)
    if opts.get("lora"):
        import peft

        torch.manual_seed(1)
        on_head = isinstance(opts["lora"], list)  # adapters on the given modules, B random (the head's matters)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=opts["lora"] if on_head else ["q_proj", "v_proj"],
            init_lora_weights=not on_head))
    return model


def offline_tokenizer():
    """A word-level tokenizer over the harness vocabulary (token i is the word "i"), built offline."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(harness.VOCAB)}, unk_token="3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")


def ds_config(stage: int, extra: dict | None = None) -> dict:
    cfg = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }
    extra = dict(extra or {})
    cfg["zero_optimization"].update(extra.pop("zero_optimization", {}))
    cfg.update(extra)
    return cfg


def parse_case(name: str) -> tuple[int, str, bool]:
    stage, *model, mode = name.split("_")
    return int(stage[1:]), "_".join(model), mode == "ours"


class TutorialTrainer:  # the docs' compute_loss pattern (mixed in front of transformers.Trainer)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value (ZeRO-3 partitions are gathered; a collective on every rank)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: p.detach().clone().float().cpu() for k, p in params.items()}


def _recorder():
    from transformers import TrainerCallback

    class UpdateRecorder(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.collator = None
            self.steps: list[dict] = []
            self._seen = 0
            self.before = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            tr = self.trainer
            n = tr._hgf_consumed
            batches = self.collator.batches[self._seen : n]
            self._seen = n
            after = full_weights(tr.model_wrapped.module if hasattr(tr.model_wrapped, "module") else tr.model)
            update = {k: (self.before[k] - after[k]) / LR for k in after}
            self.steps.append(dict(idx_batches=[list(b) for b in batches], update=update, before=self.before))
            self.before = after

    return UpdateRecorder()


def run_case(name: str, out: Path, rank: int, world: int) -> None:
    import transformers
    from transformers.trainer_callback import PrinterCallback

    import hf_gradfix

    stage, model_case, ours = parse_case(name)
    arch, opts = MODEL_CASES[model_case]
    task = harness.task_of(arch)
    if ours:
        hf_gradfix.patch(opts.get("gradfix"))
    model = build_case_model(model_case)  # before TrainingArguments: no zero.Init, the engine partitions it
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    samples = harness.make_samples(task, n=N_SAMPLES, seed=0)
    ga = int(opts.get("ga", 2))
    samples = harness.arrange_for_ranks(samples, world, 1)
    nan_idx = None
    if opts.get("nan_sample"):
        # rank 1's first micro-batch of the second window (arranged position 5) gets the marker token: the embedding
        # output of that micro-batch becomes NaN, so its loss and every gradient of the window are NaN
        samples[NAN_POSITION]["input_ids"] = [harness.MASK_ID] + list(samples[NAN_POSITION]["input_ids"][1:])
        nan_idx = samples[NAN_POSITION]["idx"]
        model.get_input_embeddings().register_forward_hook(
            lambda m, a, o: o * float("nan") if (a[0] == harness.MASK_ID).any() else o
        )
    os.environ.update(opts.get("accelerate_env", {}))  # removed again by main() after the case
    collator = harness.RecordingCollator(task, harness.pad_id_of(model))
    recorder = _recorder()
    recorder.collator = collator
    args_cls, sft_args, trainer_kwargs = transformers.TrainingArguments, {}, {}
    dataset = harness.ListDataset(samples)
    if opts.get("sft"):
        import datasets
        import trl

        args_cls = trl.SFTConfig
        sft_args = dict(bf16=False, fp16=False, max_length=None, packing=False, dataset_num_proc=None)
        trainer_kwargs = dict(processing_class=offline_tokenizer())
        dataset = datasets.Dataset.from_list(samples)
    args = args_cls(
        **sft_args,
        output_dir=str(out / name / f"trainer_rank{rank}"),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=ga,
        num_train_epochs=1,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        deepspeed=None if opts.get("accelerate_env") else ds_config(stage, opts.get("ds")),
        **{"optim": "sgd", **opts.get("args", {})},
    )
    base = transformers.Trainer
    if opts.get("sft"):
        import trl

        base = trl.SFTTrainer
    if opts.get("tutorial"):
        base = type("TutorialTrainer", (TutorialTrainer, transformers.Trainer), {})
    payload: dict = dict(case=name, rank=rank, stage=stage, model_case=model_case, trainer_class=base.__name__, ours=ours, arch=arch, task=task,
                         nan_idx=nan_idx)
    try:
        trainer = harness._subclass(base)(
            model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[recorder],
            **trainer_kwargs,
        )
    except Exception as err:  # noqa: BLE001 - a refused setup records the message
        if not model_case.endswith("_refused"):
            raise
        payload["error"] = f"{type(err).__name__}: {err}"
        torch.save(payload, out / name / f"rank{rank}.pt")
        return
    trainer.remove_callback(PrinterCallback)
    recorder.trainer = trainer
    recorder.before = {k: v.clone() for k, v in initial.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
        except Exception as err:  # noqa: BLE001 - cases that must refuse record the message
            if not model_case.endswith(("_error", "mismatch")):
                raise
            payload["error"] = f"{type(err).__name__}: {err}"
    payload["warnings"] = [str(w.message) for w in caught]
    state = hf_gradfix.state_of(trainer)
    lean = getattr(state, "lean", None) if state is not None else None
    payload["lean"] = (lean.calls, lean.stock_calls, dict(lean.refused)) if lean is not None else None
    payload.update(
        steps=recorder.steps,
        logged_losses=[float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
        engine=type(trainer.model_wrapped).__name__,
        zero_stage=int(trainer.accelerator.deepspeed_plugin.zero_stage) if trainer.accelerator.deepspeed_plugin else None,
    )
    if opts.get("memory"):
        payload["memory"] = model_state_bytes(trainer.model_wrapped)
    if opts.get("eval") and "error" not in payload:
        eval_samples = samples[: N_SAMPLES - 1]  # 11 samples, bs 2, 2 ranks: accelerate pads the last batch
        metrics = trainer.evaluate(eval_dataset=harness.ListDataset(eval_samples))
        payload.update(eval_loss=metrics["eval_loss"], eval_samples=[s["idx"] for s in eval_samples])
        payload["final_weights"] = full_weights(trainer.model_wrapped.module)
    if rank == 0:
        payload["samples"] = samples
        payload["initial"] = initial
    torch.save(payload, out / name / f"rank{rank}.pt")
    del trainer
    hf_gradfix.unpatch()


def _reset_between_cases() -> None:
    from accelerate.state import AcceleratorState

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # here, not at import: test_deepspeed imports this module
    import deepspeed
    import deepspeed.ops

    # No shared-memory all-reduce op: DeepSpeed's own fallback when the op cannot be built (its collectives then
    # run through torch.distributed's gloo). Saves the g++ build of deepspeed_shm_comm (45 s - 5 min).
    deepspeed.ops.__compatible_ops__ = {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(a.out)
    import hf_gradfix

    def cleanup(name: str) -> None:
        for key in MODEL_CASES[parse_case(name)[1]][1].get("accelerate_env", {}):
            os.environ.pop(key, None)
        hf_gradfix.unpatch()
        _reset_between_cases()

    multiproc.run_cases(a.cases.split(","), out, rank, lambda name: run_case(name, out, rank, world), cleanup=cleanup)


if __name__ == "__main__":
    main()
