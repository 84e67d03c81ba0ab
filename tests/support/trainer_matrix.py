"""The trainer matrix (``tests/trainer/test_trainer_matrix.py``): every trainer class the installed TRL ships, found by walking
the package, and transformers' ``Trainer`` / ``Seq2SeqTrainer`` with the subclasses real projects write, each trained
stock and under ``hf_gradfix.patch()`` on tiny models built offline.

* :func:`discover_trl_trainers` imports every module of the installed ``trl`` (not ``trl.cli`` / ``trl.scripts``) and
  keeps every public class that subclasses ``transformers.Trainer``; modules that do not import are returned with the
  error, so the test can say what it could not look into.
* :func:`plan_for` picks a recipe from what the class needs: its ``__init__`` parameters (``reward_funcs``,
  ``teacher_model``, ``rollout_worker``, ...), its config class's fields (``use_vllm``, server URLs,
  ``desirable_weight``, ...), the model class its module imports (a sequence classifier) and the sample columns its
  module names (``"messages"``, ``"reference"``, ``"privileged_context"``). A class no recipe fits, or one that
  needs a server, comes back as a :class:`Skip` with the reason.
* :func:`run` trains one case (2 optimizer steps of GA 2, SGD at lr 0, no clipping, CPU, fp32) and records, per
  optimizer step, the inputs of every training ``compute_loss`` call (the micro-batches as trained on, after the
  trainer's own ``_prepare_inputs`` and any generation), the accumulated gradient (``on_pre_optimizer_step``), the
  ``hf_gradfix`` warnings, and the exception if construction or ``train()`` raised.
* The ground truths a run hf_gradfix reports exact is held to: :func:`token_truth` (``tests/support/ecosystem.py``'s per-target
  cross entropy from the logits, plus the MoE router aux term averaged over the window's micro-batches, the convention
  hf_gradfix documents) and, for losses this file does not write out (distillation), :func:`trainer_loss_truth`: the
  trainer's own loss on the whole window as one batch (GA k x b = 1 x kb).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import gc
import importlib
import inspect
import logging
import pkgutil
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import ecosystem as E
import harness as H

GRAD_TOL = 1e-5  # exact: relative gradient error against the ground truth, per optimizer step
STOCK_TOL = 1e-6  # equal to stock: relative difference from the stock run's gradient, per optimizer step
N_SAMPLES = 8  # batch 2 x GA 2 -> 2 optimizer steps
COMPLETION_LEN = 4  # generated tokens per completion (RL, on-policy distillation)

#: modules of the trl package not walked: command-line entry points, no trainer classes
NOT_WALKED = ("trl.cli", "trl.scripts")


# ----------------------------------------------------------------------------------------------------------------------
# Discovery
# ----------------------------------------------------------------------------------------------------------------------


def public_name(cls: type) -> str:
    """Where users import ``cls`` from: ``trl.DPOTrainer``, ``trl.experimental.cpo.CPOTrainer``, ..."""
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if getattr(trl, cls.__name__, None) is cls:
            return f"trl.{cls.__name__}"
    parts = cls.__module__.split(".")
    if parts[-1].endswith("_trainer") and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts + [cls.__qualname__])


@functools.lru_cache(maxsize=None)
def discover_trl_trainers() -> tuple[dict[str, type], dict[str, str]]:
    """({public name: class} of every public ``transformers.Trainer`` subclass the installed trl defines,
    {module: import error} of the modules that could not be imported)."""
    import transformers
    import trl

    found: dict[str, type] = {}
    errors: dict[str, str] = {}

    def onerror(name):
        errors[name] = f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(trl.__path__, "trl.", onerror=onerror):
            if info.name.startswith(NOT_WALKED):
                continue
            try:
                module = importlib.import_module(info.name)
            except BaseException as err:  # noqa: BLE001 (an optional dependency missing, a SystemExit, ...)
                errors[info.name] = f"{type(err).__name__}: {err}"
                continue
            for value in vars(module).values():
                if (
                    inspect.isclass(value)
                    and issubclass(value, transformers.Trainer)
                    and value.__module__.startswith("trl")
                    and not value.__name__.startswith("_")
                ):
                    name = public_name(value)
                    if found.get(name, value) is not value:  # two classes, one short name: keep both, by module
                        name = f"{value.__module__}.{value.__qualname__}"
                    found.setdefault(name, value)
    return dict(sorted(found.items())), errors


def init_params(cls: type) -> dict[str, inspect.Parameter]:
    """The parameters of the first ``__init__`` in the MRO that names them (a deprecation shim's ``*args, **kwargs``
    passes through to its base)."""
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__:
            continue
        params = dict(inspect.signature(klass.__dict__["__init__"]).parameters)
        params.pop("self", None)
        named = {k: p for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if len(named) > 1:  # GMPO's (model, reward_funcs, args=None, **kwargs) passes the rest on
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                for base in klass.__mro__[1:]:
                    if "__init__" in base.__dict__:
                        rest = init_params(base)
                        return {**rest, **named}
            return named
    return {}


def config_class(cls: type) -> type | None:
    """The config (``TrainingArguments`` subclass) the trainer takes as ``args``: its ``config_cls`` attribute, the
    ``args`` annotation, the ``<Name>Config`` beside it in its module or package, else its base class's."""
    import transformers

    def is_args(obj) -> bool:
        return inspect.isclass(obj) and issubclass(obj, transformers.TrainingArguments)

    own = getattr(cls, "config_cls", None)
    if is_args(own):
        return own
    for klass in cls.__mro__:
        if klass is transformers.Trainer:
            break
        init = klass.__dict__.get("__init__")
        if init is not None:
            ann = inspect.signature(init).parameters.get("args")
            ann = ann.annotation if ann is not None else None
            for candidate in [ann, *getattr(ann, "__args__", ())]:
                if is_args(candidate):
                    return candidate
        want = klass.__name__.replace("Trainer", "Config")
        module = sys.modules.get(klass.__module__)
        package = sys.modules.get(klass.__module__.rsplit(".", 1)[0])
        for where in (module, package):
            candidate = getattr(where, want, None)
            if is_args(candidate):
                return candidate
    return None


def config_fields(cfg: type | None) -> set[str]:
    return {f.name for f in dataclasses.fields(cfg)} if cfg is not None else set()


def columns_read(cls: type) -> set[str]:
    """The sample columns of :data:`COLUMNS` named (as string literals) in the trainer's own module, or, for a class
    whose module names none (a deprecation shim), in its nearest trl base class's."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("trl"):
            break
        try:
            source = inspect.getsource(sys.modules[klass.__module__])
        except (OSError, TypeError):
            continue
        names = {c for c in COLUMNS if re.search(rf"[\"']{c}[\"']", source)}
        if names:
            return names
    return set()


# ----------------------------------------------------------------------------------------------------------------------
# Data (shared by every case: built once)
# ----------------------------------------------------------------------------------------------------------------------

#: the sample columns a recipe can provide
COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected", "reference", "label", "privileged_context")


@functools.lru_cache(maxsize=None)
def tokenizer():
    return E.build_tokenizer()


@functools.lru_cache(maxsize=None)
def dataset(*columns: str):
    """A ``datasets.Dataset`` of :data:`N_SAMPLES` rows with ``columns`` (standard text format)."""
    import datasets

    n = N_SAMPLES
    make = {
        "text": lambda: E.sentences(n, seed=21),
        "prompt": lambda: E.sentences(n, seed=22, lo=3, hi=10),
        "completion": lambda: [" " + s for s in E.sentences(n, seed=23, lo=1, hi=8)],
        "chosen": lambda: [" " + s for s in E.sentences(n, seed=24, lo=1, hi=8)],
        "rejected": lambda: [" " + s for s in E.sentences(n, seed=25, lo=2, hi=7)],
        "reference": lambda: [" " + s for s in E.sentences(n, seed=26, lo=1, hi=6)],
        "label": lambda: [i % 2 == 0 for i in range(n)],
        "privileged_context": lambda: E.sentences(n, seed=27, lo=2, hi=5),
        "messages": lambda: [
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            for p, c in zip(E.sentences(n, seed=28, lo=3, hi=10), E.sentences(n, seed=29, lo=1, hi=8))
        ],
    }
    return datasets.Dataset.from_dict({c: make[c]() for c in columns})


def reward_parity(completions, **kwargs) -> list[float]:
    """A deterministic reward of the completion's text, 0 or 1: different completions of one prompt get different
    rewards (an advantage to train on), and some reach 1.0, what self-distillation trainers count as a success."""
    return [float(sum(map(ord, str(c))) % 2) for c in completions]


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


_CHECKPOINTS = tempfile.mkdtemp(prefix="hgf_matrix_models_")
atexit.register(shutil.rmtree, _CHECKPOINTS, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def local_checkpoint(kind: str, seed: int = 0) -> str:
    """A folder holding the tiny model ``kind`` and the tokenizer (``save_pretrained``): trainers that load a copy of
    the model (a teacher, a reference model) or its tokenizer from ``config._name_or_path`` find them there, offline."""
    path = f"{_CHECKPOINTS}/{kind}-{seed}"
    build(kind, seed).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def build_named(kind: str, seed: int = 0):
    """:func:`build`, with ``config._name_or_path`` pointing at :func:`local_checkpoint`."""
    path = local_checkpoint(kind, seed)
    model = build(kind, seed)
    model.config._name_or_path = path
    model.name_or_path = path
    return model


def build(kind: str, seed: int = 0):
    """A tiny fp32 model, every dropout 0: ``llama`` / ``qwen2`` / ``llama_seqcls`` (1 label: a reward model) / ``t5`` /
    ``bart`` from tests/support/harness.py, ``qwen3_moe`` (4 experts, 2 per token, router aux loss) or ``llama_lora`` (PEFT
    LoRA on the Llama)."""
    import transformers as tf

    if kind == "llama_seqcls":
        return H.build_model("llama_seqcls", seed=seed, num_labels=1)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **{k: v for k, v in H._DECODER.items() if k != "intermediate_size"},
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            head_dim=16,
            router_aux_loss_coef=0.3,
            output_router_logits=True,
        )
        torch.manual_seed(seed)
        return tf.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager").float()
    if kind == "llama_lora":
        import peft

        base = H.build_model("llama", seed=seed)
        torch.manual_seed(seed + 1)
        model = peft.get_peft_model(
            base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                  task_type="CAUSAL_LM")
        )
        # LoRA's B starts at zero: the gradient of A would be zero; give B a value so every trained weight moves
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
        return model
    return H.build_model(kind, seed=seed)


# ----------------------------------------------------------------------------------------------------------------------
# Recipes
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Skip:
    reason: str


@dataclass
class Recipe:
    """How to build one case: ``make(output_dir)`` returns the trainer. ``truth``: the ground truth a patched run that
    hf_gradfix reports exact is held to: a task of :func:`token_truth` (``"causal"``, ``"seq2seq"``: per-target cross
    entropy from the logits, written here) or ``"trainer_loss"`` (the trainer's own loss on the whole window as one
    batch, :func:`trainer_loss_truth`, for losses this file does not write out: distillation, ...)."""

    name: str
    make: Callable[[str], Any]
    truth: str = "trainer_loss"


def training_args(cfg_cls, output_dir: str, **overrides):
    """The case's config: SGD at lr 0, no clipping, GA 2, CPU, fp32, quiet; the fields below only where the config
    class has them (the RL / distillation sizes, no vLLM, no logging of completions)."""
    fields = config_fields(cfg_cls)
    wanted = dict(
        bf16=False,
        fp16=False,
        max_length=None,
        dataset_num_proc=None,
        use_vllm=False,
        num_generations=2,
        num_generations_eval=2,
        max_completion_length=COMPLETION_LEN,
        max_new_tokens=COMPLETION_LEN,
        max_prompt_length=None,
        log_completions=False,
        disable_dropout=True,
        shuffle_dataset=False,
        use_extended_uld=False,  # GOLD: byte offsets of a byte-level BPE tokenizer; the test tokenizer is word-level
        distillation_topk=8,  # SDFT / SDPO: top-k logits of a 97-token vocabulary
        max_steps=2,
        # GRPO-like (a KL coefficient beside num_iterations): no KL term, so no reference model (half the forwards)
        beta=0.0 if "num_iterations" in fields else None,
    )
    wanted = {k: v for k, v in wanted.items() if k in fields and v is not None}
    wanted.update(overrides)
    return E.training_args(output_dir, args_cls=cfg_cls, **wanted)


def _trainer_factory(cls, cfg_cls, *, model: str, data: tuple[str, ...], args: dict | None = None, **extra):
    params = init_params(cls)

    def make(output_dir: str):
        kwargs = dict(
            model=build_named(model),
            args=training_args(cfg_cls, output_dir, **(args or {})),
            train_dataset=dataset(*data),
            processing_class=tokenizer(),
        )
        if "ref_model" in params:  # a frozen copy of the policy: TRL would load it from the model's hub id otherwise
            kwargs["ref_model"] = build_named(model)
        for key, value in extra.items():
            kwargs[key] = value() if callable(value) and key.endswith("_model") else value
        kwargs = {k: v for k, v in kwargs.items() if k in params}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the experimental namespaces' deprecation notices
            return cls(**kwargs)

    return make


def _server_needed(fields: set[str], params: dict) -> str | None:
    if {"rollout_worker", "weight_transfer"} & set(params):
        return ("it generates through a vLLM server (rollout_worker / weight_transfer); a CPU CI runner has no vLLM "
                "server and no GPU")
    for name in sorted(fields):
        if "server" in name and "url" in name:
            switch = "use_vllm" if name.startswith("vllm_") else "use_teacher_server"
            if switch not in fields:
                return (f"its config has {name} and no {switch} switch to run without that server: it needs a "
                        "running vLLM / teacher server (no server, no GPU, no network on a CPU CI runner)")
    model = params.get("model")
    if model is not None and model.annotation is str:
        return "its model must be a hub id or a local checkpoint path loaded by a vLLM server (model: str)"
    return None


def _module_has(cls: type, name: str) -> bool:
    """Whether the module defining ``cls`` (or a trl base class) imports ``name`` (e.g. the model class it loads)."""
    return any(name in vars(sys.modules[k.__module__]) for k in cls.__mro__ if k.__module__.startswith("trl"))


def plan_for(cls: type) -> Recipe | Skip:
    """The recipe of one discovered class, chosen from what it needs, or why none fits."""
    params = init_params(cls)
    cfg = config_class(cls)
    fields = config_fields(cfg)
    if cfg is None:
        return Skip(f"no TrainingArguments subclass found for {cls.__name__} (no config_cls, no `args` annotation, "
                    f"no {cls.__name__.replace('Trainer', 'Config')} beside it)")
    server = _server_needed(fields, params)
    if server:
        return Skip(server)
    columns = columns_read(cls)
    if "reward_funcs" in params:
        data = ("prompt",) + (("privileged_context",) if "privileged_context" in columns else ())
        return Recipe("rl: prompt-only data, a deterministic reward function, generation without vLLM",
                      _trainer_factory(cls, cfg, model="llama", data=data, reward_funcs=reward_parity), "rl")
    if "teacher_model" in params:
        teacher = functools.partial(build_named, "llama", 1)
        if "messages" in columns:
            data, what = ("messages",), "conversational (messages)"
        else:
            data, what = ("prompt", "completion"), "prompt-completion"
        return Recipe(f"distillation: {what} data, a tiny teacher of the same vocabulary, TRL's default on-policy "
                      "share",
                      _trainer_factory(cls, cfg, model="llama", data=data, teacher_model=teacher))
    if "privileged_context" in columns:
        return Recipe("self-distillation: prompts with a privileged context for the teacher prompt",
                      _trainer_factory(cls, cfg, model="llama", data=("prompt", "privileged_context")))
    if "desirable_weight" in fields:
        return Recipe("unpaired preference: prompt, completion, label",
                      _trainer_factory(cls, cfg, model="llama", data=("prompt", "completion", "label")))
    if _module_has(cls, "AutoModelForSequenceClassification"):
        return Recipe("reward model: preference data on a 1-label sequence-classification model",
                      _trainer_factory(cls, cfg, model="llama_seqcls", data=("chosen", "rejected")))
    if {"chosen", "rejected", "reference"} <= columns:
        return Recipe("triple preference: prompt, chosen, rejected, reference",
                      _trainer_factory(cls, cfg, model="llama", data=("prompt", "chosen", "rejected", "reference")))
    if {"chosen", "rejected"} <= columns and "beta" in fields:
        return Recipe("preference: prompt, chosen, rejected",
                      _trainer_factory(cls, cfg, model="llama", data=("prompt", "chosen", "rejected")))
    if "dataset_text_field" in fields:
        return Recipe("language modeling: text", _trainer_factory(cls, cfg, model="llama", data=("text",)), "causal")
    return Skip(f"no recipe fits: __init__ takes {sorted(params)}, config {cfg.__name__}, columns read "
                f"{sorted(columns)}")


def sft_variants() -> dict[str, Recipe]:
    """SFTTrainer beyond its discovered case: a MoE model (Qwen3-MoE, 4 experts, 2 per token; TRL turns the router
    aux loss on) and a PEFT LoRA model."""
    import trl

    cls, cfg = trl.SFTTrainer, config_class(trl.SFTTrainer)
    return {
        "trl.SFTTrainer[qwen3_moe]": Recipe("language modeling on a MoE model: the window objective plus the router "
                                            "aux loss averaged over micro-batches",
                                            _trainer_factory(cls, cfg, model="qwen3_moe", data=("text",)), "causal"),
        "trl.SFTTrainer[peft_lora]": Recipe("language modeling on a PEFT LoRA model",
                                            _trainer_factory(cls, cfg, model="llama_lora", data=("text",)), "causal"),
    }


# ----------------------------------------------------------------------------------------------------------------------
# transformers' Trainer / Seq2SeqTrainer and the subclasses real projects write
# ----------------------------------------------------------------------------------------------------------------------


def _tf_classes():
    """The subclasses, built on first use (this module imports without transformers' Trainer being touched)."""
    import contextlib

    import torch.nn.functional as F
    from transformers import Trainer

    class OutputsLossTrainer(Trainer):
        """(a) the docs' pattern: ``compute_loss`` returns ``outputs.loss`` (a per-micro-batch mean)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            loss = outputs.loss
            return (loss, outputs) if return_outputs else loss

    class OwnMeanTrainer(Trainer):
        """(b) ``compute_loss`` computing its own per-micro-batch mean cross entropy from the logits."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
            return (loss, outputs) if return_outputs else loss

    class OwnStepTrainer(Trainer):
        """(c) LLaMA-Factory's HyperParallelTrainer pattern: ``training_step`` calls ``compute_loss`` itself, divides by
        the accumulation steps when the model takes no loss kwargs, and calls ``accelerator.backward``."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            if not self.model_accepts_loss_kwargs:
                loss = loss / self.args.gradient_accumulation_steps
            self.accelerator.backward(loss)
            return loss.detach()

    class ContextStepTrainer(Trainer):
        """(d) TRL's pattern: ``training_step`` wraps ``super().training_step`` in a context manager
        (saved-tensor hooks, as activation offloading installs)."""

        def training_step(self, *args, **kwargs):
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            with contextlib.ExitStack() as stack:
                stack.enter_context(hooks)
                return super().training_step(*args, **kwargs)

    class TaggedBatchTrainer(Trainer):
        """(e) ``get_batch_samples`` overridden to add a key to every micro-batch, which its ``compute_loss`` reads."""

        def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
            for index, batch in enumerate(batches):
                batch["micro_batch_index"] = torch.tensor(index)
            return batches, count

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            inputs.pop("micro_batch_index")  # put there by get_batch_samples above
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return dict(outputs_loss=OutputsLossTrainer, own_mean=OwnMeanTrainer, own_step=OwnStepTrainer,
                context_step=ContextStepTrainer, tagged_batch=TaggedBatchTrainer)


@functools.lru_cache(maxsize=None)
def _tokenized_causal():
    import datasets

    tok = tokenizer()
    ds = datasets.Dataset.from_dict({"text": dataset("text")["text"]})
    return ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])


@functools.lru_cache(maxsize=None)
def _tokenized_seq2seq():
    import datasets

    tok = tokenizer()

    def encode(batch):
        enc = tok(batch["prompt"])
        enc["labels"] = tok(batch["completion"])["input_ids"]
        return enc

    ds = datasets.Dataset.from_dict({k: dataset("prompt", "completion")[k] for k in ("prompt", "completion")})
    return ds.map(encode, batched=True, remove_columns=["prompt", "completion"])


def transformers_cases() -> dict[str, Recipe]:
    """transformers' ``Trainer`` and ``Seq2SeqTrainer`` and the subclasses of :func:`_tf_classes`."""
    import transformers as tf

    classes = _tf_classes()

    def causal(cls, model="llama"):
        def make(output_dir):
            return cls(model=build(model), args=E.training_args(output_dir, max_steps=2),
                       train_dataset=_tokenized_causal(),
                       data_collator=tf.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
                       processing_class=tokenizer())

        return make

    def seq2seq(arch):
        def make(output_dir):
            model = build(arch)
            return tf.Seq2SeqTrainer(model=model, args=E.training_args(output_dir, args_cls=tf.Seq2SeqTrainingArguments,
                                                                         max_steps=2),
                                     train_dataset=_tokenized_seq2seq(),
                                     data_collator=tf.DataCollatorForSeq2Seq(tokenizer(), model=model),
                                     processing_class=tokenizer())

        return make

    return {
        "Trainer": Recipe("causal LM, transformers' collator", causal(tf.Trainer), "causal"),
        "Seq2SeqTrainer[t5]": Recipe("T5, DataCollatorForSeq2Seq", seq2seq("t5"), "seq2seq"),
        "Seq2SeqTrainer[bart]": Recipe("BART, DataCollatorForSeq2Seq", seq2seq("bart"), "seq2seq"),
        "a_compute_loss_outputs_loss": Recipe(classes["outputs_loss"].__doc__, causal(classes["outputs_loss"]),
                                              "causal"),
        "b_compute_loss_own_mean": Recipe(classes["own_mean"].__doc__, causal(classes["own_mean"]), "causal"),
        "c_training_step_own_backward": Recipe(classes["own_step"].__doc__ + " Model without loss kwargs.",
                                               causal(classes["own_step"], model="nokwargs"), "causal"),
        "c_training_step_own_backward[loss_kwargs]": Recipe(classes["own_step"].__doc__ + " Model taking the count.",
                                                            causal(classes["own_step"]), "causal"),
        "d_training_step_context_manager": Recipe(classes["context_step"].__doc__, causal(classes["context_step"]),
                                                  "causal"),
        "e_get_batch_samples_adds_key": Recipe(classes["tagged_batch"].__doc__, causal(classes["tagged_batch"]),
                                               "causal"),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Running one case
# ----------------------------------------------------------------------------------------------------------------------


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 (an object that cannot be copied: kept as it is)
        return value


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@dataclass
class Run:
    """What one training run did: per optimizer step k, ``grads[k]`` (the accumulated gradient at
    ``on_pre_optimizer_step``) and ``windows[k]`` (a copy of the inputs of every training ``compute_loss`` call of that
    step: the micro-batches as the trainer trained on them, after its own ``_prepare_inputs``, generation included)."""

    mode: str
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: per optimizer step, what hf_gradfix reported at on_pre_optimizer_step (:func:`plugin_report`); patched runs
    reports: list[dict[str, Any]] = field(default_factory=list)
    windows: list[list[Any]] = field(default_factory=list)
    error: BaseException | None = None
    warnings: list[str] = field(default_factory=list)  # hf_gradfix WARNING records
    trainer: Any = None
    initial: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0


def run(make: Callable[[str], Any], mode: str) -> Run:
    """Train one case stock (``mode="stock"``) or with the trainer built under ``hf_gradfix.patch()`` (``"patch"``)."""
    import time

    import hf_gradfix
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    started = time.perf_counter()
    result = Run(mode)
    # Every object alive before the run (the modules of trl, transformers, datasets, ...) is moved out of the
    # collector's sight for the run: accelerate's free_memory() at train() and patch()'s look for earlier Trainers
    # each run gc.collect(), which otherwise walks that whole heap (1-2 s a call here; the run itself takes ~1 s).
    gc.freeze()
    handler = _Records()
    logger = logging.getLogger("hf_gradfix")  # its own handler does not propagate: listen on the logger itself
    logger.addHandler(handler)
    output_dir = tempfile.mkdtemp(prefix="hgf_matrix_")
    try:
        if mode == "patch":
            hf_gradfix.patch()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = make(output_dir)
        except Exception as err:  # noqa: BLE001 (construction refused: the verdict names it)
            result.error = err
            return result
        finally:
            if mode == "patch":
                hf_gradfix.unpatch()
        result.trainer = trainer
        trainer.remove_callback(PrinterCallback)
        window: list[Any] = []
        inner = trainer.compute_loss  # the class's (a patched trainer's: hf_gradfix's outermost layer)

        def compute_loss(model, inputs, *args, **kwargs):
            if model.training:
                window.append(_clone(inputs))
            return inner(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss  # instance attribute: what training_step calls (the probes go around it)

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                result.grads.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                     for n, p in trainer.model.named_parameters() if p.requires_grad})
                result.windows.append(list(window))
                window.clear()
                if mode == "patch":
                    result.reports.append(plugin_report(trainer))

        trainer.add_callback(Grads())
        result.initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
        except Exception as err:  # noqa: BLE001 (the verdict names it)
            result.error = err
    finally:
        gc.unfreeze()
        logger.removeHandler(handler)
        shutil.rmtree(output_dir, ignore_errors=True)
        result.warnings = [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]
        result.seconds = time.perf_counter() - started
    return result


def plugin_report(trainer) -> dict[str, Any]:
    """What hf_gradfix says about the optimizer window being stepped (read at ``on_pre_optimizer_step``, as
    ``state.window`` only lives for the window): ``counted`` (the loss probed and this window's targets counted: the
    fix is in force), the disabled reason, the fixes it applied."""
    import hf_gradfix

    state = hf_gradfix.state_of(trainer)
    if state is None:
        return {"installed": False, "counted": False, "reason": None, "fixes": []}
    window = getattr(state, "window", None)
    # disabled for the run, or a window left to the trainer after it was seen training on other targets than drawn
    reason = getattr(state, "disabled_reason", None) or getattr(state, "rewritten", None)
    counted = (bool(getattr(state, "probed", False)) and reason is None and not getattr(state, "stock_window", False)
               and window is not None and getattr(window, "global_count", None) is not None)
    rl = getattr(state, "rl", None)  # a TRL policy-gradient trainer: the window counted from its generation batch
    if rl is not None and reason is None and getattr(rl, "counted", False) and window is not None:
        counted = True
    return {"installed": True, "counted": counted, "reason": reason, "fixes": list(getattr(state, "fixes", [])),
            "rl_loss_type": getattr(rl, "loss_type", None)}


# ----------------------------------------------------------------------------------------------------------------------
# Ground truth
# ----------------------------------------------------------------------------------------------------------------------


def _grads_of(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if p.requires_grad}


def router_aux_coef(model) -> float:
    """The MoE router aux coefficient the model adds when it returns router logits (0 when it does not)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def token_truth(model, batches: list, task: str, aux_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """Gradient of (sum of the window's per-target CE) / (its target count) [+ aux_coef * mean over the window's
    micro-batches of the model's router aux loss], from the logits, by the task's rule (tests/support/ecosystem.py)."""
    model.zero_grad(set_to_none=True)
    total, count = None, 0
    for batch in batches:
        ce, c = E.batch_loss_sum(model, batch, task)
        total = ce if total is None else total + ce
        count += c
    loss = total / count
    if aux_coef:
        auxes = [model(**{k: b[k] for k in E.MODEL_INPUTS if k in b}, output_router_logits=True).aux_loss
                 for b in batches]
        loss = loss + aux_coef * torch.stack(auxes).mean()
    loss.backward()
    grads = _grads_of(model)
    model.zero_grad(set_to_none=True)
    return grads


_PAD_VALUES = {"labels": E.IGNORE_INDEX, "completion_mask": 0, "attention_mask": 0, "prompt_attention_mask": 0}


def merge_window(batches: list[Mapping], pad_id: int) -> dict[str, Any]:
    """The window's micro-batches as one batch (GA k x b as 1 x kb): every per-row tensor padded to the longest along
    its last dimension, on the side its mask is padded on (prompts on the left, like TRL's collators), then
    concatenated; anything else is taken from the first micro-batch."""
    first = batches[0]
    rows = [int(b["input_ids"].shape[0]) for b in batches]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if not (torch.is_tensor(value) and value.dim() >= 1 and all(
                torch.is_tensor(b.get(key)) and b[key].shape[0] == r for b, r in zip(batches, rows))):
            merged[key] = value
            continue
        parts = [b[key] for b in batches]
        if value.dim() >= 2:
            width = max(p.shape[1] for p in parts)
            mask_key = "prompt_attention_mask" if key.startswith("prompt") else "attention_mask"
            left = any(torch.is_tensor(b.get(mask_key)) and bool((b[mask_key][:, 0] == 0).any()) for b in batches)
            fill = _PAD_VALUES.get(key, pad_id if key.endswith("input_ids") or key == "prompts" else 0)
            padded = []
            for p in parts:
                extra = width - p.shape[1]
                pad = torch.full((p.shape[0], extra, *p.shape[2:]), fill, dtype=p.dtype)
                padded.append(torch.cat([pad, p] if left else [p, pad], dim=1))
            parts = padded
        merged[key] = torch.cat(parts, dim=0)
    return merged


def trainer_loss_truth(stock_trainer, batches: list[Mapping]) -> dict[str, torch.Tensor]:
    """Gradient of the trainer's own loss (its class's ``compute_loss``, no hf_gradfix, ``num_items_in_batch=None``)
    on the whole window as one batch: what gradient accumulation must reproduce for a loss that is a target mean."""
    model = stock_trainer.model
    model.zero_grad(set_to_none=True)
    pad_id = H.pad_id_of(model)
    loss = type(stock_trainer).compute_loss(stock_trainer, model, merge_window(batches, pad_id))
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    grads = _grads_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def truth_errors(patched: Run, stock: Run, truth: str) -> list[float]:
    """Relative gradient error of each optimizer step of the patched run against the ground truth on the micro-batches
    it trained on: ``truth`` a task of :func:`token_truth` (``causal``, ``seq2seq``, ...) or ``"trainer_loss"``
    (:func:`trainer_loss_truth`, on the stock run's trainer)."""
    trainer = stock.trainer if truth == "trainer_loss" else patched.trainer
    model = trainer.model
    model.load_state_dict(patched.initial)
    model.train()
    errors = []
    for k, (got, window) in enumerate(zip(patched.grads, patched.windows)):
        if truth == "rl":  # the loss type's objective over the window (tests/support/rl_reference.py, float64)
            import rl_reference

            loss_type = patched.reports[k].get("rl_loss_type") or "rloo"
            coef = float(trainer.entropy_coef) if getattr(trainer, "_entropy_bonus_enabled", False) else 0.0
            # a fresh model: TRL fused its log-prob head into the trained one's forward
            fresh = type(model)._from_config(model.config, attn_implementation=model.config._attn_implementation)
            fresh.load_state_dict(patched.initial)
            _, want = rl_reference.window_gradient(fresh, window, loss_type, rl_reference.trl_config(trainer),
                                                   entropy_coef=coef)
            errors.append(H.rel_err(got, want))
            continue
        if truth == "trainer_loss":
            want = trainer_loss_truth(trainer, window)
        else:
            want = token_truth(model, window, truth, router_aux_coef(model))
        errors.append(H.rel_err(got, want))
    return errors


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def stock_differences(patched: Run, stock: Run) -> list[float]:
    """||patched - stock|| / ||stock|| per optimizer step (0 where both are zero)."""
    out = []
    for p, s in zip(patched.grads, stock.grads):
        out.append(H.rel_err(p, s) if grad_norm(s) > 0 else (0.0 if grad_norm(p) == 0 else float("inf")))
    return out
