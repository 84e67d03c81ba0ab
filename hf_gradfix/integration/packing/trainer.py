"""Packing inside ``transformers.Trainer``: the train dataloader and the model settings it needs.

Reached from the fixed trainer class (``trainer.top._GradFixTop.get_train_dataloader`` -> ``trainer.workloads``) when the
configuration says ``packing: {enabled: true}``, whichever entry point installed the fix.

- Data: a :class:`~hf_gradfix.packing.sampler.PackedBatchSampler` over the samples' lengths yields one
  bin (a packed row of at most ``token_budget`` tokens) per micro-batch, for every data-parallel rank
  interleaved, and accelerate's own ``BatchSamplerShard`` deals them out (bin ``i`` to rank
  ``i % world``); the sampler makes the bin count divide the world size without dropping or repeating
  a sample. :class:`~hf_gradfix.packing.collator.PackedCollator` builds the row.
- Model: ``use_cache=False``; in varlen mode the attention becomes ``flash_attention_2`` where flash-attn
  and CUDA exist, else the pure-PyTorch reference varlen attention; then the guard runs a tiny
  packed-vs-separate forward and refuses a model that mixes sequences.
- Streams (``IterableDataset``): a :class:`~hf_gradfix.packing.stream.StreamingPacker` packs online; every checkpoint
  stores its state per process (:func:`save_stream_state`) and a resume continues from it (:func:`load_stream_state`).
- Loss: nothing special. Collated labels are -100 at every sequence start, so the loss's own count
  rule (probed like any other batch) counts exactly the real targets of the window.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ...config import ConfigError
from ...config.schema import PackingConfig
from ...errors import UsageError
from ..state import _nd_dims

logger = logging.getLogger("hf_gradfix")

# What prepare_model_for_packing learned about a trainer's model (the first position the model uses on its own),
# for the dataloader built right after it.
_POSITION_START: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _vocab_sizes(model: Any) -> tuple[int | None, int | None]:
    """(input vocabulary, output vocabulary) of the model, read from its embeddings."""
    def rows(module: Any, *names: str) -> int | None:
        for name in names:
            n = getattr(module, name, None)
            if isinstance(n, int) and n > 0:
                return n
        return None

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except (AttributeError, NotImplementedError):
        out = None
    vocab = rows(emb, "num_embeddings") if emb is not None else None
    if vocab is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    labels = rows(out, "out_features", "num_embeddings") if out is not None else None
    return vocab, labels if labels is not None else vocab


_CHECKED: "weakref.WeakKeyDictionary[Any, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def _is_stream(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
    )


def _checked_dataset(trainer, cfg: PackingConfig):
    """The train dataset as the loader reads it, and its one-pass validation (cached per trainer and dataset)."""
    from ...packing.validate import validate_packing_dataset

    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    cached = _CHECKED.get(trainer)
    if cached is not None and cached[0] is dataset:
        return cached[1]
    source = dataset
    if getattr(trainer.args, "remove_unused_columns", False) and hasattr(trainer, "_remove_unused_columns"):
        if getattr(dataset, "column_names", None) is not None:
            dataset = _remove_unused_columns(trainer, dataset)
    from .multimodal import processed_dataset

    dataset = processed_dataset(trainer, dataset)  # TRL's raw vision samples through its own collator, one by one
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"hf_gradfix.packing.enabled: the train dataset is a {type(dataset).__name__} without random access; "
            "packing needs a map-style dataset of samples with 'input_ids'. Fix: tokenize into a datasets.Dataset, "
            "or set packing.enabled: false."
        )
    if len(dataset) == 0:  # stock would train 0 steps and exit 0: say so instead
        raise UsageError(
            "hf_gradfix packing: the train dataset is empty (0 samples), nothing to pack or train; check the dataset "
            "(a filter or a split that removed every row?)"
        )
    vocab, label_vocab = _vocab_sizes(trainer.model)
    check = validate_packing_dataset(dataset, vocab_size=vocab, label_vocab_size=label_vocab, token_budget=_check_budget(cfg))
    _CHECKED[trainer] = (source, (dataset, check))
    return dataset, check


def _remove_unused_columns(trainer, dataset):
    """The Trainer's own removal of the columns its model does not take, except the ones that say where the documents
    of an already packed sample begin (TRL's ``seq_lengths``; a plain Trainer's model takes no such argument): the
    collator keeps those documents apart, where without them it would train a packed sample as one document."""
    from ...packing.collator import BOUNDARY_KEYS

    keep = [c for c in BOUNDARY_KEYS if c in dataset.column_names]
    if not keep or not hasattr(trainer, "_set_signature_columns_if_needed"):
        return trainer._remove_unused_columns(dataset, description="training")
    trainer._set_signature_columns_if_needed()
    saved = trainer._signature_columns
    trainer._signature_columns = list(saved) + [c for c in keep if c not in saved]
    try:
        return trainer._remove_unused_columns(dataset, description="training")
    finally:
        trainer._signature_columns = saved


def _check_budget(cfg: PackingConfig) -> int:
    if cfg.token_budget < 1:
        raise ConfigError(
            f"hf_gradfix.packing.token_budget: invalid value {cfg.token_budget!r}; it must be a positive number of "
            "tokens per packed row, e.g. 4096 (at least your longest sample)."
        )
    return cfg.token_budget


class _EpochAwareLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches the packed batch sampler (reshuffle and repack per epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def packed_train_dataloader(trainer, cfg: PackingConfig):
    """The train dataloader of a packing trainer (prepared by accelerate, like the Trainer's own)."""
    from ...packing.collator import PackedCollator
    from ...packing.sampler import PackedBatchSampler

    budget = _check_budget(cfg)
    if _is_stream(trainer.train_dataset):
        return _streaming_train_dataloader(trainer, cfg, budget)
    if trainer.args.per_device_train_batch_size != 1:
        # A note, not a problem: with packing the micro-batch is sized in tokens, not in sequences.
        logger.info(
            "hf_gradfix packing: each micro-batch is one packed row of <= %d tokens, so per_device_train_batch_size=%d "
            "does not apply (expected with packing; raise packing.token_budget for larger micro-batches).",
            budget, trainer.args.per_device_train_batch_size,
        )
    dataset, check = _checked_dataset(trainer, cfg)
    lengths = check.lengths

    dims = _nd_dims(trainer)  # under an ND mesh accelerate splits batches over the data-parallel ranks only
    world = dims.dp if dims is not None else trainer.accelerator.num_processes
    config = getattr(trainer.model, "config", None)
    cost_coeff, balance_how = None, "rows of equal tokens side by side"
    if cfg.balance == "compute":
        from ...packing.balance import attention_cost_coeff

        cost_coeff, balance_how = attention_cost_coeff(config)
        if cost_coeff is None:
            warnings.warn(f"hf_gradfix packing.balance: compute: {balance_how}; the rows are dealt by tokens "
                          "(set packing.balance: tokens to silence this)", stacklevel=2)
            balance_how = "rows of equal tokens side by side (no cost model)"
        else:
            balance_how = f"rows of equal compute side by side, {balance_how}"
    sampler = PackedBatchSampler(lengths, budget, num_replicas=world, rank="all", seed=trainer.args.seed,
                                 cost_coeff=cost_coeff)
    sampler.set_epoch(0)
    pad_id = getattr(config, "pad_token_id", None)
    from .multimodal import vlm_collator

    collator = vlm_collator(trainer, cfg, budget) or PackedCollator(
        cfg.mode, max_tokens=budget, pad_token_id=0 if pad_id is None else int(pad_id),
        position_ids_start=_POSITION_START.get(trainer, 0),
    )
    loader = _EpochAwareLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=trainer.args.dataloader_num_workers,
        pin_memory=trainer.args.dataloader_pin_memory,
    )
    plan = sampler.plan(0)
    stats = plan.stats
    held = ""
    if check.n_documents is not None and check.n_documents != len(lengths):
        # already packed samples (TRL's SFTConfig(packing=True) writes seq_lengths): each document stays apart
        held = (f" holding {check.n_documents} documents (already packed: their seq_lengths / restarted position_ids "
                "are kept, every document trained apart; the dataset's own packing is not needed with packing.enabled)")
    logger.info(
        "hf_gradfix packing: %d samples%s -> %d rows of <= %d tokens (%s mode), fill %.2f%%, %d per rank per epoch",
        len(lengths), held, len(sampler), budget, cfg.mode, 100.0 * stats.fill, len(sampler) // world,
    )
    if world > 1:
        from ...packing.balance import attention_cost_coeff, document_cost

        c = cost_coeff if cost_coeff is not None else attention_cost_coeff(config)[0]
        cost_part = ""
        if c is not None:
            costs = plan.bin_costs if plan.bin_costs is not None else np.add.reduceat(
                document_cost(np.asarray(lengths)[plan.items], c), plan.offsets[:-1])
            cost_part = f", of compute {plan.step_imbalance(costs):.3f}"
        logger.info("hf_gradfix packing balance: %s; epoch 0's slowest rank per step / the mean, of tokens %.3f%s",
                    balance_how, plan.step_imbalance(), cost_part)
        from ..internal_callbacks import add_internal_callback, internal_callbacks
        from .balance_log import PackingBalanceLog

        if not any(isinstance(cb, PackingBalanceLog) for cb in internal_callbacks(trainer)):
            add_internal_callback(trainer, PackingBalanceLog(trainer, c))  # each window's imbalance, in the logs
    return trainer.accelerator.prepare(loader)


def _refuse_unpackable(trainer) -> None:
    """What packing a dataset of token samples cannot hold, by structure, in one line before anything else is read:
    a trainer that generates what it trains on from prompts (TRL's RL trainers), and an encoder-decoder (a packed row
    concatenates one stack's samples; its labels belong to the other)."""
    name = type(trainer).__name__
    if callable(getattr(trainer, "_generate_and_score_completions", None)):
        raise ConfigError(
            f"hf_gradfix.packing.enabled: invalid value True; it packs a dataset of token samples, and {name} trains "
            "on completions it generates from its dataset's prompts: remove packing.enabled (packing.rl_forwards "
            "packs the policy's log-prob forwards)")
    config = getattr(trainer.model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"hf_gradfix.packing.enabled: invalid value True; {type(trainer.model).__name__} is an encoder-decoder "
            "(config.is_encoder_decoder): a packed row concatenates the samples of one stack while their labels "
            "belong to the decoder: remove packing.enabled (train it on padded batches)")


def prepare_model_for_packing(trainer, cfg: PackingConfig) -> str:
    """``use_cache=False``, the attention implementation, then the guard. Returns a line for the fix log."""
    from ...packing.attention import select_varlen_attention, set_attention_implementation
    from ...packing.guard import check_model_packs_correctly

    _refuse_unpackable(trainer)
    model = trainer.model
    for config in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # a cache created inside forward switches packed detection off
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    dims = _nd_dims(trainer)
    from .multimodal import is_vision_dataset, prepare_vlm_for_packing

    if is_vision_dataset(trainer):
        if dims is not None and dims.cp > 1:
            raise ConfigError("hf_gradfix.packing.enabled: a vision-language dataset with context parallelism "
                              f"(cp={dims.cp}) is not supported (image tokens would be split over the cp ranks); "
                              "set parallel cp to 1 or packing.enabled: false")
        if not _is_stream(trainer.train_dataset):
            _checked_dataset(trainer, cfg)  # bad rows first: one line naming the index, before any forward
        return prepare_vlm_for_packing(trainer, cfg)
    if dims is not None and dims.cp > 1:
        return _prepare_model_for_cp_packing(trainer, cfg, dims.cp, attention)
    if cfg.mode == "varlen" and cfg.attention == "auto":
        attention = select_varlen_attention(trainer.args.device)
        set_attention_implementation(model, attention)
    line = f"packing: {cfg.mode} mode, rows of <= {cfg.token_budget} tokens, attention {attention}"
    split = _split_stateful_layers(model)
    if split:
        line += f", {split}"
    if not cfg.guard:
        logger.warning(
            "hf_gradfix packing: packing.guard is false, so the model is not checked for letting packed sequences "
            "attend to each other; a model that mixes them trains on wrong gradients with no error. Keep guard: true "
            "unless this model is known to pack correctly."
        )
        line += ", guard off"
    if cfg.guard:
        budget = _check_budget(cfg)
        longest = None  # a stream's lengths are unknown up front: probe up to the budget
        if not _is_stream(trainer.train_dataset):
            _, check = _checked_dataset(trainer, cfg)  # bad rows first: one line naming the index, before any forward
            longest = int(check.lengths.max()) if check.n_samples else None
        # Under the Trainer's mixed precision, as its forward will run: this runs before accelerate wraps the model,
        # and an fp32 model on flash_attention_2 outside autocast hands fp32 to flash-attn, which refuses it.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []), \
                trainer.accelerator.autocast():
            report = check_model_packs_correctly(
                model, mode=cfg.mode, token_budget=max(budget, 4),
                max_sequence_length=None if longest is None else min(longest, budget),
            )
        _POSITION_START[trainer] = report.position_ids_start
        line += ", guard passed"
        if report.position_ids_start:
            line += f" (positions start at {report.position_ids_start}, as the model's own)"
    return line


def _split_stateful_layers(model) -> str:
    """The decoder-layer children that carry a recurrent state or a convolution window across a packed boundary
    (measured on a probe row, :func:`hf_gradfix.packing.state_reset.find_sequence_mixers`) run once per document
    (:func:`~hf_gradfix.packing.state_reset.split_documents`), or once per layer with the boundaries handed to the
    kernels where those measurably keep the documents apart. Returns what was done, in words ("" when nothing
    carries state)."""
    from ...packing.state_reset import describe, probe_sequence_mixers, split_documents

    mixers = probe_sequence_mixers(model)
    if mixers is None:  # a model that cannot run a packed row: the guard refuses it in one line
        logger.debug("hf_gradfix packing: the state probe could not run a packed row; the guard decides")
        return ""
    if not mixers:
        return ""
    split_documents(model, mixers)
    what = describe(mixers)
    logger.info("hf_gradfix packing: %s carry state across packed documents; %s",
                ", ".join(m.label for m in mixers), what)
    return what


def _prepare_model_for_cp_packing(trainer, cfg: PackingConfig, cp: int, attention: str | None) -> str:
    """Context parallelism over packed rows: the model keeps sdpa (every attention call becomes the document-masked
    all-gather attention of :mod:`hf_gradfix.parallel.context_packing`); the guard probes that path."""
    from ...packing.guard import check_model_packs_under_cp
    from ...config.resolve import describe_balance
    from ..state import state_of

    plan = state_of(trainer).nd
    how = describe_balance(plan.cp_balance, plan.cp_balance_threshold, cp)
    line = (f"packing: {cfg.mode} mode, rows of <= {cfg.token_budget} tokens, split over {cp} context-parallel ranks "
            f"({how}, document mask built on the full row, keys/values all-gathered)")
    if not cfg.guard:
        logger.warning(
            "hf_gradfix packing: packing.guard is false, so the model is not checked for taking the document mask on "
            "the context-parallel path; a model that does not trains on wrong gradients with no error."
        )
        return line + ", guard off"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []), \
            trainer.accelerator.autocast():
        check_model_packs_under_cp(trainer.model, cp, balance=plan.cp_balance)
    return line + ", guard passed (context-parallel layout)"


class _OneBin:
    """``collate_fn`` for a DataLoader over :class:`StreamingPacker` with ``batch_size=1``: the batch is one bin."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, batch):
        if batch[0] is _SKIPPED:  # a row the Trainer's resume skips without training on it
            return {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
        return self.collator(batch[0])


_SKIPPED: list = []  # the placeholder row (identity-compared)

# The stream each packing trainer reads (for its checkpoints), per trainer.
_STREAMS: "weakref.WeakKeyDictionary[Any, _TrainerStream]" = weakref.WeakKeyDictionary()

STREAM_STATE_FILE = "hf_gradfix_stream_rank{rank}.pt"


class _TrainerStream(torch.utils.data.IterableDataset):
    """The :class:`StreamingPacker` as the Trainer's loader reads it. After a resume from a checkpoint that holds the
    packer's state, it first yields ``placeholders`` placeholder rows, which the Trainer's own skip of the trained
    batches (accelerate ``skip_first_batches``) discards unseen, then the packer continues from the saved state: the
    stream is not re-read and no row is skipped twice. (Placeholders rather than switching the Trainer's skip off
    keep its step counting and RNG restore exactly as stock.)"""

    def __init__(self, packer, trainer=None) -> None:
        super().__init__()
        self.packer = packer
        self.placeholders = 0
        # Passes over the stream: transformers counts every step of a dataset without length as epoch 0..., one
        # per pass; a resume in pass p > 0 continues that pass (its stream epoch) and the ones after it.
        self.pass_index = -1  # the pass being read (0 = the first)
        self.pass_start_step = 0  # the optimizer steps trained before this pass began
        self.epoch_offset = 0  # the stream's epoch = the Trainer's epoch + this (after a resume in a later pass)
        self._resumed_pass: tuple[int, int] | None = None
        self._trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)

    def set_epoch(self, epoch: int) -> None:
        self.packer.set_epoch(epoch + self.epoch_offset)

    def __iter__(self):
        n, self.placeholders = self.placeholders, 0
        trainer = self._trainer()
        if self._resumed_pass is not None:
            (self.pass_index, self.pass_start_step), self._resumed_pass = self._resumed_pass, None
        else:
            self.pass_index += 1
            self.pass_start_step = trainer.state.global_step if trainer is not None else 0
        for _ in range(n):
            yield _SKIPPED
        yield from self.packer


def _rows_trained(trainer, global_step: int) -> int:
    """Global packed rows the Trainer has trained on after ``global_step`` optimizer steps of a stream (its own resume
    arithmetic: a dataset without length has ``max_steps`` update steps per epoch, each of ``gradient_accumulation_steps``
    batches of one row per data-parallel rank)."""

    dims = _nd_dims(trainer)
    world = dims.dp if dims is not None else trainer.accelerator.num_processes
    return int(global_step) * trainer.args.gradient_accumulation_steps * world


def _to_saveable(value: Any) -> Any:
    """Sample values as ``torch.load(weights_only=True)`` reads them back (numpy becomes tensors / Python scalars)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _to_saveable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_saveable(v) for v in value]
    return value


def save_stream_state(trainer, checkpoint_dir: str) -> None:
    """Store the packer's state at the rows trained so far in the checkpoint folder (one file per process).
    Called when the Trainer saves its per-process RNG state."""
    import os

    stream = _STREAMS.get(trainer)
    if stream is None:
        return
    # the rows trained in the current pass: its windows are all whole but the last, which ends the pass
    rows = _rows_trained(trainer, trainer.state.global_step - stream.pass_start_step)
    if stream.pass_index >= 0 and rows > stream.packer._rows:
        # more rows than the pass had: its last (shorter) window was just stepped; the next pass starts afresh
        state = {"next_pass": True, "pass_index": stream.pass_index + 1, "pass_start_step": trainer.state.global_step}
    else:
        try:
            state = stream.packer.state_dict(rows=rows)
        except ValueError as exc:
            logger.warning("hf_gradfix packing: the stream position is not saved in this checkpoint (%s); a resume "
                           "re-reads the stream and skips the trained rows.", exc)
            return
        state.update(pass_index=max(stream.pass_index, 0), pass_start_step=stream.pass_start_step)
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STREAM_STATE_FILE.format(rank=trainer.args.process_index))
    torch.save(_to_saveable(state), path)


def load_stream_state(trainer, checkpoint_dir: str | None) -> None:
    """On resume: load this process's packer state from the checkpoint, and yield the placeholders the Trainer will
    skip. Without a state file (an older checkpoint), or with ``ignore_data_skip``, nothing changes (stock)."""
    import json
    import os

    stream = _STREAMS.get(trainer)
    if stream is None or checkpoint_dir is None or trainer.args.ignore_data_skip:
        return
    path = os.path.join(checkpoint_dir, STREAM_STATE_FILE.format(rank=trainer.args.process_index))
    state_json = os.path.join(checkpoint_dir, "trainer_state.json")
    if not os.path.isfile(path) or not os.path.isfile(state_json):
        return
    with open(state_json) as f:
        global_step = int(json.load(f)["global_step"])
    try:
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"a {type(state).__name__}, not the packer's state")
    except Exception as exc:  # noqa: BLE001 - truncated / corrupted: the same fallback as a missing file
        logger.warning("hf_gradfix packing: cannot read the stream state %s (%s: %s); re-reading the stream and "
                       "skipping the trained rows instead.", path, type(exc).__name__, str(exc).splitlines()[0][:200]
                       if str(exc) else "")
        return
    pass_index, pass_start = int(state.pop("pass_index", 0)), int(state.pop("pass_start_step", 0))
    rows = _rows_trained(trainer, global_step - pass_start)
    # the Trainer skips (global_step % max_steps) * GA batches per process; every one must be a placeholder
    skipped = _rows_trained(trainer, global_step % max(trainer.args.max_steps, 1))
    if skipped != _rows_trained(trainer, global_step) or (not state.get("next_pass") and state.get("rows") != rows):
        logger.warning("hf_gradfix packing: the stream state in %s is for %s rows, the Trainer resumes after %d "
                       "(skipping %d); re-reading the stream instead.", path, state.get("rows"), rows, skipped)
        return
    if state.get("next_pass"):
        # the checkpoint ends a pass: the Trainer's skipped batches are all placeholders, then the next pass
        # of the stream (its own epoch) starts from the beginning
        stream.placeholders = skipped
    else:
        stream.packer.load_state_dict(state)
        stream.placeholders = skipped
    stream.epoch_offset = pass_index
    stream._resumed_pass = (pass_index, pass_start)


def _streaming_train_dataloader(trainer, cfg: PackingConfig, budget: int):
    """Online packing of an IterableDataset: every process packs the same global row sequence and accelerate's
    ``IterableDatasetShard`` deals row ``i`` to process ``i % world`` (batches are never dispatched from rank 0:
    packed rows of different lengths cannot be concatenated)."""
    from ...packing.collator import PackedCollator
    from ...packing.stream import StreamingPacker

    if cfg.buffer_size < 2:
        raise ConfigError(
            f"hf_gradfix.packing.buffer_size: invalid value {cfg.buffer_size!r}; it must be at least 2 samples packed "
            "together, e.g. 1000 (larger fills rows better and holds more samples in memory)."
        )
    dims = _nd_dims(trainer)
    world = dims.dp if dims is not None else trainer.accelerator.num_processes
    vocab, label_vocab = _vocab_sizes(trainer.model)
    from .multimodal import processed_dataset, vlm_collator

    packer = StreamingPacker(
        processed_dataset(trainer, trainer.train_dataset), budget, buffer_size=cfg.buffer_size, num_replicas=world, rank="all",
        vocab_size=vocab, label_vocab_size=label_vocab,
    )
    config = getattr(trainer.model, "config", None)
    pad_id = getattr(config, "pad_token_id", None)
    collator = vlm_collator(trainer, cfg, budget) or PackedCollator(
        cfg.mode, max_tokens=budget, pad_token_id=0 if pad_id is None else int(pad_id),
        position_ids_start=_POSITION_START.get(trainer, 0),
    )
    if trainer.args.dataloader_num_workers:
        logger.warning(
            "hf_gradfix packing: a stream is packed in the main process (dataloader_num_workers=%d would give every "
            "worker the whole stream); using 0 workers.", trainer.args.dataloader_num_workers,
        )
    stream = _TrainerStream(packer, trainer)
    _STREAMS[trainer] = stream
    loader = DataLoader(stream, batch_size=1, collate_fn=_OneBin(collator), num_workers=0,
                        pin_memory=trainer.args.dataloader_pin_memory)
    logger.info(
        "hf_gradfix packing: streaming, buffer of %d samples packed best-fit-decreasing into rows of <= %d tokens "
        "(%s mode), rows dealt to %d data-parallel rank(s)", cfg.buffer_size, budget, cfg.mode, world,
    )
    dl_config = trainer.accelerator.dataloader_config
    saved = dl_config.dispatch_batches
    dl_config.dispatch_batches = False
    try:
        return trainer.accelerator.prepare(loader)
    finally:
        dl_config.dispatch_batches = saved
