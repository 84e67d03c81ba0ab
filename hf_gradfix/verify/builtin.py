"""The built-in run of ``hf-gradfix verify`` (no script): :func:`verify` builds a plain ``Trainer`` with the
hf_gradfix configuration on a causal LM (:func:`tiny_model` and :func:`synthetic_samples` by default, or
:func:`load_model` / :func:`load_samples`), optionally with a planted bug (:data:`~hf_gradfix.verify.report.BUGS`),
and checks it with :func:`~hf_gradfix.verify.trainer.verify_trainer`; :func:`plot_loss_curves` draws the logged
loss of a stock and a fixed run.

Apart from :mod:`hf_gradfix.verify.trainer`, which takes the user's own trainer: this module makes one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..loss.counting import IGNORE_INDEX as IGNORE
from ..loss.counting import CountRule
from ..errors import InvalidArgumentError
from .report import BUGS, VerifyReport, _progress, _progress_session
from .reference import _world
from .trainer import verify_trainer


def tiny_model(seed: int = 0) -> nn.Module:
    """The embedded default: a random-init Llama (vocab 128, hidden 64, 2 layers), fp32, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).float()


def synthetic_samples(n: int, vocab: int, lo: int = 4, hi: int = 48, seed: int = 0) -> list[dict]:
    """``n`` causal-LM samples of very different lengths (ids in [3, vocab)), labels = input_ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _inject_trainer(base: type, bug: str | None, grad_accum: int) -> type:
    """A Trainer subclass that plants ``bug`` in the built-in run (for proving the detector works)."""
    if bug is None:
        return base

    class Injected(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kw):
            if bug == "mean_of_means":  # the classic override: returns the model's per-micro-batch mean
                outputs = model(**inputs)
                return (outputs.loss, outputs) if return_outputs else outputs.loss
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch, **kw)
            loss, outs = (result if return_outputs else (result, None))
            if bug == "ga_scaled":
                loss = loss * grad_accum
            elif bug == "world_scaled":
                loss = loss * _world()
            return (loss, outs) if return_outputs else loss

    Injected.__name__ = f"{base.__name__}_{bug}"
    return Injected


@_progress_session
def verify(
    model: nn.Module | Callable[[], nn.Module] | None = None,
    samples: Sequence[dict] | None = None,
    *,
    config: Any = None,
    grad_accum: int = 4,
    batch_size: int = 2,
    steps: int = 2,
    packing: bool | None = None,
    inject: str | None = None,
    tolerance: float = 1e-5,
    output_dir: str | None = None,
    learning_rate: float = 1e-3,
    bf16: bool = False,
) -> VerifyReport:
    """The built-in run: a plain ``Trainer`` with the hf_gradfix configuration on a causal LM, checked by
    :func:`verify_trainer`.

    ``model``: a causal LM (or a zero-argument builder; default :func:`tiny_model`); ``samples``: dicts with
    ``input_ids`` and ``labels`` (default :func:`synthetic_samples`); ``config``: the hf_gradfix configuration
    (path, dict, or None for ``$HF_GRADFIX_CONFIG`` / defaults); ``bf16``: the Trainer's bf16 autocast (checked
    against the ground truth computed under the same autocast, and fp32 beside it).  Under ``torchrun`` / ``hf-gradfix launch``
    every rank runs it (the report is the same on every rank).
    """
    import transformers

    from hf_gradfix.config import load_config
    from hf_gradfix.integration.callback import GradFixCallback

    cfg = load_config(config)
    if packing is not None:
        cfg.packing.enabled = bool(packing)
    if inject is not None and inject not in BUGS:
        raise InvalidArgumentError(f"--inject {inject!r}: unknown bug; known bugs: {', '.join(BUGS)}")
    if inject == "cross_attention":
        cfg.packing.enabled = True
        cfg.packing.guard = False
        cfg.packing.attention = "keep"
    if inject == "mean_of_means":
        cfg.loss.enabled = False
    model = model() if callable(model) and not isinstance(model, nn.Module) else (model or tiny_model())
    vocab = int(getattr(model.config, "vocab_size", 128))
    launched = max(1, int(os.environ.get("WORLD_SIZE", "1")))  # the process group starts with the Trainer
    if inject == "world_scaled" and launched == 1:
        raise InvalidArgumentError("--inject world_scaled needs several ranks (run it under hf-gradfix launch)")
    samples = list(samples) if samples is not None else synthetic_samples(batch_size * grad_accum * launched * steps * 2, vocab)
    if inject == "cross_attention":
        # a model that ignores the boundaries: position_ids restarts are dropped before the forward
        model = _BoundaryBlind(model)
    out = output_dir or tempfile.mkdtemp(prefix="hf_gradfix_verify_")
    try:
        args = transformers.TrainingArguments(
            output_dir=out, report_to="none", per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=grad_accum, max_steps=steps, learning_rate=learning_rate,
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
            remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), seed=0, bf16=bf16,
        )
        base = _inject_trainer(transformers.Trainer, inject, grad_accum)
        collator = _PadCollator(int(getattr(model.config, "pad_token_id", None) or 0))
        from hf_gradfix.integration.parallel.nd import requested

        # an ND mesh (tp / FSDP2 / cp) shards the model in place when the trainer is built: keep an unsharded copy
        unsharded = copy.deepcopy(model) if requested(cfg.parallel) else None
        _progress(f"building the Trainer ({launched} rank(s), GA {grad_accum}, packing {'on' if cfg.packing.enabled else 'off'}) ...",
                  phase=True)
        trainer = base(model=model, args=args, train_dataset=_ListDataset(samples), data_collator=collator,
                       callbacks=[GradFixCallback(cfg)])
        if inject == "count_unshifted":  # a causal LM counted with the token-classification rule, planted in this
            # trainer's state (loss.count_rule: unshifted is refused: the probe contradicts it)
            from hf_gradfix.integration.state import state_of

            state_of(trainer).planted_count_rule = CountRule.UNSHIFTED
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # keep stdout for the report
        trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
        report = verify_trainer(trainer, steps=steps, tolerance=tolerance, reference_model=unsharded)
    finally:
        if output_dir is None:
            shutil.rmtree(out, ignore_errors=True)
    report.grad_accum = grad_accum
    report.packing = report.packing or cfg.packing.enabled
    return report


class _BoundaryBlind(nn.Module):
    """Wraps a model so that it ignores packed boundaries (drops position_ids / cu_seq_lens): the injected bug."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids=None, labels=None, **kw):
        for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kw.pop(key, None)
        return self.inner(input_ids=input_ids, labels=labels, **kw)


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = list(samples)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return dict(self.samples[i])


class _PadCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (-100) and builds the attention mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, feats):
        width = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(feats), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(feats), width), dtype=torch.long)
        for i, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = torch.as_tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def plot_loss_curves(path: str, model: Any = None, samples: Sequence[dict] | None = None, *, steps: int = 20,
                     grad_accum: int = 4, batch_size: int = 2, config: Any = None) -> str:
    """Train the same model twice on the same windows, stock (a ``compute_loss`` override returning
    ``outputs.loss``, as in transformers' docs) and with hf_gradfix, and plot each run's logged loss next to the
    exact token-mean loss at its own parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builder = model if (model is None or callable(model) and not isinstance(model, nn.Module)) else (lambda m=model: copy.deepcopy(m))
    curves = {}
    for k, (label, bug) in enumerate((("stock Trainer, compute_loss override", "mean_of_means"), ("hf_gradfix", None))):
        _progress(f"loss curves {k + 1}/2: {label}, {steps} step(s) ...")
        rep = verify(builder, samples, config=config, steps=steps, grad_accum=grad_accum, batch_size=batch_size, inject=bug,
                     learning_rate=3e-3)
        curves[label] = ([s.step for s in rep.steps], [s.loss_logged for s in rep.steps], [s.loss_exact for s in rep.steps])
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (x, logged, exact) in curves.items():
        line = ax.plot(x, logged, marker="o", label=f"{label}: logged loss")[0]
        ax.plot(x, exact, linestyle="--", color=line.get_color(), label=f"{label}: exact token-mean loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"Logged vs exact loss, GA {grad_accum}: stock Trainer and hf_gradfix")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_model(spec: str) -> nn.Module:
    """``tiny`` (the embedded default), a local directory or a hub id (a causal LM, loaded in fp32)."""
    if spec == "tiny":
        return tiny_model()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32, trust_remote_code=False)


def load_samples(path: str | None, model: nn.Module, model_spec: str, n: int, max_len: int = 256) -> list[dict]:
    """Samples from a ``.jsonl`` of ``input_ids`` (and optional ``labels``), or a text file (one sample per
    paragraph; the model's tokenizer, or bytes for the tiny default), or synthetic ones."""
    vocab = int(getattr(model.config, "vocab_size", 128))
    if path is None:
        return synthetic_samples(n, vocab)
    if path.endswith(".jsonl"):
        out = []
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    d = json.loads(line)
                    ids = list(d["input_ids"])[:max_len]
                    out.append({"input_ids": ids, "labels": list(d.get("labels", ids))[:max_len]})
        return out
    text = open(path, encoding="utf-8").read()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if model_spec == "tiny":
        encode = lambda t: [3 + b % (vocab - 3) for b in t.encode("utf-8")]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_spec, trust_remote_code=False)
        encode = lambda t: tok(t)["input_ids"]  # noqa: E731
    out = []
    for p in paragraphs:
        ids = encode(p)[:max_len]
        if len(ids) >= 2:
            out.append({"input_ids": ids, "labels": list(ids)})
    return out
