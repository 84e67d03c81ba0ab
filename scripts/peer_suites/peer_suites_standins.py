"""Offline stand-ins for the hub ids that the peers' test suites load: tiny models, tokenizers, datasets.

The peers' tests (TRL's ``tests/test_*_trainer.py``, transformers' ``tests/trainer``) load models such as
``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` and datasets such as ``trl-internal-testing/zen`` from the
Hugging Face Hub. This machine has no hub, so :func:`build` writes, under one directory:

- ``hub/``: a Hugging Face hub cache (``HF_HUB_CACHE`` layout: ``models--org--name/refs/main`` and
  ``snapshots/<rev>/...``) with one tiny random-init model per id, built from its config class (the class is read
  from the id: ``tiny-Qwen3MoeForCausalLM`` -> ``transformers.Qwen3MoeForCausalLM``), a tokenizer trained here with
  the ``tokenizers`` library (byte-level BPE; the family's special tokens; the chat template the installed TRL ships
  for that family, read from the installed package), and a generation config. With ``HF_HUB_OFFLINE=1`` every
  ``from_pretrained`` resolves there, unchanged.
- ``datasets/<org>--<name>/<config>/<split>.parquet``: TRL's own dataset generators (``scripts/generate_*.py`` of
  the TRL checkout) run with ``push_to_hub`` redirected here, so the rows are exactly TRL's; a few other ids
  (wikitext, imdb, ...) get small local rows with the right columns. The pytest plugin maps
  ``datasets.load_dataset(id, config, split=...)`` onto these files (a datasets cache layout is too fragile).
- ``manifest.json``: what was built, and every id that could not be stood in, with the reason.

Nothing here is downloaded. Usage (the runner calls it; by hand)::

    python scripts/peer_suites/peer_suites_standins.py --out /tmp/standins --trl /work/peer-src/trl \
        trl-internal-testing/tiny-Qwen2ForCausalLM-2.5 trl-internal-testing/zen
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

# ----------------------------------------------------------------------------------------------------------------------
# Which ids are models, which are datasets
# ----------------------------------------------------------------------------------------------------------------------

#: ids that do not spell their class: id -> (transformers class, tokenizer family)
NAMED_MODELS = {
    "roneneldan/TinyStories-33M": ("GPTNeoForCausalLM", "gpt2"),
    "nickypro/tinyllama-15M": ("LlamaForCausalLM", "llama2"),
    "bert-base-cased": ("BertForMaskedLM", "bert"),
    "bert-base-uncased": ("BertForMaskedLM", "bert"),
    "distilbert-base-uncased": ("DistilBertForMaskedLM", "bert"),
    "openai-community/gpt2": ("GPT2LMHeadModel", "gpt2"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "hf-internal-testing/tiny-random-LlamaForCausalLM": ("LlamaForCausalLM", "llama2"),
    "hf-internal-testing/tiny-random-gpt2": ("GPT2LMHeadModel", "gpt2"),
    "Qwen/Qwen2.5-0.5B-Instruct": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen/Qwen3-4B": ("Qwen3ForCausalLM", "qwen3"),
    "Qwen/Qwen3-0.6B": ("Qwen3ForCausalLM", "qwen3"),
}

#: ids of datasets (everything TRL's generators write is found by running them; these are the others)
LOCAL_DATASETS = {"Salesforce/wikitext", "wikitext", "stanfordnlp/imdb", "imdb", "fka/awesome-chatgpt-prompts"}

#: TRL's dataset generators: script -> the repo id it pushes to
TRL_DATASET_SCRIPTS = {
    "generate_zen_dataset.py": "trl-internal-testing/zen",
    "generate_zen_image_dataset.py": "trl-internal-testing/zen-image",
    "generate_zen_multi_image_dataset.py": "trl-internal-testing/zen-multi-image",
    "generate_toolcall_dataset.py": "trl-internal-testing/toolcall",
    "generate_harmony_dataset.py": "trl-internal-testing/harmony",
}

_TINY_ID = re.compile(r"^[\w.-]+/tiny-(?:random-)?([A-Za-z0-9_]+?(?:For[A-Za-z]+|Model|LMHeadModel))(?:-([\w.-]+))?$")


def classify(repo_id: str) -> tuple[str, str | None]:
    """``("model", class)``, ``("dataset", None)`` or ``("unknown", reason)`` for a hub id found in a test file."""
    if repo_id in NAMED_MODELS:
        return "model", NAMED_MODELS[repo_id][0]
    if repo_id in LOCAL_DATASETS or repo_id in TRL_DATASET_SCRIPTS.values():
        return "dataset", None
    match = _TINY_ID.match(repo_id)
    if match:
        return "model", match.group(1)
    return "unknown", "no stand-in for this id"


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------------

#: family -> how its tokenizer looks: TRL chat template (file stem in the installed ``trl/chat_templates``, or an
#: inline template), bos/eos/pad/unk, whether bos is prepended, extra special tokens; every ``<|...|>``-like token the
#: template mentions is added as well. ``plain`` tokens are added as non-special (decoding keeps them, as Qwen's
#: ``<think>``/``<tool_call>``).
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_INST = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
    "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}{% endfor %}"
)
FAMILIES = {
    "qwen2": dict(template="qwen2_5", eos="<|im_end|>", pad="<|endoftext|>",
                  plain=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "qwen3": dict(template="qwen3", eos="<|im_end|>", pad="<|endoftext|>",
                  plain=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "llama3": dict(template="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
                   special=["<|end_of_text|>", "<|finetune_right_pad_id|>"]),
    "llama3_1": dict(template="llama3_1", bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
                     special=["<|end_of_text|>", "<|finetune_right_pad_id|>"]),
    "llama3_2": dict(template="llama3_2", bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
                     special=["<|end_of_text|>", "<|finetune_right_pad_id|>"]),
    "llama2": dict(template=None, bos="<s>", eos="</s>", unk="<unk>", add_bos=True),
    "mistral": dict(template=_INST, bos="<s>", eos="</s>", unk="<unk>", add_bos=True, special=["[INST]", "[/INST]"]),
    "gemma": dict(template="gemma", bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True,
                  special=["<start_of_turn>", "<end_of_turn>"]),
    "cohere": dict(template="cohere", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", add_bos=True),
    "cohere2": dict(template="cohere2", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", add_bos=True),
    "phi3": dict(template="phi3", bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>"),
    "gptoss": dict(template="gptoss", bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>"),
    "deepseekv3": dict(template="deepseekv3", bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                       pad="<｜end▁of▁sentence｜>", add_bos=True, plain=["<think>", "</think>"]),
    "glm4moe": dict(template="glm4moe", eos="<|endoftext|>", pad="<|endoftext|>", special=["[gMASK]", "<sop>"],
                    plain=["<think>", "</think>", "<tool_call>", "</tool_call>"]),
    "lfm2": dict(template="lfm2", bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=True),
    "lfm2_2_5": dict(template="lfm2_2_5", bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=True),
    "nemotron": dict(template="nemotron_3_nano", bos="<s>", eos="<|im_end|>", pad="<unk>", unk="<unk>",
                     plain=["<think>", "</think>"]),
    "chatml": dict(template=_CHATML, eos="<|endoftext|>", pad="<|pad|>", special=["<|im_start|>", "<|im_end|>"]),
    "gpt2": dict(template=None, bos="<|endoftext|>", eos="<|endoftext|>", unk="<|endoftext|>"),
    "gpt_neox": dict(template=None, bos="<|endoftext|>", eos="<|endoftext|>", pad="<|padding|>"),
    "bert": dict(template=None, bert=True),
}

#: class-name prefix -> family (first match wins; the id's suffix picks the Llama / LFM2 version)
_CLASS_FAMILY = [
    ("Qwen3", "qwen3"), ("Qwen2", "qwen2"), ("Llama", "llama3_2"), ("Mistral", "mistral"), ("Mixtral", "mistral"),
    ("Gemma", "gemma"), ("Cohere2", "cohere2"), ("Cohere", "cohere"), ("Phi3", "phi3"), ("GptOss", "gptoss"),
    ("DeepseekV3", "deepseekv3"), ("Glm4Moe", "glm4moe"), ("Lfm2", "lfm2"), ("NemotronH", "nemotron"),
    ("GPTNeoX", "gpt_neox"), ("GPT2", "gpt2"), ("GPTNeo", "gpt2"), ("Bert", "bert"), ("Olmo", "chatml"),
]


def family_of(repo_id: str, class_name: str) -> str:
    if repo_id in NAMED_MODELS:
        return NAMED_MODELS[repo_id][1]
    suffix = repo_id.rsplit("-", 1)[-1]
    for prefix, family in _CLASS_FAMILY:
        if class_name.startswith(prefix):
            if family == "llama3_2":
                return {"3": "llama3", "3.1": "llama3_1"}.get(suffix, "llama3_2")
            if family == "lfm2" and suffix == "2.5":
                return "lfm2_2_5"
            return family
    return "chatml"


#: text the BPE merges are learned from (set by :func:`build` once the datasets exist)
_CORPUS: list[str] = []


def _corpus() -> list[str]:
    """The Zen of Python (stdlib ``this``), a few generic sentences, and every string of the stand-in datasets.

    Learning the merges from the datasets the tests train on keeps their sequences about as short in tokens as
    with the real tokenizers (TRL's tool-call rows must fit the tests' ``max_length=512``).
    """
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import; captured)
    zen = "".join(this.d.get(c, c) for c in this.s)
    extra = (
        "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital. "
        "Answer the question step by step. 0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } : ; , . ! ? "
        "user assistant system tool function name arguments content role The the a an and or not is are was "
        "were be been this that these those it its of to in on at by for with from as if then else while"
    )
    return [zen, extra] * 4 + _CORPUS


def _dataset_strings(store: Path) -> list[str]:
    """Every string in the stand-in datasets (nested values as JSON), for the tokenizer corpus."""
    import pyarrow.parquet as pq

    texts = []
    for path in sorted(store.glob("*/*/*.parquet")):
        for row in pq.read_table(path).to_pylist():
            for value in row.values():
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, (list, dict)):
                    texts.append(json.dumps(value, ensure_ascii=False, default=str))
    return texts


def _template_text(template: str | None, trl_templates: Path | None) -> str | None:
    if template is None or "{" in template:
        return template
    if trl_templates is None:
        return None
    path = trl_templates / f"{template}.jinja"
    return path.read_text(encoding="utf-8") if path.exists() else None


_SPECIAL_RE = re.compile(r"<\|[^<>|\s'\"]{1,40}\|>|<｜[^｜<>'\"]{1,40}｜>|<[A-Z_]{2,30}_TOKEN>|<(?:start|end)_of_turn>")


@functools.lru_cache(maxsize=None)
def build_tokenizer(family: str, trl_templates: Path | None):
    """A fast tokenizer for ``family``, trained here (byte-level BPE, 2000 tokens); one per family per build."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    if spec.get("bert"):
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(_corpus(), trainers.WordPieceTrainer(vocab_size=2000, special_tokens=special,
                                                                    show_progress=False))
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                       sep_token="[SEP]", mask_token="[MASK]")

    template = _template_text(spec.get("template"), trl_templates)
    named = [spec.get(k) for k in ("bos", "eos", "pad", "unk")]
    special = [t for t in named if t] + list(spec.get("special", []))
    if template:
        special += _SPECIAL_RE.findall(template)
    special = list(dict.fromkeys(special))  # ordered, unique
    plain = [t for t in spec.get("plain", []) if t not in special]

    tok = Tokenizer(models.BPE(unk_token=spec.get("unk")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the special tokens sit in the base vocabulary (low ids), as in sentencepiece/tiktoken vocabularies, so that
    # ``tokenizer.vocab_size`` covers every id the tokenizer emits (transformers' tests size models by it)
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=2000, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if spec.get("add_bos") and spec.get("bos"):
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if plain:
        tok.add_tokens(plain)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec.get("bos"), eos_token=spec.get("eos"), pad_token=spec.get("pad"),
        unk_token=spec.get("unk"),
    )
    if template:
        fast.chat_template = template
    return fast


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

#: a tiny shape every decoder accepts; names a config does not know are stored and ignored
_TINY = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=4, max_position_embeddings=1024,
    # MoE families (Qwen3-MoE, GPT-OSS, Mixtral, DeepSeek-V3, GLM-4-MoE)
    num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_routed_experts=4,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention (DeepSeek-V3)
    kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
    # hybrid Mamba (NemotronH): one Mamba layer, one attention layer
    hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
    mamba_n_groups=1, chunk_size=16,
)
_TINY_BY_TYPE = {
    "gpt2": dict(n_embd=16, n_layer=2, n_head=4, n_positions=1024),
    "gpt_neo": dict(hidden_size=16, num_layers=2, num_heads=4, intermediate_size=32, max_position_embeddings=1024,
                    attention_types=[[["global", "local"], 1]]),
    "gpt_neox": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
    "bert": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
    "distilbert": dict(dim=16, n_layers=2, n_heads=4, hidden_dim=32),
}
#: changes to ``_TINY`` for one model type
_TINY_PATCH = {
    "deepseek_v3": dict(num_key_value_heads=4),  # multi-head latent attention: as many kv heads as heads
}


def build_model(class_name: str, tokenizer, dtype: str = "float32"):
    """A random-init model of ``class_name`` sized for the tokenizer, in ``dtype``; a forward pass proves it runs."""
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    config_cls = cls.config_class
    kwargs = dict(_TINY_BY_TYPE.get(config_cls.model_type, _TINY))
    kwargs.update(_TINY_PATCH.get(config_cls.model_type, {}))
    kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if "SequenceClassification" in class_name:
        kwargs["num_labels"] = 1  # as TRL's tiny reward models
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    model = cls(config)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([[min(3, len(tokenizer) - 1)] * 4])
        out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite output")
    return model.to(getattr(torch, dtype))


# ----------------------------------------------------------------------------------------------------------------------
# Hub cache
# ----------------------------------------------------------------------------------------------------------------------


def _snapshot(hub: Path, repo_id: str, kind: str = "models") -> Path:
    """Create ``{kind}--org--name`` in a hub cache with ``refs/main`` -> a fixed revision; return the snapshot dir."""
    revision = hashlib.sha1(f"hf_gradfix-standin:{repo_id}".encode()).hexdigest()
    repo_dir = hub / f"{kind}--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def build_model_standin(hub: Path, repo_id: str, class_name: str, trl_templates: Path | None) -> None:
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(family_of(repo_id, class_name), trl_templates)
    # TRL's tiny models are stored in bfloat16 (tests loading them with dtype "auto" see that); the other ids'
    # checkpoints are float32
    dtype = "bfloat16" if repo_id.startswith("trl-internal-testing/") else "float32"
    model = build_model(class_name, tokenizer, dtype)
    snapshot = _snapshot(hub, repo_id)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    if "CausalLM" in class_name or "LMHead" in class_name:
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(snapshot)


# ----------------------------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------------------------


def dataset_dir(store: Path, repo_id: str) -> Path:
    return store / repo_id.replace("/", "--")


# Runs one of TRL's generators with ``push_to_hub`` writing parquet files instead (run in a child process: the
# generators are scripts with a ``__main__`` block and module-level state).
_GENERATOR_SHIM = textwrap.dedent(
    """
    import runpy, sys
    from pathlib import Path
    import datasets

    store, script = Path(sys.argv[1]), sys.argv[2]

    def push_to_hub(self, repo_id, config_name="default", **_):
        splits = self.items() if isinstance(self, datasets.DatasetDict) else [("train", self)]
        out = store / repo_id.replace("/", "--") / config_name
        out.mkdir(parents=True, exist_ok=True)
        for split, ds in splits:
            ds.to_parquet(str(out / f"{split}.parquet"))

    datasets.Dataset.push_to_hub = push_to_hub
    datasets.DatasetDict.push_to_hub = push_to_hub
    sys.argv = [script, "--push_to_hub", "True"]
    runpy.run_path(script, run_name="__main__")
    """
)


def build_trl_datasets(store: Path, trl_src: Path, wanted: set[str], log) -> dict[str, str]:
    """Run TRL's dataset generators for the wanted ids; return ``{id: reason}`` for those that failed."""
    failed = {}
    for script, repo_id in TRL_DATASET_SCRIPTS.items():
        if repo_id not in wanted or dataset_dir(store, repo_id).exists():
            continue
        path = trl_src / "scripts" / script
        if not path.exists():
            failed[repo_id] = f"{path} not found in the TRL checkout"
            continue
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        proc = subprocess.run([sys.executable, "-c", _GENERATOR_SHIM, str(store), str(path)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            failed[repo_id] = f"{script} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
        else:
            log(f"  dataset {repo_id}: TRL's {script}")
    return failed


def build_local_datasets(store: Path, wanted: set[str], log) -> None:
    """Small rows with the columns the tests read, for the non-TRL dataset ids."""
    from datasets import Dataset

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401
    lines = [ln for ln in "".join(this.d.get(c, c) for c in this.s).splitlines() if ln.strip()]

    def write(repo_id, config, splits):
        for split, rows in splits.items():
            out = dataset_dir(store, repo_id) / config
            out.mkdir(parents=True, exist_ok=True)
            Dataset.from_dict(rows).to_parquet(str(out / f"{split}.parquet"))
        log(f"  dataset {repo_id} ({config}): local rows")

    # wikitext: blank lines and headings included, as in the real file (tests filter or pad them)
    wiki = {"text": ["", " = Zen = ", ""] + [f" {ln} " for ln in lines] * 4}
    for repo_id in {"Salesforce/wikitext", "wikitext"} & wanted:
        for config in ("wikitext-2-raw-v1", "wikitext-103-raw-v1"):
            write(repo_id, config, {"train": wiki, "validation": wiki, "test": wiki})
    for repo_id in {"stanfordnlp/imdb", "imdb"} & wanted:
        rows = {"text": lines * 2, "label": [i % 2 for i in range(2 * len(lines))]}
        write(repo_id, "plain_text", {"train": rows, "test": rows, "unsupervised": rows})
    if "fka/awesome-chatgpt-prompts" in wanted:
        write("fka/awesome-chatgpt-prompts", "default",
              {"train": {"act": [f"act {i}" for i in range(len(lines))], "prompt": lines}})


# ----------------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------------


def _fingerprint() -> str:
    """Stand-ins depend on this file and on the installed libraries; a change rebuilds them."""
    import tokenizers
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "-"
    text = Path(__file__).read_text() + transformers.__version__ + tokenizers.__version__ + trl_version
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(out: Path, ids: set[str], trl_src: Path | None, log=print) -> dict:
    """Build (or complete) the stand-ins for ``ids`` under ``out``; return the manifest.

    Every dataset is built on the first call, whatever ``ids`` holds: the tokenizers learn their merges from the
    datasets' text, so building them all keeps every tokenizer the same from one selection to the next.
    """
    import shutil

    import datasets
    import transformers

    datasets.disable_progress_bars()  # the runner prints its own progress
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    out = Path(out)
    hub, store = out / "hub", out / "datasets"
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest.get("fingerprint") != _fingerprint():
        for stale in (hub, store, manifest_path):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        manifest = {"fingerprint": _fingerprint(), "models": {}, "datasets": {}, "missing": {}}
    hub.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    try:
        import trl

        trl_templates = Path(trl.__file__).parent / "chat_templates"
    except ImportError:
        trl_templates = None

    if not manifest["datasets"]:
        every = set(TRL_DATASET_SCRIPTS.values()) | LOCAL_DATASETS
        failed = build_trl_datasets(store, trl_src, every, log) if trl_src else {}
        build_local_datasets(store, LOCAL_DATASETS, log)
        for repo_id in sorted(every):
            if dataset_dir(store, repo_id).exists():
                manifest["datasets"][repo_id] = sorted(p.name for p in dataset_dir(store, repo_id).iterdir())
            else:
                manifest["missing"][repo_id] = failed.get(repo_id, "dataset generator not available (no --trl?)")
    _CORPUS[:] = _dataset_strings(store)
    build_tokenizer.cache_clear()

    for repo_id in sorted(ids):
        if repo_id in manifest["models"] or repo_id in manifest["datasets"] or repo_id in manifest["missing"]:
            continue
        kind, detail = classify(repo_id)
        if kind == "model":
            if "ConditionalGeneration" in detail or "Remote" in detail:
                manifest["missing"][repo_id] = "vision-language / remote-code model: no offline stand-in"
                continue
            try:
                import transformers

                getattr(transformers, detail)
            except (AttributeError, ImportError):
                manifest["missing"][repo_id] = f"transformers has no class {detail}"
                continue
            try:
                build_model_standin(hub, repo_id, detail, trl_templates)
                manifest["models"][repo_id] = detail
                log(f"  model {repo_id}: {detail}")
            except Exception as exc:  # a config this generic shape does not fit: report, don't guess further
                manifest["missing"][repo_id] = f"stand-in {detail} failed: {type(exc).__name__}: {exc}"[:300]
        elif kind == "unknown":
            manifest["missing"][repo_id] = detail
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--trl", type=Path, help="TRL source checkout (for its dataset generators)")
    parser.add_argument("ids", nargs="+")
    args = parser.parse_args(argv)
    manifest = build(args.out, set(args.ids), args.trl)
    for repo_id, reason in sorted(manifest["missing"].items()):
        print(f"  not stood in: {repo_id}: {reason}")


if __name__ == "__main__":
    main()
