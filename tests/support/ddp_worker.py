"""DDP worker for the ground-truth harness (gloo on CPU).

Run (normally through ``harness.run_ddp``)::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29517 \
        tests/support/ddp_worker.py --scenario llama --out DIR [--patch] [--avg-false] [--set KEY=VALUE ...]

Each rank builds the scenario (same seed on every rank), runs ``harness.run_trainer`` and writes ``DIR/rank{r}.pt``
(torch.save of a dict: ``meta``, ``steps`` [idx_batches, grads, local_loss per optimizer step], ``logged_losses``,
and on rank 0 ``samples`` + ``initial_state``).

Scenario registry: ``SCENARIOS`` maps a name to ``fn(args) -> dict``.  The dict holds ``model`` (nn.Module),
``samples`` (list of sample dicts with ``idx``), ``task``, and any other keyword of ``harness.run_trainer``
(``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``extra_args``, ``trainer_cls``, ``callbacks``,
``compute_loss_func``, ...).  ``args`` is the parsed namespace: ``args.patch``, ``args.avg_false`` and
``args.set`` (dict of ``--set KEY=VALUE`` overrides, values parsed as JSON when possible).  Add a scenario with::

    @scenario("my_case")
    def _my_case(args):
        return default_scenario("llama", args, gradient_accumulation_steps=4)

``fn`` must be deterministic: the parent rebuilds the model with it (``build_scenario``) for the GT and loads rank 0's
initial weights.  Every arch of ``harness.TASKS`` is registered under its own name with :func:`default_scenario`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import harness  # noqa: E402

PLUGIN_MISSING_RC = 77
SCENARIOS: dict[str, Callable[[argparse.Namespace], dict]] = {}


def scenario(name: str):
    """Decorator registering ``fn(args) -> dict`` under ``name``."""

    def deco(fn):
        SCENARIOS[name] = fn
        return fn

    return deco


def default_scenario(arch: str, args, *, n: int = 12, seed: int = 0, world_size: int | None = None,
                     arrange: bool = True, model_kwargs: dict | None = None, sample_kwargs: dict | None = None,
                     **run_kwargs) -> dict:
    """The standard DDP case: ``n`` samples of 3-41 tokens, bs 1, GA 2, the shortest samples on rank 0 and the longest
    on rank 1 (``harness.arrange_for_ranks``), model ``build_model(arch, seed)``.

    ``args.set`` overrides (``--set``): ``n``, ``seed``, ``arrange``, ``prompt_mask_frac`` and any ``run_trainer``
    keyword (``gradient_accumulation_steps``, ``per_device_train_batch_size``, ``num_train_epochs``); keys starting with
    ``args.`` go to ``extra_args`` (TrainingArguments), e.g. ``--set args.average_tokens_across_devices=false``.
    """
    opts = dict(getattr(args, "set", None) or {})
    n = int(opts.pop("n", n))
    seed = int(opts.pop("seed", seed))
    arrange = bool(opts.pop("arrange", arrange))
    sample_kwargs = dict(sample_kwargs or {})
    if "prompt_mask_frac" in opts:
        sample_kwargs["prompt_mask_frac"] = float(opts.pop("prompt_mask_frac"))
    world_size = world_size or int(os.environ.get("WORLD_SIZE", 2))
    task = harness.task_of(arch)
    model = harness.build_model(arch, seed, **(model_kwargs or {}))
    samples = harness.make_samples(task, n=n, seed=seed, **sample_kwargs)
    kw = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    kw.update(run_kwargs)
    extra = dict(kw.pop("extra_args", None) or {})
    for k in list(opts):
        if k.startswith("args."):
            extra[k[len("args."):]] = opts.pop(k)
    kw.update(opts)
    if arrange:
        samples = harness.arrange_for_ranks(samples, world_size, kw["per_device_train_batch_size"])
    if getattr(args, "avg_false", False):
        extra["average_tokens_across_devices"] = False
    kw["extra_args"] = extra
    return dict(model=model, samples=samples, task=task, arch=arch, **kw)


def _register_defaults():
    for arch in harness.TASKS:
        SCENARIOS[arch] = (lambda a: (lambda args: default_scenario(a, args)))(arch)


_register_defaults()


@scenario("mixtral_aux")
def _mixtral_aux(args):
    """Mixtral built with output_router_logits=True, router_aux_loss_coef=0.5 (compare with use_aux=True)."""
    return default_scenario("mixtral", args, model_kwargs=dict(moe_aux=True))


@scenario("qwen3_moe")
def _qwen3_moe(args):
    """Qwen3-MoE with its load-balancing loss (``harness.build_moe``), bs 2 (padding), GA 2, 16 samples, the long ones
    on rank 1: unequal tokens per rank and per expert."""
    opts = dict(getattr(args, "set", None) or {})
    family = opts.pop("family", "qwen3_moe")
    args.set = opts
    model = harness.build_moe(family)
    kw = default_scenario("llama", args, n=16, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    kw.update(model=model, arch=family)
    return kw


@scenario("llama_14")
def _llama_14(args):
    """14 samples, GA 4: the last window has 3 micro-batches per rank (partial window)."""
    return default_scenario("llama", args, n=14, gradient_accumulation_steps=4)


@scenario("llama_11")
def _llama_11(args):
    """11 samples: accelerate's even_batches repeats a sample on the last rank (duplicates count twice in the GT)."""
    return default_scenario("llama", args, n=11)


@scenario("llama_bs2")
def _llama_bs2(args):
    """bs 2 per device (padding inside micro-batches), GA 2, 16 samples."""
    return default_scenario("llama", args, n=16, per_device_train_batch_size=2, gradient_accumulation_steps=2)


class TutorialTrainer:  # mixed into transformers.Trainer lazily (see _tutorial): the docs' compute_loss pattern
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


@scenario("llama_tutorial")
def _tutorial(args):
    """A Trainer subclass whose compute_loss returns outputs.loss (a per-micro-batch mean)."""
    import transformers

    cls = type("TutorialTrainer", (TutorialTrainer, transformers.Trainer), {})
    return default_scenario("llama", args, trainer_cls=cls)


@scenario("llama_empty_rank")
def _empty_rank(args):
    """Rank 0's first window (samples 0 and 2: bs 1, GA 2, no arranging) has no target at all."""
    kw = default_scenario("llama", args, arrange=False)
    for s in kw["samples"]:
        if s["idx"] in (0, 2):
            s["labels"] = [harness.IGNORE_INDEX] * len(s["labels"])
    return kw


def build_scenario(name: str, args) -> dict:
    """Build scenario ``name``; ``args`` may be a Namespace or the dict saved in ``meta["args"]``."""
    if isinstance(args, dict):
        args = argparse.Namespace(**args)
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    return SCENARIOS[name](args)


def _parse_set(items) -> dict:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"--set expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--patch", action="store_true", help="call hf_gradfix.patch() before building the Trainer")
    p.add_argument("--avg-false", dest="avg_false", action="store_true",
                   help="TrainingArguments(average_tokens_across_devices=False)")
    p.add_argument("--eval-bs", dest="eval_bs", type=int, default=0,
                   help="after training, evaluate on the scenario's samples with this per-device eval batch size")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario overrides (JSON values)")
    p.add_argument("--patch-config", dest="patch_config", default=None,
                   help="a JSON dict for hf_gradfix.patch(...) (with --patch)")
    args = p.parse_args(argv)
    args.set = _parse_set(args.set)
    return args


def _apply_patch(out: Path, rank: int, config: str | None = None) -> None:
    try:
        import hf_gradfix
    except ModuleNotFoundError as e:
        if e.name != "hf_gradfix":
            raise
        hf_gradfix = None
    patch = getattr(hf_gradfix, "patch", None)
    if patch is None:
        msg = "hf_gradfix.patch() is not available yet (plugin missing): --patch scenario skipped"
        print(f"[rank {rank}] {msg}", file=sys.stderr)
        (out / "PLUGIN_MISSING").write_text(msg)
        sys.exit(PLUGIN_MISSING_RC)
    patch(json.loads(config)) if config else patch()


def main(argv=None) -> None:
    """One job (``--scenario ...``), or with ``--jobs FILE.json`` (a list of argument lists) every job in turn in this
    one launch: the processes and the process group are set up once (each launch costs ~10 s of imports and
    rendezvous on 2 cores). Each job's ``hf_gradfix`` log goes to ``OUT/rank{r}.log`` of that job."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--jobs"]:
        jobs = json.loads(Path(argv[1]).read_text())
    else:
        jobs = [argv]
    for job in jobs:
        _run_job(job)
    from multiproc import finish_distributed

    finish_distributed()


def _run_job(argv) -> None:
    import logging

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = logging.FileHandler(out / f"rank{int(os.environ.get('RANK', 0))}.log")
    logging.getLogger("hf_gradfix").addHandler(log)
    try:
        _job(args, out)
    finally:
        logging.getLogger("hf_gradfix").removeHandler(log)
        log.close()
        if args.patch:
            import hf_gradfix

            hf_gradfix.unpatch()


def _job(args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    if args.patch:
        _apply_patch(out, rank, args.patch_config)
    kw = build_scenario(args.scenario, args)
    model, samples, task = kw.pop("model"), kw.pop("samples"), kw.pop("task")
    arch = kw.pop("arch", getattr(model, "_hgf_arch", None))
    record = harness.run_trainer(model, samples, task, output_dir=str(out / f"trainer_rank{rank}"), **kw)
    import transformers

    tr = record.trainer
    meta = dict(
        scenario=args.scenario,
        task=task,
        arch=arch,
        rank=rank,
        world_size=world_size,
        args=vars(args),
        transformers=transformers.__version__,
        model_accepts_loss_kwargs=getattr(tr, "model_accepts_loss_kwargs", None),
        average_tokens_across_devices=getattr(tr.args, "average_tokens_across_devices", None),
        gradient_accumulation_steps=tr.args.gradient_accumulation_steps,
        per_device_train_batch_size=tr.args.per_device_train_batch_size,
        logged_loss_decimals=record.logged_loss_decimals,
        all_collated_batches=record.collator.batches,
    )
    payload = dict(meta=meta, steps=record.steps, logged_losses=record.logged_losses)
    if getattr(args, "eval_bs", 0):
        tr.args.per_device_eval_batch_size = args.eval_bs
        payload["eval_loss"] = tr.evaluate(eval_dataset=harness.ListDataset(samples))["eval_loss"]
    if rank == 0:
        payload["samples"] = samples
        payload["initial_state"] = record.initial_state
    torch.save(payload, out / f"rank{rank}.pt")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
