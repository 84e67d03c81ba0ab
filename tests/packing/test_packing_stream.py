"""Streaming packing: torch and ``datasets`` IterableDatasets packed online in a bounded buffer, rows dealt evenly to
ranks, exact resume, and the Trainer end to end (exact against the unpacked ground truth, and resumed = straight)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
import transformers
from transformers import Trainer

import harness as H
from multiproc import run_launch, torchrun, worker_env
import hf_gradfix
from hf_gradfix.packing.collator import PackedBatchError
from hf_gradfix.packing.stream import StreamingPacker
from test_exactness import GRAD_TOL, LOSS_TOL

BUDGET = 64


class TorchStream(torch.utils.data.IterableDataset):
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        for s in self.samples:
            yield {"input_ids": list(s["input_ids"]), "labels": list(s["labels"])}


def _samples(n, seed=0, hi=60):
    return H.make_samples("causal", n=n, seed=seed, lo=2, hi=hi, prompt_mask_frac=0.3)


def _streams(samples):
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
    return {
        "torch": TorchStream(samples),
        "datasets_streaming": datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3),
    }


def _key(sample):
    return tuple(sample["input_ids"])


@pytest.mark.parametrize("kind", ["torch", "datasets_streaming"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("buffer_size", [4, 16, 1000])
def test_every_sample_once_rows_within_budget_and_equal_rows_per_rank(kind, world, buffer_size):
    samples = _samples(50, seed=world + buffer_size)
    stream = _streams(samples)[kind]
    per_rank = [list(StreamingPacker(stream, BUDGET, buffer_size=buffer_size, num_replicas=world, rank=r)) for r in range(world)]
    assert len({len(rows) for rows in per_rank}) == 1  # every rank the same number of rows: nobody waits
    seen = sorted(_key(s) for rows in per_rank for row in rows for s in row)
    assert seen == sorted(_key(s) for s in samples)  # every sample exactly once, over all ranks
    assert all(sum(len(s["input_ids"]) for s in row) <= BUDGET for rows in per_rank for row in rows)
    everything = list(StreamingPacker(stream, BUDGET, buffer_size=buffer_size, num_replicas=world, rank="all"))
    assert [everything[i::world] for i in range(world)] == per_rank  # "all" interleaves the ranks' rows


@pytest.mark.parametrize("kind", ["torch", "datasets_streaming"])
@pytest.mark.parametrize("stop", [0, 1, 5, 11])
def test_resume_from_state_yields_exactly_the_remaining_rows(kind, stop):
    samples = _samples(60, seed=stop)
    stream = _streams(samples)[kind]
    straight = list(StreamingPacker(stream, BUDGET, buffer_size=8, num_replicas=2, rank=1))
    first = StreamingPacker(stream, BUDGET, buffer_size=8, num_replicas=2, rank=1)
    it = iter(first)
    head = [next(it) for _ in range(stop)]
    state = first.state_dict()
    assert len(state["buffer"]) + sum(len(r) for r in state["pending"]) <= 8  # bounded by the buffer
    resumed = StreamingPacker(stream, BUDGET, buffer_size=8, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    assert head + list(resumed) == straight
    with pytest.raises(ValueError, match="cannot resume: the state was saved with buffer_size=8"):
        StreamingPacker(stream, BUDGET, buffer_size=9).load_state_dict(state)


def test_bad_stream_rows_are_named_by_their_stream_index():
    rows = [{"input_ids": [5] * 4}, {"input_ids": [5] * 70}]
    with pytest.raises(PackedBatchError, match=r"^stream sample 1, column 'input_ids': has 70 tokens, more than packing.token_budget=64"):
        list(StreamingPacker(rows, BUDGET))
    with pytest.raises(PackedBatchError, match=r"^stream sample 0, column 'input_ids': is empty"):
        list(StreamingPacker([{"input_ids": []}], BUDGET))
    # with the model's vocabulary (as the Trainer passes it): ids, label lengths and padding are checked on read
    rows = [{"input_ids": [5] * 4}, {"input_ids": [5, 6], "labels": [5]}, {"input_ids": [5, 99]}]
    with pytest.raises(PackedBatchError, match=r"^stream sample 1, column 'labels': has 1 entries but input_ids has 2\. Fix: labels must be unshifted"):
        list(StreamingPacker(rows, BUDGET, vocab_size=50))
    with pytest.raises(PackedBatchError, match=r"^stream sample 1, column 'input_ids': token id 99 is outside the vocabulary \[0, 50\)"):
        list(StreamingPacker([rows[0], rows[2]], BUDGET, vocab_size=50))


def test_fill_grows_with_the_buffer():
    rng = np.random.default_rng(0)
    rows = [{"input_ids": [4] * int(n)} for n in np.clip(rng.lognormal(np.log(12), 0.8, 2000), 1, BUDGET).astype(int)]
    tokens = sum(len(r["input_ids"]) for r in rows)
    fills = {}
    for size in (2, 16, 256):
        n_rows = sum(1 for _ in StreamingPacker(rows, BUDGET, buffer_size=size))
        fills[size] = tokens / (n_rows * BUDGET)
    assert fills[2] < fills[16] < fills[256] and fills[256] > 0.97, fills


# ---------------------------------------------------------------------------------------------- Trainer
def _args(out, **kw):
    base = dict(
        output_dir=str(out), optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=2,
        per_device_train_batch_size=1, max_steps=4, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=3, remove_unused_columns=False,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


@pytest.mark.parametrize("kind", ["torch", "datasets_streaming"])
def test_streamed_packed_training_is_exact_against_the_unpacked_ground_truth(kind, tmp_path):
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)[kind]
    model = H.build_model("llama", attn_implementation="sdpa")
    capture = H.GradCapture()
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=stream, callbacks=[capture])
        init = {k: v.clone() for k, v in model.state_dict().items()}
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    model.load_state_dict(init)
    rows = list(StreamingPacker(stream, BUDGET, buffer_size=16))
    windows = [rows[k : k + 2] for k in range(0, 8, 2)]
    assert len(capture.grads) == 4
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for k, (window, g) in enumerate(zip(windows, capture.grads)):
        gt_loss, gt = H.ground_truth(model, [s for row in window for s in row], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"step {k}: {H.rel_err(g, gt):.3e}"
        assert abs(logged[k] - gt_loss) / gt_loss <= LOSS_TOL


class _RecordingTrainer(Trainer):
    """Records the input_ids of every micro-batch it trains on."""

    def training_step(self, model, inputs, *args, **kwargs):
        self.seen.append(inputs["input_ids"].clone())
        return super().training_step(model, inputs, *args, **kwargs)


@pytest.mark.parametrize("source", ["from_generator", "to_iterable_dataset"])
def test_streamed_training_resumed_from_a_checkpoint_continues_with_the_same_rows(source, tmp_path):
    """Interrupted at a checkpoint (save_steps) and resumed: the checkpoint holds the packer's state (stream position,
    buffer, pending rows); the resumed run starts the packer there (not by re-packing the stream and skipping), trains
    on exactly the rows the uninterrupted run trained on after that step, and ends with bit-equal weights."""
    from hf_gradfix.integration.packing.trainer import _STREAMS

    samples = _samples(60, seed=2, hi=40)
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
    if source == "from_generator":
        stream = datasets.IterableDataset.from_generator(lambda: (dict(r) for r in rows))
    else:
        stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3)

    def train(out, max_steps, resume=None):
        model = H.build_model("llama", attn_implementation="sdpa")
        args = _args(out, learning_rate=0.5, lr_scheduler_type="constant", max_steps=max_steps, save_strategy="steps",
                     save_steps=3)
        trainer = _RecordingTrainer(model=model, args=args, train_dataset=stream)
        trainer.seen = []
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 8}})
    try:
        straight = train(tmp_path / "a", 7)
        train(tmp_path / "b", 3)
        checkpoint = tmp_path / "b" / "checkpoint-3"
        state = torch.load(checkpoint / "hf_gradfix_stream_rank0.pt", weights_only=True)
        resumed = train(tmp_path / "b", 7, resume=str(checkpoint))
    finally:
        hf_gradfix.unpatch()
    assert state["rows"] == 3 * 2 and state["read"] < len(samples)  # 3 steps x GA 2 rows, mid-stream
    # the resumed packer began at the saved state: it did not pack the stream's first rows again
    first_rows, first_read = _STREAMS[resumed].packer._history[0][:2]
    assert (first_rows, first_read) == (state["rows"], state["read"])
    assert len(straight.seen) == 14 and len(resumed.seen) == 8
    for k, (a, b) in enumerate(zip(straight.seen[6:], resumed.seen)):
        assert torch.equal(a, b), f"micro-batch {k + 6} differs"
    moved = H.build_model("llama", attn_implementation="sdpa").state_dict()
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert any(not torch.equal(v, moved[k]) for k, v in straight.model.state_dict().items())


@pytest.mark.distributed
def test_streamed_packed_training_under_ddp_is_exact(tmp_path):
    """2 processes (gloo): each gets its own rows of the one global row sequence, equal in number; every step's
    all-reduced gradient equals the ground truth over the rows BOTH ranks trained in that window."""

    import ddp_packing_worker as W

    proc = run_launch(torchrun(H.TESTS_DIR / "ddp_packing_worker.py", tmp_path, "stream"), env=worker_env(), step="ddp_packing_worker.py launch")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    rows = list(StreamingPacker(W.stream(), W.BUDGET, buffer_size=W.STREAM_BUFFER, num_replicas=2, rank="all"))
    per_window = W.GA * 2
    assert len(rows) >= per_window * W.STREAM_STEPS
    model = H.build_model("llama", attn_implementation="sdpa")
    model.load_state_dict(ranks[0]["init"])
    assert len(ranks[0]["grads"]) == len(ranks[1]["grads"]) == W.STREAM_STEPS
    for k in range(W.STREAM_STEPS):
        window = [s for row in rows[k * per_window : (k + 1) * per_window] for s in row]
        gt_loss, gt = H.ground_truth(model, window, "causal")
        for r in (0, 1):
            assert H.rel_err(ranks[r]["grads"][k], gt) <= GRAD_TOL, f"rank {r} step {k}: {H.rel_err(ranks[r]['grads'][k], gt):.3e}"
        assert abs(ranks[0]["logged"][k] - gt_loss) / gt_loss <= LOSS_TOL


# ------------------------------------------------------------------ lifecycle: the end of a stream inside a window
def _epoch_windows(stream, ga, epochs, buffer_size=16, world=1):
    """The optimizer windows of a whole run over a finite stream, pass by pass (each pass as ``set_epoch`` makes it):
    ``ga * world`` rows each, the last window of a pass shorter (what a map-style epoch does)."""
    packer = StreamingPacker(stream, BUDGET, buffer_size=buffer_size, num_replicas=world)
    windows = []
    for epoch in range(epochs):
        packer.set_epoch(epoch)
        rows = list(packer)
        windows += [rows[k : k + ga * world] for k in range(0, len(rows), ga * world)]
    return windows


def _check_run(model, init, windows, grads, logged):
    model.load_state_dict(init)
    assert len(grads) == len(windows), (len(grads), len(windows))
    errors = []
    for k, (window, g) in enumerate(zip(windows, grads)):
        gt_loss, gt = H.ground_truth(model, [s for row in window for s in row], "causal")
        errors.append(H.rel_err(g, gt))
        assert errors[-1] <= GRAD_TOL, f"step {k} ({len(window)} rows): {errors[-1]:.3e}"
        assert abs(logged[k] - gt_loss) / gt_loss <= LOSS_TOL, f"step {k}: logged {logged[k]} vs {gt_loss}"
    return errors


@pytest.mark.parametrize("kind,ga", [("torch", 3), ("datasets_streaming", 4)])
def test_stream_ending_inside_a_window_steps_that_window_in_its_epoch(kind, ga, tmp_path, caplog):
    """14 packed rows per pass, GA 3 / 4: the last window of every pass holds 2 rows. It is stepped in its pass,
    normalized by its own target count (before: its gradient went into the next pass's first step, error 0.65-2.1,
    logged loss 2x), over three passes; the empty windows after the end log nothing about missing labels."""
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)[kind]
    windows = _epoch_windows(stream, ga, epochs=3)
    assert len(windows[-1]) < ga  # the last window of a pass is shorter than GA
    max_steps = len(windows) - 1  # ends one window before the end of the third pass
    model = H.build_model("llama", attn_implementation="sdpa")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    capture = H.GradCapture()
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=ga, max_steps=max_steps),
                          train_dataset=stream, callbacks=[capture])
        with caplog.at_level("INFO", logger="hf_gradfix"):
            trainer.train()
    finally:
        hf_gradfix.unpatch()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _check_run(model, init, windows[:max_steps], capture.grads, logged)
    assert trainer.state.global_step == max_steps
    assert "carry no 'labels'" not in caplog.text


def test_stream_end_is_stepped_with_the_loss_fix_off_too(tmp_path):
    """packing alone (loss.enabled: false, the Trainer's own count): the short last window is stepped in its pass."""
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)["torch"]
    windows = _epoch_windows(stream, 3, epochs=2)
    model = H.build_model("llama", attn_implementation="sdpa")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    capture = H.GradCapture()
    hf_gradfix.patch({"loss": {"enabled": False}, "packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=3, max_steps=len(windows)),
                          train_dataset=stream, callbacks=[capture])
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _check_run(model, init, windows, capture.grads, logged)


def test_plain_stream_without_packing_ending_inside_a_window_is_stepped(tmp_path):
    """The same edge without packing: an IterableDataset of padded micro-batches under the loss fix."""
    samples = _samples(10, seed=4, hi=30)
    stream = TorchStream(samples)
    model = H.build_model("llama", attn_implementation="sdpa")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    capture = H.GradCapture()
    hf_gradfix.patch()
    try:
        trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=4, max_steps=6),
                          train_dataset=stream, data_collator=H.RecordingCollator("causal").collate, callbacks=[capture])
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    # 10 samples, one per micro-batch, GA 4: windows of 4, 4, 2 per pass
    cut = [(0, 4), (4, 8), (8, 10)]
    windows = [[[samples[i] for i in range(a, b)]] for _ in range(2) for a, b in cut]
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _check_run(model, init, windows, capture.grads, logged)


def test_a_second_trainer_and_a_second_train_on_the_same_model_are_exact(tmp_path):
    """Lifecycle: train() twice on one Trainer, then a new Trainer on the same model and stream (lr 0, so the ground
    truth of every run is the same): each run steps every window of every pass exactly, the short last one too."""
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)["torch"]
    windows = _epoch_windows(stream, 3, epochs=2)
    model = H.build_model("llama", attn_implementation="sdpa")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        captures = []
        capture = H.GradCapture()
        first = Trainer(model=model, args=_args(tmp_path / "a", gradient_accumulation_steps=3, max_steps=len(windows)),
                        train_dataset=stream, callbacks=[capture])
        first.train()
        captures.append((capture, [h["loss"] for h in first.state.log_history if "loss" in h]))
        capture.grads = []
        first.train()
        captures.append((capture, [h["loss"] for h in first.state.log_history if "loss" in h]))
        capture = H.GradCapture()
        second = Trainer(model=model, args=_args(tmp_path / "b", gradient_accumulation_steps=3, max_steps=len(windows)),
                         train_dataset=stream, callbacks=[capture])
        second.train()
        captures.append((capture, [h["loss"] for h in second.state.log_history if "loss" in h]))
    finally:
        hf_gradfix.unpatch()
    for capture, logged in captures:
        _check_run(model, init, windows, capture.grads, logged[-len(windows):])


def test_resume_at_the_end_of_a_pass_continues_like_the_straight_run(tmp_path):
    """A checkpoint saved right after the short last window of the first pass; the resumed run trains the second pass
    as the uninterrupted run does (bit-equal weights, lr > 0)."""
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)["torch"]
    per_pass = len(_epoch_windows(stream, 3, epochs=1))

    def train(out, max_steps, resume=None):
        model = H.build_model("llama", attn_implementation="sdpa")
        args = _args(out, learning_rate=0.5, lr_scheduler_type="constant", gradient_accumulation_steps=3, max_steps=max_steps,
                     save_strategy="steps", save_steps=per_pass)
        trainer = _RecordingTrainer(model=model, args=args, train_dataset=stream)
        trainer.seen = []
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        straight = train(tmp_path / "a", 2 * per_pass)
        train(tmp_path / "b", per_pass)
        resumed = train(tmp_path / "b", 2 * per_pass, resume=str(tmp_path / "b" / f"checkpoint-{per_pass}"))
    finally:
        hf_gradfix.unpatch()
    half = len(straight.seen) // 2
    assert len(resumed.seen) == half
    for a, b in zip(straight.seen[half:], resumed.seen):
        assert torch.equal(a, b)
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


@pytest.mark.distributed
def test_stream_ending_inside_a_window_under_ddp_is_stepped_on_both_ranks(tmp_path):
    """2 processes, GA 3: the last window of each pass holds fewer rows than 3 per rank; both ranks step it in its
    pass with the all-reduced gradient of the rows both trained, normalized by their global target count."""

    import ddp_packing_worker as W

    proc = run_launch(torchrun(H.TESTS_DIR / "ddp_packing_worker.py", tmp_path, "stream_end"), env=worker_env(), step="ddp_packing_worker.py launch")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "carry no 'labels'" not in proc.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    windows = _epoch_windows(W.stream(), W.END_GA, epochs=2, buffer_size=W.STREAM_BUFFER, world=2)
    assert len(windows[-1]) < 2 * W.END_GA
    model = H.build_model("llama", attn_implementation="sdpa")
    for r in (0, 1):
        _check_run(model, ranks[0]["init"], windows, ranks[r]["grads"], ranks[0]["logged"])


@pytest.mark.parametrize("where", ["inside the second pass", "at the end of the second pass"])
def test_resume_in_a_later_pass_continues_that_pass_like_the_straight_run(where, tmp_path):
    """A ``datasets`` stream whose row order changes with the epoch (``set_epoch``), GA 4, 4 windows per pass (the
    last one 2 rows): a checkpoint in the second pass continues that pass from its saved position with the
    second pass's order, then the third pass follows; micro-batches and weights equal the straight run's (before:
    the stream was re-read from the start of the pass and its first windows trained twice)."""
    samples = _samples(40, seed=1, hi=40)
    stream = _streams(samples)["datasets_streaming"]
    per_pass = len(_epoch_windows(stream, 4, epochs=1))
    stop = per_pass + 2 if where == "inside the second pass" else 2 * per_pass

    def train(out, max_steps, resume=None):
        model = H.build_model("llama", attn_implementation="sdpa")
        args = _args(out, learning_rate=0.5, lr_scheduler_type="constant", gradient_accumulation_steps=4,
                     max_steps=max_steps, save_strategy="steps", save_steps=stop)
        trainer = _RecordingTrainer(model=model, args=args, train_dataset=stream)
        trainer.seen = []
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
    try:
        straight = train(tmp_path / "a", 2 * per_pass + 2)
        head = train(tmp_path / "b", stop)
        resumed = train(tmp_path / "b", 2 * per_pass + 2, resume=str(tmp_path / "b" / f"checkpoint-{stop}"))
    finally:
        hf_gradfix.unpatch()
    assert len(head.seen) + len(resumed.seen) == len(straight.seen)
    for k, (a, b) in enumerate(zip(straight.seen[len(head.seen):], resumed.seen)):
        assert torch.equal(a, b), f"micro-batch {k} after the resume differs"
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


@pytest.mark.parametrize("damage, needle", [
    (lambda s: s.pop("read"), "field 'read': missing"),
    (lambda s: s.update(read="12"), "field 'read': '12' is not a count >= 0"),
    (lambda s: s.update(buffer={"input_ids": [1]}), "field 'buffer': a dict, not a list"),
    (lambda s: s.update(pending=[[{"text": "x"}]]), "field 'pending': holds a row that is not a list of samples"),
    (lambda s: s.update(min_fill=None), "field 'min_fill': None is not a number"),
    (lambda s: s.update(version=99), "not a StreamingPacker state of version"),
])
def test_a_damaged_stream_state_is_one_line(damage, needle):
    """Issue 38: missing or garbage fields gave a KeyError / TypeError on resume."""
    from hf_gradfix.errors import InvalidArgumentError
    from hf_gradfix.packing.stream import StreamingPacker

    stream = [{"input_ids": [1] * n} for n in (3, 2, 4, 1, 2, 2)]
    a = StreamingPacker(stream, token_budget=4, buffer_size=2)
    next(iter(a))
    state = a.state_dict()
    damage(state)
    with pytest.raises(InvalidArgumentError) as err:
        StreamingPacker(stream, token_budget=4, buffer_size=2).load_state_dict(state)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
