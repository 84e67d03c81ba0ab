"""Memory timeline of one training step: the planner's trace (``plan --timeline``), a hand-written / TokenWindow loop
(``MemoryTimelineRecorder``) and a live Trainer (``MemoryTimelineCallback``).

Ground truths: torch's own tracker peak snapshot (kept by ``MemTracker`` independently of our sampling), and an
independent count of the live storages: the model's parameters and buffers, the optimizer's state, the gradients,
every tensor autograd saved for backward (a ``saved_tensors_hooks`` pack hook) and the tensors the loop holds,
deduplicated by storage."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os

import pytest
import torch
import transformers

import harness as H
from hf_gradfix.diagnostics.memory_timeline import CATEGORIES, MemoryTimeline, MemoryTimelineRecorder
from hf_gradfix.parallel import ParallelDims
from hf_gradfix.plan import Settings, load_model_config
from hf_gradfix.plan.command import plan_main


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _opt_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _assert_sums(tl: MemoryTimeline):
    for i, total in enumerate(tl.totals):
        assert sum(tl.series[c][i] for c in CATEGORIES) == total, (i, tl.labels[i])


# -- the planner's trace -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_kw", [dict(world_size=1), dict(world_size=2, dp_shard=2)])
def test_simulated_timeline_sums_and_peaks_where_the_tracker_says(mesh_kw):
    from hf_gradfix.plan.simulate import simulate

    sim = simulate(load_model_config("tiny-llama"), ParallelDims(**mesh_kw), Settings(seq_len=64, micro_batch=2,
                                                                                      dtype="fp32"))
    tl = sim["timeline"]
    _assert_sums(tl)
    # torch's tracker keeps its own peak snapshot (a deep copy at the instant the total rose): same total, same
    # split, same phase as our sample-by-sample record
    assert tl.peak == sim["peak"]
    assert {c: v for c, v in tl.at_peak.items() if v} == {c: v for c, v in sim["at_peak"].items() if v}
    assert tl.peak_phase == sim["phase"]
    # the step's shape: both layers forward then backward in reverse, then the optimizer; the state that
    # stays between steps is where it started
    order = [e["label"] for e in tl.events() if "layer" in e["label"] or e["label"] == "optimizer step"]
    assert order == ["forward layer 0", "forward layer 1", "backward layer 1", "backward layer 0", "optimizer step"]
    assert tl.totals[0] == tl.totals[-1] == sum(sim["after_step"].values())
    if mesh_kw["world_size"] > 1:
        assert tl.category_max()["comm_buffers"] > 0


@pytest.mark.parametrize("optimizer,grad_accum", [("adamw", 1), ("galore_adamw", 1), ("adamw", 3), ("sgd", 6)])
def test_simulated_step_equals_the_measured_step_per_category(optimizer, grad_accum):
    """The planner's fake-tensor step against the same step on real tensors, recorded by the recorder: each
    category's maximum over the step and the peak (a stale output of the previous step, for one, shows here).
    With gradient accumulation the measured step runs all its micro-batches (the later ones with the accumulated
    gradients alive: before, the trace ran one micro-batch and its peak was 10-17 % low)."""

    from transformers import AutoModelForCausalLM

    from hf_gradfix.optim import GaLoreAdamW
    from hf_gradfix.plan.simulate import simulate

    cfg = load_model_config("tiny-llama")
    s = Settings(seq_len=64, micro_batch=2, dtype="fp32", optimizer=optimizer, rank=8, grad_accum=grad_accum)
    pred = simulate(cfg, ParallelDims(1), s)["timeline"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").train()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-4) if optimizer == "sgd"
           else GaLoreAdamW(model, lr=1e-4, rank=8))
    rec = MemoryTimelineRecorder(model, opt)
    for step in range(2):
        batches = [torch.randint(0, cfg.vocab_size, (2, 64)) for _ in range(grad_accum)]
        with rec.step() if step else contextlib.nullcontext():
            for ids in batches:  # the loss only, as Trainer.compute_loss returns it (the output is dropped)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad()
    meas = rec.last
    for c, v in meas.category_max().items():
        assert pred.category_max()[c] == pytest.approx(v, rel=1e-3, abs=64), c
    assert pred.peak == pytest.approx(meas.peak, rel=1e-3) and pred.peak_label == meas.peak_label
    from hf_gradfix.plan.simulate import TRACED_MICRO_BATCHES

    assert meas.micro_batch_count == grad_accum
    assert pred.micro_batch_count == min(grad_accum, TRACED_MICRO_BATCHES) and pred.meta["grad_accum"] == grad_accum
    if grad_accum > 1:  # the peak is in a later micro-batch, with every gradient alive
        assert pred.peak_micro_batch > 1 and meas.peak_micro_batch > 1
        assert pred.at_peak["gradients"] == sum(p.numel() * 4 for p in model.parameters())


def _fsdp2_worker(rank: int, world: int, path: str, port: int) -> None:
    import os
    import pickle

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from hf_gradfix.plan.activations import decoder_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_model_config("tiny-llama")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").train()
        mesh = init_device_mesh("cpu", (world,))
        for _, layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = MemoryTimelineRecorder(model, opt)
        for micro_batches in (1, 1, 2):  # the second step as the planner traces it, then gradient accumulation
            batches = [torch.randint(0, cfg.vocab_size, (2, 64)) for _ in range(micro_batches)]  # made outside
            with rec.step():                                                                    # as the trace's
                for ids in batches:
                    out = model(input_ids=ids, labels=ids)
                    out.loss.backward()
                    del out
                opt.step()
                opt.zero_grad()
        if rank == 0:
            with open(path, "wb") as f:
                pickle.dump(rec.timelines[1:], f)
    except BaseException:
        dist.destroy_process_group()
        raise
    from multiproc import finish_distributed

    finish_distributed()  # no Python teardown: the gloo exit race of tests/support/multiproc.py


def _tiny_llama_layer():
    import transformers

    return transformers.AutoModelForCausalLM.from_config(load_model_config("tiny-llama")).model.layers[0]


def test_recorder_on_fsdp2_equals_the_trace(tmp_path):
    """Two gloo processes, FSDP2 per layer + root: rank 0's measured step equals the planner's trace of the same
    mesh in every category (all-gather / reduce-scatter buffers included); a step with two micro-batches records
    (torch's FSDPMemTracker alone refuses a second forward)."""
    import pickle

    import torch.multiprocessing as mp

    from hf_gradfix.plan.simulate import simulate

    path = str(tmp_path / "timelines.pkl")
    mp.spawn(_fsdp2_worker, args=(2, path, H._free_port()), nprocs=2)
    with open(path, "rb") as f:
        steady, accumulated = pickle.load(f)
    pred = simulate(load_model_config("tiny-llama"), ParallelDims(2, dp_shard=2),
                    Settings(seq_len=64, micro_batch=2, dtype="fp32", optimizer="sgd"))["timeline"]
    measured, traced = steady.category_max(), pred.category_max()
    assert measured["comm_buffers"] > 0
    # Thread timing (below) can also keep a temporary of the asynchronous reduce-scatter alive across one sample:
    # seen once on 4.57.6, temporaries +96,000 B, every other category equal. The bound: one layer's unsharded
    # gradient (what a reduce-scatter consumes), far below a miscount of a category.
    layer_grad = 4 * sum(p.numel() for p in _tiny_llama_layer().parameters())
    assert traced["temporaries"] <= measured["temporaries"] <= traced["temporaries"] + layer_grad, (measured, traced)
    assert {k: v for k, v in measured.items() if k != "temporaries"} == \
        {k: v for k, v in traced.items() if k != "temporaries"}
    # The peak itself depends on thread timing: gloo completes FSDP2's async reduce-scatter on a background thread,
    # and in about 1 run in 6 a layer's reduce-scatter buffers are still alive when the next layer's backward
    # samples (measured: 4.57.6 +54,784 B; CI on 5.x +197,632 B, +3 %; every category maximum equal). The trace is
    # the lower bound; the bound above it is one reduce-scatter's worth of overlap, the layer's unsharded gradient
    # (726,016 B here), as for the temporaries above.
    assert pred.peak <= steady.peak <= pred.peak + layer_grad, (steady.peak, pred.peak, layer_grad)
    _assert_sums(accumulated)
    assert [e["label"] for e in accumulated.events()].count("backward layer 0") == 2


def test_cli_timeline_png_and_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = {}
    for ga in (1, 3):
        png = tmp_path / f"timeline{ga}.png"
        assert plan_main(["--model", "tiny-llama", "--seq-len", "64", "--micro-batch", "2", "--dtype", "fp32",
                          "--grad-accum", str(ga), "--timeline", str(png), "--json"]) == 0
        out[ga] = json.loads(capsys.readouterr().out)
        tl = out[ga]["simulated"]["timeline"]
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
        assert tl["peak"] == out[ga]["simulated"]["peak"]
        for ev in tl["events"]:  # every event's split sums to its total
            assert sum(ev["max"].values()) == ev["max_total"]
        # gradient accumulation: one forward and backward per micro-batch, each event tagged with its micro-batch
        assert tl["micro_batches"] == ga
        assert [ev["micro_batch"] for ev in tl["events"] if ev["label"] == "backward layer 0"] == list(range(1, ga + 1))
    # micro-batches 2.. run with the accumulated gradients alive: the peak rises by (up to) the gradients' size
    one, three = out[1]["simulated"], out[3]["simulated"]
    assert three["timeline"]["peak_micro_batch"] > 1 and three["at_peak"]["gradients"] > one["at_peak"]["gradients"]
    assert three["peak"] > one["peak"]


# -- measured: a TokenWindow loop ------------------------------------------------------------------------------------

def test_recorder_equals_an_independent_count_of_live_storages():
    from hf_gradfix import TokenWindow

    model = H.build_model("llama", attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(4, H.VOCAB, (2, 24), generator=g)), "labels": ids.clone()}
               for _ in range(6)]
    rec = MemoryTimelineRecorder(model, opt)
    checks = []
    for window in TokenWindow(None, batches, grad_accum_steps=2, model=model):
        with rec.step():
            for m, (batch, micro) in enumerate(window):
                batch = {k: v.clone() for k, v in batch.items()}  # made inside the recorded step
                # the window's loss statistics were made before the step began: the tracker counts them from
                # the first op that writes them (the first micro-batch's loss), as it does any outside tensor
                held = [v for v in vars(window).values() if torch.is_tensor(v)] if m else []
                saved: list[torch.Tensor] = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    out = model(**batch)
                rec.mark("after forward", "forward")
                live = _storage_bytes([*model.parameters(), *model.buffers(), *_opt_tensors(opt), *saved,
                                       *(p.grad for p in model.parameters()), *batch.values(), out.loss, out.logits,
                                       *held])
                checks.append((rec._tracker._tl_totals[-1], live))
                del saved, held
                micro.model_loss(out.loss).backward()
                del out, batch, micro
            opt.step()
            opt.zero_grad()
        tl = rec.last
        _assert_sums(tl)
        # after the step: the weights, the optimizer state and what the window holds (its loss statistics)
        end = tl.at(len(tl.totals) - 1)
        assert end["parameters"] == _storage_bytes([*model.parameters(), *model.buffers()])
        assert end["optimizer_state"] == _storage_bytes(_opt_tensors(opt)) > 0
        held = [v for v in vars(window).values() if torch.is_tensor(v)]
        assert tl.totals[-1] == _storage_bytes([*model.parameters(), *model.buffers(), *_opt_tensors(opt), *held])
    assert len(rec.timelines) == 3 and len(checks) == 6
    for recorded, live in checks:  # right after each forward: everything alive, counted independently
        assert recorded == live
    tl = rec.timelines[1]
    assert tl.peak == max(tl.totals) and tl.peak_phase == "backward"
    assert [e["label"] for e in tl.events()].count("forward layer 1") == 2  # two micro-batches per step


# -- measured: a Trainer run -----------------------------------------------------------------------------------------

def _offline_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(H.VOCAB)}, unk_token="3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    from hf_gradfix import MemoryTimelineCallback

    tmp = tmp_path_factory.mktemp("memtl")
    tk = _offline_tokenizer()
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(str(int(t)) for t in torch.randint(4, H.VOCAB, (40,), generator=g)) for _ in range(12)]
    ds = datasets.Dataset.from_dict({"text": texts}).map(lambda b: tk(b["text"]), batched=True, remove_columns=["text"])
    model = H.build_model("llama", attn_implementation="sdpa")
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    cb = MemoryTimelineCallback(steps=(2,), plot_path=tmp / "measured.png" if has_mpl else None, predict=True)
    args = transformers.TrainingArguments(str(tmp / "out"), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2,
                                          max_steps=3, logging_steps=1, report_to="none", save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb],
                                   data_collator=transformers.DataCollatorForLanguageModeling(tk, mlm=False))
    trainer.train()
    return trainer, cb, tmp


def test_callback_logs_the_recorded_step_and_counts_what_is_live(trainer_run):
    trainer, cb, tmp = trainer_run
    assert [tl.step for tl in cb.timelines] == [2]
    tl = cb.timelines[0]
    _assert_sums(tl)
    logged = [h for h in trainer.state.log_history if "memory/peak_MiB" in h]
    assert len(logged) == 1 and logged[0]["memory/step"] == 2 and logged[0]["step"] == 2
    assert logged[0]["memory/peak_MiB"] == round(max(tl.totals) / 2**20, 4)
    for c, v in tl.at_peak.items():
        if v:
            assert logged[0][f"memory/peak_{c}_MiB"] == round(v / 2**20, 4)
    # after the step: the model's weights and the optimizer's state, counted from the objects themselves
    model, opt = trainer.model, trainer.optimizer.optimizer
    end = tl.at(len(tl.totals) - 1)
    assert end["parameters"] == _storage_bytes([*model.parameters(), *model.buffers()])
    assert end["optimizer_state"] == _storage_bytes(_opt_tensors(opt)) > 0
    assert end["gradients"] == 0
    # at the optimizer step: one gradient per parameter (during accumulation a new gradient and the running sum
    # briefly coexist, so the category's maximum is higher)
    first_opt = next(e["first"] for e in tl.events() if e["label"] == "optimizer step")
    assert tl.at(first_opt)["gradients"] == _storage_bytes([*model.parameters()])
    assert tl.peak_phase == "backward"
    if cb.plot_path is not None:
        assert (tmp / "measured.png").stat().st_size > 10_000


def test_callback_puts_the_prediction_beside_it(trainer_run):
    _, cb, _ = trainer_run
    pred, meas = cb.predicted, cb.timelines[0]
    assert pred is not None and pred.source == "fake-tensor trace"
    # the same model state: weights and AdamW state after the step, byte for byte
    assert pred.at(len(pred.totals) - 1)["parameters"] == meas.at(len(meas.totals) - 1)["parameters"]
    assert pred.at(len(pred.totals) - 1)["optimizer_state"] == meas.at(len(meas.totals) - 1)["optimizer_state"]
    # the whole peak within 5 % (the trace runs the step's micro-batches at the largest padded shape; the measured
    # ones vary in length): before, one micro-batch was traced, 10 % low at GA 2
    assert abs(pred.peak / meas.peak - 1) < 0.05
    assert pred.micro_batch_count == meas.micro_batch_count == 2


def _trainer_with_timeline(tmp, ga: int, *, plot: bool = False, steps=(2,), max_steps: int = 2, lengths=(24, 24)):
    datasets = pytest.importorskip("datasets")
    from hf_gradfix import MemoryTimelineCallback

    tk = _offline_tokenizer()
    g = torch.Generator().manual_seed(ga)
    texts = [" ".join(str(int(t)) for t in torch.randint(4, H.VOCAB, (int(n),), generator=g))
             for n in torch.randint(lengths[0], lengths[1] + 1, (2 * ga * max_steps,), generator=g)]
    ds = datasets.Dataset.from_dict({"text": texts}).map(lambda b: tk(b["text"]), batched=True, remove_columns=["text"])
    model = H.build_model("llama", attn_implementation="sdpa")
    cb = MemoryTimelineCallback(steps=steps, plot_path=tmp / f"ga{ga}.png" if plot else None, predict=True)
    args = transformers.TrainingArguments(str(tmp / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                                          max_steps=max_steps, logging_steps=1, report_to="none", save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb],
                                   data_collator=transformers.DataCollatorForLanguageModeling(tk, mlm=False))
    return trainer, cb


@pytest.mark.parametrize("ga", [1, 3, 8])
def test_callback_prediction_follows_gradient_accumulation(ga, tmp_path):
    """The predicted peak within 5 % of the measured one at GA 1, 3, 8 (GA 2: the module's Trainer run; before:
    -1 %, -10 %, -18 %); the picture names each micro-batch. (Micro-batches of varying length are predicted at the
    largest: above the measured peak, by 7 % here with lengths 16-40.)"""
    trainer, cb = _trainer_with_timeline(tmp_path, ga, plot=ga == 3 and importlib.util.find_spec("matplotlib") is not None)
    trainer.train()
    pred, meas = cb.predicted, cb.timelines[0]
    assert abs(pred.peak / meas.peak - 1) < 0.05, (pred.peak, meas.peak)
    assert meas.micro_batch_count == ga and pred.meta["grad_accum"] == ga
    if ga > 1:  # the later micro-batches hold the accumulated gradients: the peak is in one of them
        assert meas.peak_micro_batch > 1 and meas.at_peak["gradients"] > 0 and pred.at_peak["gradients"] > 0
    if cb.plot_path is not None:
        assert (tmp_path / "ga3.png").stat().st_size > 10_000


def test_callback_prediction_of_micro_batches_of_varying_length(tmp_path):
    """Predicted at the largest micro-batch throughout, as unpadded rows: near the measured peak. Since issue 53
    neither the prediction nor the Trainer's step holds the logits through backward (the equal-length runs of
    test_callback_prediction_follows_gradient_accumulation match within 5 %); the padded micro-batches measured here
    hold 45 KB (4 %) more activations at the peak than that (1,137,816 B measured, 1,092,860 B predicted)."""
    trainer, cb = _trainer_with_timeline(tmp_path, 3, lengths=(16, 40))
    trainer.train()
    assert 0.95 <= cb.predicted.peak / cb.timelines[0].peak < 1.1


def test_callback_lifecycle_second_train_and_an_exception_inside_a_recorded_step(tmp_path):
    """A second train() records its step too (kept after the first run's; the log hook re-installed and removed),
    and an exception inside a recorded step leaves no memory tracker active: the next run records normally."""
    from hf_gradfix.torch_private import private

    modes = private("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack", feature="this test")
    trainer, cb = _trainer_with_timeline(tmp_path, 2, steps=(1,), max_steps=1)
    trainer.train()
    trainer.train()
    assert [tl.step for tl in cb.timelines] == [1, 1]
    assert "log" not in trainer.__dict__  # the callback's log wrapper is gone after each run
    assert [h["memory/step"] for h in trainer.state.log_history if "memory/step" in h] == [1]  # this run's log

    calls = {"n": 0}

    def boom(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # inside the recorded step, after its first micro-batch
            raise RuntimeError("boom")

    hook = trainer.model.register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
    finally:
        hook.remove()
    assert not modes() and not cb.recorder.recording  # no tracker left pushed: later ops run untracked
    trainer.train()
    assert not modes()
    assert [tl.step for tl in cb.timelines] == [1, 1, 1]
    assert cb.timelines[-1].micro_batch_count == 2
