"""hf-gradfix plan for TRL GRPO / RLOO runs (hf_gradfix/plan/rl.py): every term against a measurement on CPU.

Measured with real tensors: the bytes alive op by op (a dispatch mode that follows every storage until it dies,
weights excluded) and the bytes autograd saves (saved-tensor hooks, one count per storage)."""

import functools
import json

import pytest
import torch

from hf_gradfix.parallel import ParallelDims
from hf_gradfix.plan import PlanError, Settings, estimate, load_model_config
from hf_gradfix.plan.command import plan_main
from hf_gradfix.plan.rl import TOKEN_TILE, VOCAB_TILE, RLRun, fused_head_bytes, kv_cache_bytes

transformers = pytest.importorskip("transformers")


class _Live:
    """Bytes of the storages created inside, alive at each op (the most: ``peak``); ``skip``: storages not counted."""

    def __init__(self, skip=()):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        live, state = {}, {"peak": 0}
        skip = {StorageWeakRef(t.untyped_storage()) for t in skip}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        w = StorageWeakRef(t.untyped_storage())
                        if w not in skip and w not in live:
                            live[w] = t.untyped_storage().nbytes()
                for w in [w for w in live if w.expired()]:
                    del live[w]
                state["peak"] = max(state["peak"], sum(live.values()))
                return out

        self.mode, self.live, self.state = _Mode(), live, state

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    @property
    def now(self) -> int:
        return sum(b for w, b in self.live.items() if not w.expired())

    def reset_peak(self) -> int:
        self.state["peak"] = self.now
        return self.state["peak"]

    @property
    def peak(self) -> int:
        return self.state["peak"]


def _model(name, **kw):
    torch.manual_seed(0)
    cfg = load_model_config(name)
    for k, v in kw.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return cfg, model, list(model.parameters()) + list(model.buffers())


# ------------------------------------------------------------------------------------------ TRL's fused head
def _fused_head_measured(n, hidden, vocab, amp):
    """Forward and backward of TRL 1.16's ChunkedLogProbFunction on CPU: (forward peak, backward peak above what
    the forward left), the inputs not counted."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    torch.manual_seed(0)
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    t = torch.randint(0, vocab, (n,))
    amp_ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
    with _Live(skip=(h, w, t)) as live:
        with amp_ctx:
            logps, ent, *_ = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, VOCAB_TILE, None, 1.0,
                                                          ("log_probs", "entropy"))
        forward = live.peak
        before = live.reset_peak()
        logps.sum().backward()
        backward = live.peak - before
    return forward, backward


@pytest.mark.parametrize("n,amp", [(4100, False), (1000, False), (4100, True)])
def test_fused_head_tile_and_gradients_match_trl(n, amp):
    """The planner's fused head (tile min(N, 4096) x 32768 in the compute dtype, fp32 statistics, fp32 gradient
    accumulators, autocast's chunk copies) against TRL's own kernel. On CPU TRL runs its torch fallback, which adds
    temporaries the size of the tile's *used* part (positions x vocabulary) that the Triton kernel does not make:
    measured at two vocabulary sizes, the difference to the plan is proportional to the vocabulary and its
    intercept, what the plan counts wrong, is zero."""
    hidden, vocabs = 16, (256, 512)
    cb = 2 if amp else 4
    plan = {v: fused_head_bytes(n, hidden, v, hidden_bytes=4, weight_bytes=4, compute_bytes=cb) for v in vocabs}
    assert plan[256]["tile"] == min(n, TOKEN_TILE) * VOCAB_TILE * cb  # allocated 32768 wide for 256 columns
    measured = {v: _fused_head_measured(n, hidden, v, amp) for v in vocabs}
    rows = min(n, TOKEN_TILE)
    for i, key in enumerate(("forward", "backward")):
        diff = {v: measured[v][i] - plan[v][key] for v in vocabs}
        intercept = 2 * diff[256] - diff[512]
        per_element = (diff[512] - diff[256]) / (rows * 256)
        assert abs(intercept) < 2e-3 * plan[256]["tile"], (key, intercept, measured, plan)
        assert 0 <= per_element <= 48, (key, per_element)  # at most 12 fp32 temporaries of the fallback
        # control: the tile as "4096 positions x the vocabulary" misses the buffer by ~all of it
        naive = {v: plan[v][key] - plan[v]["tile"] + rows * v * cb for v in vocabs}
        naive_intercept = 2 * (measured[256][i] - naive[256]) - (measured[512][i] - naive[512])
        assert abs(naive_intercept) > 0.9 * plan[256]["tile"]


def test_fused_head_constants_are_trls():
    """The tile's sizes are TRL's (read from its source: importing trl.trainer takes seconds)."""
    import importlib.util
    import re
    from pathlib import Path

    from trl.kernels import chunked_logprob

    utils = Path(importlib.util.find_spec("trl").origin).parent / "trainer" / "utils.py"
    width = re.search(r"^_CHUNKED_LOGPROB_CHUNK_SIZE = (\d+)$", utils.read_text(encoding="utf-8"), re.M)
    assert chunked_logprob.TOKEN_CHUNK_SIZE == TOKEN_TILE and int(width.group(1)) == VOCAB_TILE


# ------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("name,kw", [("tiny-llama", {}), ("tiny-mistral", {"sliding_window": 6})])
def test_kv_cache_equals_dynamic_cache_after_generate(name, kw):
    """The planned KV cache against the storages of transformers' DynamicCache after a real generate (left-padded
    prompts, every completion at the maximum): ``P + C - 1`` positions x layers x 2 x kv heads x head_dim; a
    sliding-window layer keeps its window. Controls: the query heads instead of the KV heads (GQA), P + C
    positions."""
    cfg, model, _ = _model(name, **kw)
    model.eval()
    rows, p, c = 3, 7, 5
    ids = torch.randint(3, cfg.vocab_size, (rows, p))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # a shorter prompt, left-padded as TRL's
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=c, min_new_tokens=c, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    measured = sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                   for layer in cache.layers)
    planned, per_layer, how = kv_cache_bytes(cfg, rows, p + c - 1, 4)
    assert planned == measured, (planned, measured, how)
    if not kw:
        assert kv_cache_bytes(cfg, rows, p + c, 4)[0] != measured
        assert cfg.num_key_value_heads < cfg.num_attention_heads
        assert planned * cfg.num_attention_heads // cfg.num_key_value_heads != measured
    else:
        assert "sliding_attention" in how and planned < rows * (p + c - 1) * 2 * cfg.num_key_value_heads * (
            cfg.hidden_size // cfg.num_attention_heads) * 4 * cfg.num_hidden_layers


@pytest.mark.parametrize("rows,p,c", [(4, 64, 8), (4, 8, 64)])
def test_generation_peak_matches_a_real_generate(rows, p, c):
    """The generation phase (the prefill: KV cache of the prompts + the backbone's no-grad peak, or the last step:
    the full cache + one layer's keys copied by torch.cat + the logits) against the live bytes of a real
    ``generate`` (tiny Qwen2, CPU, fp32, weights not counted). Control: the KV cache alone."""
    from hf_gradfix.plan.rl import plan_phases

    cfg, model, weights = _model("tiny-qwen2")
    model.eval()
    ids = torch.randint(3, cfg.vocab_size, (rows, p))
    mask = torch.ones_like(ids)
    with _Live(skip=weights) as live, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=c, min_new_tokens=c, do_sample=False,
                       pad_token_id=0)
    measured = live.peak + ids.untyped_storage().nbytes() + mask.untyped_storage().nbytes()
    head = {"no_grad": 0.0, "fused": {"rows": 1, "tile": 0.0}}
    phases = plan_phases(cfg, RLRun(prompt_len=p, completion_len=c), micro_batch=rows, grad_accum=1, rows=rows,
                         row_len=p + c, training=0.0, head=head, trace_dtype="fp32", attention="fused", elem_bytes=4,
                         tp=1)["phases"]["generation"]
    assert phases["bytes"] == pytest.approx(measured, rel=0.02), (phases, measured)
    assert phases["kv_cache"] < 0.9 * measured  # the control: the cache is not all of it


# ------------------------------------------------------------------------------------------ forwards
def test_no_grad_forward_trace_equals_a_real_forward():
    """The traced no-grad peak (fake tensors) equals a real no-grad forward's live bytes (tiny Qwen2, fp32, SDPA);
    control: the same forward with gradients saves far more."""
    from hf_gradfix.plan.activations import trace_activations, trace_inference

    cfg, model, weights = _model("tiny-qwen2")
    model.eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 64))
    with _Live(skip=weights) as live, torch.no_grad():
        out = model.base_model(input_ids=ids, use_cache=False)
    traced = trace_inference(cfg, micro_batch=2, seq_len=64, dtype="fp32")
    assert traced.peak == live.peak + ids.untyped_storage().nbytes()
    assert traced.output == out.last_hidden_state.untyped_storage().nbytes()
    assert trace_activations(cfg, micro_batch=2, seq_len=64, dtype="fp32", head=False).layers_total() > 2 * traced.peak


def _saved(fn, skip):
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {StorageWeakRef(t.untyped_storage()) for t in skip}
    seen, shapes = set(), []

    def pack(t):
        w = StorageWeakRef(t.untyped_storage())
        if w not in skip and w not in seen:
            seen.add(w)
            shapes.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def _sdpa_per_document(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                       softmax_scale=None, causal=False, **_):
    """A varlen kernel that saves O(L) per document (torch's flash-style CPU SDPA, one call per document)."""
    bounds, outs = cu_seqlens_q.tolist(), []
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=softmax_scale, enable_gqa=ks.shape[1] != qs.shape[1])[0].transpose(0, 1))
    return torch.cat(outs)


def test_padded_and_packed_training_activations_match_real_forwards():
    """A GRPO micro-batch of 4 samples (prompts 3-12 tokens left-padded to 12, completions 1-20 right-padded to 20):
    the planner traces 4 x 32 positions padded and one row of the 71 real tokens packed. Measured on the real
    forwards (tiny Qwen2, fp32): TRL's padded rows on SDPA, and the plugin's packed row (``pack_chunk``: restarted
    positions, cu_seq_lens) on a varlen kernel that saves O(L) per document. Two CPU artefacts are taken out,
    each counted: SDPA with a padding mask saves that mask per layer (FlashAttention 2 unpads instead), and the
    per-document kernel saves the concatenation of its outputs (one layer output more than a varlen kernel).
    Control: the padded count is not the packed forward's."""
    from hf_gradfix.integration.rl.packing import pack_chunk
    from hf_gradfix.packing.attention import _REGISTERED, _register, _varlen_attention_forward
    from hf_gradfix.packing.attention import use_attention_implementation
    from hf_gradfix.plan.activations import trace_activations

    cfg, model, weights = _model("tiny-qwen2")
    model.train()
    rows, p, c = 4, 12, 20
    ids, mask = torch.zeros(rows, p + c, dtype=torch.long), torch.zeros(rows, p + c, dtype=torch.long)
    for i, (pl, cl) in enumerate(zip((12, 5, 9, 3), (20, 7, 1, 14))):
        ids[i, p - pl:p + cl] = torch.randint(3, cfg.vocab_size, (pl + cl,))
        mask[i, p - pl:p + cl] = 1
    layers = cfg.num_hidden_layers

    padded = _saved(lambda: model.base_model(input_ids=ids, attention_mask=mask, use_cache=False), weights)
    masks = [b for s, b in padded if s == (rows, 1, p + c, p + c)]
    assert len(masks) == layers  # SDPA's float copy of the padding mask, one per layer
    traced_padded = trace_activations(cfg, micro_batch=rows, seq_len=p + c, dtype="fp32", head=False)
    assert sum(b for _, b in padded) - sum(masks) == traced_padded.layers_total() + traced_padded.outside

    name = "flash_doc_sdpa_plan_test"
    if name not in _REGISTERED:
        _register(name, functools.partial(_varlen_attention_forward, _sdpa_per_document))
    chunk = pack_chunk(ids, mask, logits_to_keep=c)
    real = chunk.real_tokens
    assert real == int(mask.sum()) == 71 and chunk.inputs["input_ids"].shape == (1, real)
    inputs = {k: v for k, v in chunk.inputs.items() if k != "labels"}
    with use_attention_implementation(model, name):
        packed = _saved(lambda: model.base_model(**inputs, use_cache=False), weights)
    concat = layers * real * cfg.hidden_size * 4
    traced_packed = trace_activations(cfg, micro_batch=1, seq_len=real, dtype="fp32", head=False)
    assert sum(b for _, b in packed) - concat == traced_packed.layers_total() + traced_packed.outside
    # the planner's packed plan traces exactly that row
    s = Settings(micro_batch=rows, dtype="fp32", recompute="none",
                 rl=RLRun(prompt_len=p, completion_len=c, forwards="packed", mean_prompt_len=29 / 4,
                          mean_completion_len=42 / 4))
    plan = estimate(cfg, ParallelDims(1), s)
    assert f"{real:,} real tokens" in plan.extra["rl"]["phases"]["training"]["how"]
    # control: the padded count over-counts the packed forward by the padding (45 % of the positions here)
    assert traced_padded.layers_total() > 1.5 * traced_packed.layers_total()


# ------------------------------------------------------------------------------------------ the plan
def _rl_plan(**kw):
    rl = dict(prompt_len=32, completion_len=64)
    rl.update(kw.pop("rl", {}))
    s = dict(micro_batch=4, grad_accum=2, dtype="fp32", recompute="none")
    s.update(kw)
    return estimate(load_model_config("tiny-qwen2"), ParallelDims(1), Settings(rl=RLRun(**rl), **s))


def test_plan_phases_reference_model_and_fused_head():
    """What coexists: the model state, the reference model and the comm buffers always; on top, the largest of
    generation (KV cache), the no-grad forwards and the training step. The reference model is the policy's
    weights in its dtype; the fused head replaces the logits."""
    base = _rl_plan()
    ref = _rl_plan(rl={"beta": 0.04})
    assert base.components["reference_model"] == 0 and ref.components["reference_model"] == ref.components["parameters"]
    assert ref.peak - base.peak == pytest.approx(1.1 * ref.components["parameters"], rel=1e-6)
    phases = ref.extra["rl"]["phases"]
    assert ref.components["activations"] == max(ph["bytes"] for ph in phases.values())
    assert phases["no_grad"]["forwards"] == ["reference"] and base.extra["rl"]["phases"]["no_grad"]["bytes"] == 0
    # the fused head instead of the (rows, positions, vocabulary) logits: every completion position scored (no
    # mean length given), one tile of them x 32768 columns
    head = ref.extra["fused_head"]
    assert head["n"] == 4 * 64 and head["fused"]["tile"] == 4 * 64 * VOCAB_TILE * 4
    assert ref.extra["padded_seq_len"] == 96
    # RLOO computes the old log-probs; GRPO only when the window is not a whole number of generation batches
    assert _rl_plan(rl={"trainer": "rloo", "beta": 0.0}).extra["rl"]["phases"]["no_grad"]["forwards"] == ["old policy"]
    assert _rl_plan(rl={"steps_per_generation": 4}).extra["rl"]["phases"]["no_grad"]["forwards"] == ["old policy"]
    # the KV cache grows with the generation batch (micro-batch x steps per generation); generation becomes the peak
    big = _rl_plan(rl={"steps_per_generation": 64})
    assert big.extra["rl"]["peak_phase"] == "generation"
    assert big.extra["rl"]["phases"]["generation"]["rows"] == 4 * 64


def test_packed_plans_fewer_activations_than_padded():
    padded = _rl_plan(rl={"mean_prompt_len": 8, "mean_completion_len": 16})
    packed = _rl_plan(rl={"mean_prompt_len": 8, "mean_completion_len": 16, "forwards": "packed"})
    tp, tk = padded.extra["rl"]["phases"]["training"], packed.extra["rl"]["phases"]["training"]
    assert tk["bytes"] < tp["bytes"] and "96 real tokens" in tk["how"]
    # the fused head scores the same completion tokens either way
    assert padded.extra["fused_head"]["n"] == packed.extra["fused_head"]["n"] == 64


def test_cli_rl_table_json_and_config(tmp_path, capsys):
    argv = ["--model", "tiny-qwen2", "--rl", "grpo", "--prompt-len", "32", "--completion-len", "64", "--micro-batch",
            "4", "--grad-accum", "2", "--beta", "0.04", "--dtype", "fp32", "--num-generations", "4"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "rl          grpo (TRL 1.16)" in out and "reference_model" in out and "rl phases" in out
    assert "recompute full" in out  # TRL's gradient_checkpointing default
    assert plan_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)["plan"]
    assert data["settings"]["rl"]["forwards"] == "padded" and data["settings"]["seq_len"] == 96
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("num_processes: 1\nhf_gradfix:\n  packing: {rl_forwards: true}\n")
    assert plan_main(argv + ["--config", str(cfg), "--json", "--mean-completion-len", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["settings"]["rl"]["forwards"] == "packed"


@pytest.mark.parametrize("extra,needle", [
    (["--prompt-len", "8"], "needs --rl"),
    (["--rl", "grpo", "--prompt-len", "8"], "--completion-len"),
    (["--rl", "grpo", "--prompt-len", "8", "--completion-len", "8", "--seq-len", "16"], "--seq-len with --rl"),
    (["--rl", "grpo", "--prompt-len", "8", "--completion-len", "8", "--num-generations", "3"], "multiple"),
    (["--rl", "grpo", "--prompt-len", "8", "--completion-len", "8", "--mean-completion-len", "9"],
     "--mean-completion-len"),
    (["--rl", "grpo", "--prompt-len", "8", "--completion-len", "8", "--beta", "nan"], "--beta"),
    (["--rl", "grpo", "--prompt-len", "0", "--completion-len", "8"], "--prompt-len"),
    (["--rl", "grpo", "--prompt-len", "8", "--completion-len", "8", "--simulate"], "--simulate"),
])
def test_cli_rl_bad_input(extra, needle, capsys):
    assert plan_main(["--model", "tiny-qwen2", "--micro-batch", "4", "--num-gpus", "2"] + extra) == 2
    assert needle in capsys.readouterr().err


def test_rl_docstrings_run():
    import doctest
    import importlib

    for name in ("hf_gradfix.plan.rl", "hf_gradfix.plan.activations"):
        assert doctest.testmod(importlib.import_module(name)).failed == 0, name


def test_refused_settings():
    with pytest.raises(PlanError, match="cp"):
        estimate(load_model_config("tiny-llama"), ParallelDims(2, dp_shard=1, cp=2),
                 Settings(rl=RLRun(prompt_len=8, completion_len=8)))
    with pytest.raises(PlanError, match="traced"):
        _rl_plan(activation_model="formula")
