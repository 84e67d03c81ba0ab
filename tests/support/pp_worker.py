"""Pipeline-parallel worker (gloo on CPU): every case in sequence inside ONE torch.distributed.run launch.

Run (normally through ``test_pipeline.py``)::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/pp_worker.py --out DIR --cases pp2_1f1b_ga4,...

Every case builds the same tiny fp32 Llama (4 layers, GQA, untied, same seed on every rank), calls
``hf_gradfix.patch(<config with parallel.pp>)`` and trains a plain ``transformers.Trainer`` with SGD lr 0 (the
weights never change, so every window's gradient is compared against the same model) on 16 samples of 3-41 tokens,
half of them with most of their labels masked (very unequal targets per micro-batch). At each
``on_pre_optimizer_step`` every rank records the gradient of the parameters it holds (the model keeps only its
stage's), the micro-batches it consumed and, at the end, the logged losses and grad norms. Rank r writes
``DIR/<case>/rank{r}.pt``. Cases ending in ``_refused`` expect a refusal and record its message; cases ending in
``_stock`` run torch's default normalization (per-micro-batch mean, ``scale_grads=True``) through the same glue,
the negative control the exactness test must reject.
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

import harness  # noqa: E402
import multiproc  # noqa: E402

N_SAMPLES = 16
_LAUNCH_ENV = {k: os.environ[k] for k in ("HF_GRADFIX_CONFIG", "HF_GRADFIX_CONFIG_ORIGIN") if k in os.environ}
LLAMA = dict(harness.TINY_GQA_LLAMA, num_hidden_layers=4)

# name -> (hf_gradfix config, options)
CASES: dict[str, tuple[dict, dict]] = {
    # from_env: patch() with no argument reads the section `hf-gradfix launch` exported from configs/cpu_pp.yaml
    "pp2_1f1b_ga4": ({"parallel": {"pp": 2}}, {"ga": 4, "from_env": True}),
    "pp2_gpipe_ga4": ({"parallel": {"pp": 2, "pp_schedule": "gpipe"}}, {"ga": 4, "yaml": True, "eval": True}),
    # + after training, a second Trainer on the same (split) model must be refused on every rank, not hang
    "pp2_1f1b_ga1": ({"parallel": {"pp": 2}}, {"ga": 1, "second_trainer": True}),
    # the edges: 13 samples, bs 2, GA 4 -> windows of 4 and 3 micro-batches (the last one a single sample), 2 epochs
    "pp2_short_epochs2": ({"parallel": {"pp": 2}}, {"ga": 4, "n_samples": 13, "epochs": 2}),
    "pp2_interleaved_ga4": ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}}, {"ga": 4}),
    "pp2_zero_bubble_ga4": ({"parallel": {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2}}, {"ga": 4}),
    # one stage per rank: torch's interleaved schedules run it (measured), so it is accepted, not refused
    "pp2_zero_bubble_v1_ga4": ({"parallel": {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 1}}, {"ga": 4}),
    "pp2_1f1b_ga4_callback_clip": ({"parallel": {"pp": 2}}, {"ga": 4, "callback": True, "clip": 0.05}),
    "pp2_sft_ga4": ({"parallel": {"pp": 2}}, {"ga": 4, "sft": True}),  # TRL's SFTTrainer, a datasets.Dataset
    "sft_dft_refused": ({"parallel": {"pp": 2}}, {"ga": 4, "sft": True, "sft_args": {"loss_type": "dft"}}),
    "pp2_1f1b_ga4_stock": ({"parallel": {"pp": 2}}, {"ga": 4, "stock": True}),
    "pp2_tied_ga4": ({"parallel": {"pp": 2}}, {"ga": 4, "tied": True, "clip": 0.05}),
    # loss.head: lean at the last stage (issue 40): 1F1B with eval, tied embeddings, the zero-bubble schedule
    "pp2_1f1b_ga4_lean": ({"parallel": {"pp": 2}, "loss": {"head": "lean"}}, {"ga": 4, "eval": True}),
    "pp2_tied_ga4_lean": ({"parallel": {"pp": 2}, "loss": {"head": "lean"}}, {"ga": 4, "tied": True, "clip": 0.05}),
    "pp2_zero_bubble_ga4_lean": ({"parallel": {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2},
                                  "loss": {"head": "lean"}}, {"ga": 4}),
    # 4 processes (a separate launch): pp 2 x dp_replicate 2, ranks 0-1 stage 0, ranks 2-3 stage 1
    "pp2_rep2_1f1b_ga4": ({"parallel": {"pp": 2, "dp_replicate": 2, "dp_shard": 1}}, {"ga": 4, "eval": True}),
    "pp2_shard2_1f1b_ga4": ({"parallel": {"pp": 2, "dp_shard": 2}}, {"ga": 4, "clip": 0.05}),
    # pp 2 x tp 2 (same launch): ranks 0-1 stage 0 (layers tensor-parallel over them), ranks 2-3 stage 1
    "pp2_tp2_1f1b_ga4": ({"parallel": {"pp": 2, "tp": 2, "dp_replicate": 1, "dp_shard": 1}}, {"ga": 4, "clip": 0.05}),
    "pp2_rep2_1f1b_ga4_stock": ({"parallel": {"pp": 2, "dp_replicate": 2, "dp_shard": 1}}, {"ga": 4, "stock": True}),
    "galore_refused": ({"parallel": {"pp": 2}}, {"ga": 4, "args": {"optim": "galore_adamw", "optim_target_modules": ["q_proj"]}}),
    "loss_off_refused": ({"parallel": {"pp": 2}, "loss": {"enabled": False}}, {"ga": 4}),
    # 4 steps straight vs 2 steps + checkpoint + resume for 2 (AdamW lr 1e-2, GA 2): bit-identical weights
    "pp2_resume": ({"parallel": {"pp": 2}}, {"ga": 2, "resume": True}),
    # the same through torch distributed checkpoint's DTensor shards (4 processes, the second launch)
    "pp2_shard2_resume": ({"parallel": {"pp": 2, "dp_shard": 2}}, {"ga": 2, "resume": True}),
    "pp2_tp2_resume": ({"parallel": {"pp": 2, "tp": 2, "dp_replicate": 1, "dp_shard": 1}}, {"ga": 2, "resume": True}),
}


def build_model(tied: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(**dict(LLAMA, tie_word_embeddings=tied))
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()
    model.train()
    return model


def make_samples(n: int = N_SAMPLES) -> list[dict]:
    samples = harness.make_samples("causal", n=n, vocab=LLAMA["vocab_size"], seed=3)
    for s in samples[::2]:  # every other sample: only its last 2 labels are targets
        s["labels"] = [-100] * (len(s["labels"]) - 2) + s["labels"][-2:]
    return samples


def _stock_normalization(monkey_module) -> None:
    """torch's default use: per-micro-batch mean, and the schedule divides by the micro-batches (scale_grads=True)."""
    from torch.distributed import pipelining

    from hf_gradfix.parallel import pipeline as P

    def window_loss_fn(model, dp_degree):
        def loss_fn(logits, labels, num_items):
            return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

        return loss_fn

    def make_schedule(name, stages, n, loss_fn):
        cls = getattr(pipelining, P.SCHEDULES[name])
        return cls(stages[0], n, loss_fn=loss_fn) if name in ("gpipe", "1f1b") else cls(list(stages), n, loss_fn=loss_fn)

    monkey_module.window_loss_fn = window_loss_fn
    monkey_module.make_schedule = make_schedule


def _make_recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.collator = None
            self.steps: list[dict] = []
            self._seen = 0
            self.batches_per_epoch: int | None = None  # set for a single data rank: the last window may be short

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # the Trainer and accelerate prefetch ahead of the window, so its size comes from the data, not from
            # what was collated: GA micro-batches, or what is left of the epoch (known from the sample count)
            ga = args.gradient_accumulation_steps
            size = ga
            if self.batches_per_epoch is not None:
                windows_per_epoch = -(-self.batches_per_epoch // ga)
                k = state.global_step % windows_per_epoch
                size = min(ga, self.batches_per_epoch - k * ga)
            batches = self.collator.batches[self._seen : self._seen + size]
            self._seen += size
            grads = {}
            for name, p in self.trainer.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.detach()
                    grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()  # FSDP2: all shards
            self.steps.append(dict(idx_batches=[list(b) for b in batches], grads=grads))

    return Recorder()


def _resume_case(trainer, args, config, collator, samples) -> dict:
    """Train again from checkpoint-2 with a fresh model and trainer; the weights after step 4 must be identical."""
    import safetensors.torch
    import transformers

    import hf_gradfix

    def whole(model):  # FSDP2 / tp shards gathered (a collective over the stage's ranks, same order on each)
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}

    straight = whole(trainer.model)
    hf_gradfix.unpatch()
    hf_gradfix.patch(config)
    again = harness._subclass(transformers.Trainer)(
        model=build_model(), args=args, train_dataset=harness.ListDataset(samples), data_collator=collator)
    again.train(resume_from_checkpoint=str(Path(args.output_dir) / "checkpoint-2"))
    resumed = whole(again.model)
    out = dict(straight=straight, resumed=resumed, steps=[], logged_losses=[], grad_norms=[])
    if torch.distributed.get_rank() == 0:  # the whole model, gathered from both stages by save_model
        out["saved"] = safetensors.torch.load_file(str(Path(args.output_dir) / "checkpoint-4" / "model.safetensors"))
    return out


def run_case(name: str, out: Path, rank: int, world: int) -> None:
    import transformers

    import hf_gradfix
    from hf_gradfix.integration.parallel import pipeline as glue

    config, opts = CASES[name]
    saved = (glue.window_loss_fn, glue.make_schedule)
    if opts.get("stock"):
        _stock_normalization(glue)
    source = None if opts.get("from_env") else config
    # A case with settings of its own runs as a script launched without a section would: the launch file's section
    # (configs/cpu_pp.yaml: pp 2, 1f1b) would otherwise combine with them, and a case's other schedule is a conflict
    for key in ("HF_GRADFIX_CONFIG", "HF_GRADFIX_CONFIG_ORIGIN"):
        if opts.get("from_env") and key in _LAUNCH_ENV:
            os.environ[key] = _LAUNCH_ENV[key]
        elif not opts.get("from_env"):
            os.environ.pop(key, None)
    if opts.get("from_env"):
        assert os.environ.get("HF_GRADFIX_CONFIG"), "launch this worker with hf-gradfix launch"
    if opts.get("yaml"):
        import yaml

        path = out / f"{name}.yaml"
        if rank == 0:
            path.write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "hf_gradfix": config}))
        torch.distributed.barrier()
        source = str(path)
    callbacks = []
    if opts.get("callback"):
        callbacks.append(hf_gradfix.GradFixCallback(source))
    else:
        hf_gradfix.patch(source)
    model = build_model(tied=bool(opts.get("tied")))
    samples = make_samples(opts.get("n_samples", N_SAMPLES))
    collator = harness.RecordingCollator("causal", harness.PAD_ID)
    recorder = _make_recorder()
    recorder.collator = collator
    if "n_samples" in opts:  # one data rank (pp 2 on 2 processes): per_device_train_batch_size 2
        recorder.batches_per_epoch = -(-opts["n_samples"] // 2)
    ga = opts["ga"]
    args_cls, sft_args, trainer_kwargs, trainer_cls = transformers.TrainingArguments, {}, {}, transformers.Trainer
    dataset = harness.ListDataset(samples)
    if opts.get("sft"):
        import datasets
        import trl
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({str(i): i for i in range(LLAMA["vocab_size"])}, unk_token="3"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")
        args_cls, trainer_cls = trl.SFTConfig, trl.SFTTrainer
        sft_args = dict(bf16=False, fp16=False, max_length=None, packing=False, dataset_num_proc=None,
                        **opts.get("sft_args", {}))
        trainer_kwargs = dict(processing_class=tokenizer)
        dataset = datasets.Dataset.from_list(samples)
    args = args_cls(
        **sft_args,
        output_dir=str(out / name / ("trainer" if opts.get("resume") else f"trainer_rank{rank}")),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ga,
        num_train_epochs=opts.get("epochs", 1),
        learning_rate=1e-2 if opts.get("resume") else 0.0,
        max_steps=4 if opts.get("resume") else -1,
        save_steps=2,
        weight_decay=0.0,
        max_grad_norm=opts.get("clip", 0.0),
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if opts.get("resume") else "no",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
        seed=0,
        **{"optim": "adamw_torch" if opts.get("resume") else "sgd", **opts.get("args", {})},
        data_seed=0,
    )
    payload: dict = dict(case=name, rank=rank, world_size=world, config=config, opts=opts)
    try:
        try:
            trainer = harness._subclass(trainer_cls)(
                model=model, args=args, train_dataset=dataset, data_collator=collator,
                callbacks=callbacks + [recorder], **trainer_kwargs,
            )
            recorder.trainer = trainer
            from transformers.trainer_callback import PrinterCallback

            trainer.remove_callback(PrinterCallback)
            trainer.train()
        except Exception as err:  # noqa: BLE001 - the *_refused cases record the error
            if not name.endswith("_refused"):
                raise
            payload["error"] = f"{type(err).__name__}: {err}"
            torch.save(payload, out / name / f"rank{rank}.pt")
            return
        if name.endswith("_refused"):
            raise AssertionError(f"{name}: the Trainer accepted a setup it should refuse")
        if opts.get("resume"):
            payload.update(_resume_case(trainer, args, config, collator, samples))
            torch.save(payload, out / name / f"rank{rank}.pt")
            return
        if opts.get("second_trainer"):
            try:
                harness._subclass(trainer_cls)(model=trainer.model, args=args, train_dataset=dataset,
                                               data_collator=collator)
                payload["second_trainer_error"] = None
            except Exception as err:  # noqa: BLE001 - recorded, checked by the test
                payload["second_trainer_error"] = f"{type(err).__name__}: {err}"
        if opts.get("eval"):  # 11 samples, bs 2: the last batch is short (and padded by accelerate under dp 2)
            trainer.args.per_device_eval_batch_size = 2
            metrics = trainer.evaluate(eval_dataset=harness.ListDataset(samples[: N_SAMPLES - 5]))
            payload.update(eval_loss=metrics["eval_loss"], eval_targets=metrics.get("eval_loss_targets"))
        state = hf_gradfix.state_of(trainer)
        if state.pp.tied_weight is not None:
            payload["tied_weight"] = state.pp.tied_weight.detach().clone()
        payload.update(
            steps=recorder.steps,
            logged_losses=[float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
            grad_norms=[float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
            line=state.pp.line,
            lean=state.pp.lean,
            tokens_seen=trainer.state.num_input_tokens_seen,
            fixes=list(state.fixes),
            params=sorted(n for n, _ in trainer.model.named_parameters()),
            tp_sharded=sorted(n for n, p in trainer.model.named_parameters() if hasattr(p, "to_local")),
        )
        if rank == 0:
            payload["samples"] = samples
        torch.save(payload, out / name / f"rank{rank}.pt")
    finally:
        glue.window_loss_fn, glue.make_schedule = saved
        hf_gradfix.unpatch()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="comma-separated names of CASES")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(a.out)
    multiproc.run_cases(a.cases.split(","), out, rank, lambda name: run_case(name, out, rank, world))


if __name__ == "__main__":
    main()
