"""``hf-gradfix verify``: prove that a causal-LM run is exact, on the user's own model, data and configuration.

The configured way: a ``transformers.Trainer`` with the plugin's configuration (gradient accumulation, packing,
every rank when launched with ``hf-gradfix launch`` / ``accelerate launch``) runs a few optimizer steps; at each
step, just before the optimizer, the accumulated (and all-reduced) gradient and every micro-batch the Trainer
consumed are recorded.  The ground-truth way: at the same parameters, one process computes the gradient of the
token mean over the whole global window in plain PyTorch (every sequence on its own, no padding, no packing).

When they differ, named alternative references at the same parameters say which invariant broke:

===================  =============================================================================
``mean_of_means``    per-micro-batch token means averaged (the token count is not global)
``..._summed``       the same means summed over the window (also not divided by GA)
``ga_scaled``        the exact gradient times the accumulation steps (loss not divided by GA)
``world_scaled``     the exact gradient times the number of data-parallel ranks
``count_unshifted``  normalized by a count that includes each row's first label (off by one per row)
``cross_attention``  packed sequences attending to each other (a row run as one sequence)
===================  =============================================================================

Dropout is switched off and gradient clipping disabled for the check (both change gradients by design).

>>> from hf_gradfix.verify import HYPOTHESES
>>> sorted(HYPOTHESES)
['count_unshifted', 'cross_attention', 'exact', 'ga_scaled', 'mean_of_means', 'mean_of_means_summed', 'world_scaled']
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .errors import InvalidArgumentError

__all__ = ["verify", "VerifyReport", "HYPOTHESES", "tiny_model", "synthetic_samples", "BUGS"]

IGNORE = -100
HYPOTHESES = {
    "exact": "exact: the global token mean over every micro-batch and rank",
    "mean_of_means": "token count: per-micro-batch token means averaged instead of one global token mean",
    "mean_of_means_summed": "token count and scaling by GA: per-micro-batch token means summed over the window "
    "(a compute_loss override returning outputs.loss, transformers 5.x)",
    "ga_scaled": "scaling by GA: the loss is not divided by the gradient-accumulation steps",
    "world_scaled": "scaling by world size: the gradient is the data-parallel ranks' sum, not their mean",
    "count_unshifted": "shift: the target count includes each row's first label (off by one per row)",
    "cross_attention": "cross-sequence attention: packed sequences attend to each other",
}
#: Bugs ``verify(inject=...)`` can plant in the configured run, to show they are caught.
BUGS = ("mean_of_means", "ga_scaled", "world_scaled", "count_unshifted", "cross_attention")


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


# ------------------------------------------------------------------------------------------ batches -> sequences


def sequences_of(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The real sequences of a micro-batch: packed rows split at ``position_ids`` restarts, padding dropped."""
    ids, labels = batch["input_ids"].cpu(), batch["labels"].cpu()
    pos = batch.get("position_ids")
    mask = batch.get("attention_mask")
    out = []
    for r in range(ids.shape[0]):
        if pos is not None:
            p = pos[r].cpu()
            starts = torch.nonzero(p == 0).flatten().tolist() + [p.numel()]
            for a, b in zip(starts[:-1], starts[1:]):
                out.append((ids[r, a:b], labels[r, a:b]))
        elif mask is not None:
            keep = mask[r].cpu().bool()
            out.append((ids[r][keep], labels[r][keep]))
        else:
            out.append((ids[r], labels[r]))
    return out


def _shifted_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, position_ids=None) -> tuple[torch.Tensor, int]:
    device = next(model.parameters()).device
    kwargs = {"position_ids": position_ids.to(device).unsqueeze(0)} if position_ids is not None else {}
    logits = model(input_ids=ids.to(device).unsqueeze(0), use_cache=False, **kwargs).logits[0].float()
    target = labels.to(device)[1:]
    loss = nn.functional.cross_entropy(logits[:-1], target, ignore_index=IGNORE, reduction="sum")
    return loss, int((target != IGNORE).sum())


def _unshifted_count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


# ------------------------------------------------------------------------------------------ the references


def _grad_of(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if loss.requires_grad:
        loss.backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters() if p.requires_grad}


def _combine(parts: list[tuple[float, dict]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for w, g in parts:
        for k, v in g.items():
            out[k] = out.get(k, 0) + w * v
    return out


def references(model: nn.Module, window: list[list[dict]], *, grad_accum: int, world: int, packed: bool) -> tuple[dict, float]:
    """Every hypothesis's gradient at ``model``'s parameters for one window, and the exact token-mean loss.

    ``window[rank][k]`` is micro-batch ``k`` of ``rank`` as recorded (CPU tensors).
    """
    ref = copy.deepcopy(model).float()
    ref.train()
    per_mb, n_total, n_unshifted, loss_total = [], 0, 0, 0.0
    for rank_batches in window:
        for batch in rank_batches:
            seqs = sequences_of(batch)
            s = None
            n = 0
            for ids, labels in seqs:
                if ids.numel() < 2:
                    n_unshifted += _unshifted_count(labels)
                    continue
                part, c = _shifted_sum(ref, ids, labels)
                s = part if s is None else s + part
                n += c
                n_unshifted += _unshifted_count(labels)
            g = _grad_of(ref, s) if s is not None else _grad_of(ref, torch.zeros(()))
            per_mb.append((g, n, float(s.detach()) if s is not None else 0.0, batch))
            n_total += n
            loss_total += float(s.detach()) if s is not None else 0.0
    n_total = max(n_total, 1)
    exact = _combine([(1.0 / n_total, g) for g, _, _, _ in per_mb])
    hyps = {
        "exact": exact,
        "mean_of_means": _combine([(1.0 / (len(per_mb) * max(n, 1)), g) for g, n, _, _ in per_mb if n > 0]),
        "ga_scaled": {k: v * grad_accum for k, v in exact.items()},
        "mean_of_means_summed": _combine([(grad_accum / (len(per_mb) * max(n, 1)), g) for g, n, _, _ in per_mb if n > 0]),
        "world_scaled": {k: v * world for k, v in exact.items()},
        "count_unshifted": {k: v * n_total / max(n_unshifted, 1) for k, v in exact.items()},
    }
    if packed:  # each packed row as ONE causal sequence: what a model that ignores the boundaries computes
        parts = []
        for _, _, _, batch in per_mb:
            ids, labels = batch["input_ids"].cpu(), batch["labels"].cpu()
            s = None
            for r in range(ids.shape[0]):
                part, _ = _shifted_sum(ref, ids[r], labels[r], position_ids=torch.arange(ids.shape[1]))
                s = part if s is None else s + part
            parts.append((1.0 / n_total, _grad_of(ref, s)))
        hyps["cross_attention"] = _combine(parts)
    return hyps, loss_total / n_total


def _rel(g: dict, ref: dict, keys: Sequence[str] | None = None) -> float:
    keys = list(keys if keys is not None else ref.keys())
    num = sum(float((g[k].float().cpu() - ref[k].float().cpu()).pow(2).sum()) for k in keys)
    den = sum(float(ref[k].float().cpu().pow(2).sum()) for k in keys)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def _group_of(name: str) -> str:
    low = name.lower()
    for key, group in (("embed", "embeddings"), ("wte", "embeddings"), ("lm_head", "head"), ("norm", "norms"),
                       ("attn", "attention"), ("attention", "attention"), ("mlp", "mlp"), ("feed_forward", "mlp")):
        if key in low:
            return group
    return "other"


# ------------------------------------------------------------------------------------------ the configured run


@dataclass
class StepResult:
    step: int
    loss_exact: float
    loss_logged: float | None
    loss_rel_err: float | None
    grad_rel_err: float
    groups: dict[str, float]
    verdict: str
    candidates: dict[str, float]


@dataclass
class VerifyReport:
    exact: bool
    tolerance: float
    world_size: int
    grad_accum: int
    packing: bool
    steps: list[StepResult] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def lines(self) -> list[str]:
        out = [
            f"hf-gradfix verify: {len(self.steps)} step(s), GA {self.grad_accum}, {self.world_size} rank(s), "
            f"packing {'on' if self.packing else 'off'}, tolerance {self.tolerance:g}",
        ]
        for s in self.steps:
            loss = f", loss rel err {s.loss_rel_err:.1e}" if s.loss_rel_err is not None else ""
            out.append(f"  step {s.step}: gradient rel err {s.grad_rel_err:.1e}{loss} -> {HYPOTHESES[s.verdict] if s.verdict in HYPOTHESES else s.verdict}")
            out.append("    per group: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(s.groups.items())))
        out.append("EXACT" if self.exact else "NOT EXACT: " + "; ".join(HYPOTHESES.get(b, b) for b in self.broken))
        return out


def _inject_trainer(base: type, bug: str | None, grad_accum: int) -> type:
    """A Trainer subclass that plants ``bug`` in the configured run (for proving the detector works)."""
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


def _world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _gather(obj: Any) -> list:
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    torch.distributed.all_gather_object(out, obj)
    return out


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
) -> VerifyReport:
    """Run ``steps`` optimizer steps the configured way and compare each gradient with the ground truth.

    ``model``: a causal LM (or a zero-argument builder; default :func:`tiny_model`); ``samples``: dicts with
    ``input_ids`` and ``labels`` (default :func:`synthetic_samples`); ``config``: the hf_gradfix configuration
    (path, dict, or None for ``$HF_GRADFIX_CONFIG`` / defaults).  Under ``torchrun`` / ``hf-gradfix launch``
    every rank runs it (the report is the same on every rank).
    """
    import transformers

    import hf_gradfix
    from hf_gradfix.config import load_config

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
    if inject == "count_unshifted":  # a causal LM counted with the token-classification rule
        cfg.loss.count_rule = "unshifted"
    model = model() if callable(model) and not isinstance(model, nn.Module) else (model or tiny_model())
    for m in model.modules():  # dropout makes the two ways differ by design
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(getattr(model, "config", None), key):
            setattr(model.config, key, 0.0)
    vocab = int(getattr(model.config, "vocab_size", 128))
    launched = max(1, int(os.environ.get("WORLD_SIZE", "1")))  # the process group starts with the Trainer
    if inject == "world_scaled" and launched == 1:
        raise InvalidArgumentError("--inject world_scaled needs several ranks (run it under hf-gradfix launch)")
    samples = list(samples) if samples is not None else synthetic_samples(batch_size * grad_accum * launched * steps * 2, vocab)
    if inject == "cross_attention":
        # a model that ignores the boundaries: position_ids restarts are dropped before the forward
        model = _BoundaryBlind(model)
    recorded: list[list[dict]] = []
    grads: list[dict] = []
    losses: list[float | None] = []

    class Recorder(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            m = model.module if hasattr(model, "module") else model
            grads.append({n: p.grad.detach().clone().cpu() for n, p in m.named_parameters() if p.grad is not None})
            marks.append(len(recorded))  # the micro-batches of this window end here (packing may give fewer than GA)
            params.append({n: p.detach().clone().cpu() for n, p in m.named_parameters()})

    params: list[dict] = []
    marks: list[int] = []
    out = output_dir or tempfile.mkdtemp(prefix="hf_gradfix_verify_")
    args = transformers.TrainingArguments(
        output_dir=out, report_to="none", per_device_train_batch_size=batch_size, gradient_accumulation_steps=grad_accum,
        max_steps=steps, learning_rate=learning_rate, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), seed=0,
    )
    base = _inject_trainer(transformers.Trainer, inject, grad_accum)

    class RecordingTrainer(base):  # type: ignore[misc, valid-type]
        def training_step(self, model, inputs, *a, **kw):
            recorded.append({k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in inputs.items()})
            return super().training_step(model, inputs, *a, **kw)

    collator = _PadCollator(int(getattr(model.config, "pad_token_id", None) or 0))
    trainer = RecordingTrainer(model=model, args=args, train_dataset=_ListDataset(samples), data_collator=collator,
                               callbacks=[Recorder(), hf_gradfix.GradFixCallback(cfg)])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # keep stdout for the report
    trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            losses.append(float(entry["loss"]))
    world = _world()
    report = VerifyReport(exact=True, tolerance=tolerance, world_size=world, grad_accum=grad_accum, packing=cfg.packing.enabled)
    base_model = model.inner if isinstance(model, _BoundaryBlind) else model
    for step in range(len(grads)):
        window = _gather(recorded[(marks[step - 1] if step else 0):marks[step]])
        ref_model = copy.deepcopy(base_model).cpu()
        ref_model.load_state_dict({k.removeprefix("inner."): v for k, v in params[step].items()}, strict=False)
        hyps, loss_exact = references(ref_model, window, grad_accum=grad_accum, world=world, packed=cfg.packing.enabled or inject == "cross_attention")
        g = {k.removeprefix("inner."): v for k, v in grads[step].items()}
        keys = [k for k in hyps["exact"] if k in g]
        candidates = {name: _rel(g, h, keys) for name, h in hyps.items()}
        err = candidates["exact"]
        verdict = "exact" if err <= tolerance else min(candidates, key=candidates.get)
        if verdict != "exact" and candidates[verdict] > 1e-3:
            verdict = "unexplained"
        groups: dict[str, list[str]] = {}
        for k in keys:
            groups.setdefault(_group_of(k), []).append(k)
        logged = losses[step] if step < len(losses) else None
        loss_err = abs(logged - loss_exact) / max(abs(loss_exact), 1e-30) if logged is not None else None
        report.steps.append(StepResult(
            step=step + 1, loss_exact=loss_exact, loss_logged=logged, loss_rel_err=loss_err, grad_rel_err=err,
            groups={name: _rel(g, hyps["exact"], ks) for name, ks in groups.items()}, verdict=verdict, candidates=candidates,
        ))
        if verdict != "exact":
            report.exact = False
            if verdict not in report.broken:
                report.broken.append(verdict)
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
    for label, bug in (("stock Trainer, compute_loss override", "mean_of_means"), ("hf_gradfix", None)):
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

    return AutoModelForCausalLM.from_pretrained(spec, torch_dtype=torch.float32)


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

        tok = AutoTokenizer.from_pretrained(model_spec)
        encode = lambda t: tok(t)["input_ids"]  # noqa: E731
    out = []
    for p in paragraphs:
        ids = encode(p)[:max_len]
        if len(ids) >= 2:
            out.append({"input_ids": ids, "labels": list(ids)})
    return out
