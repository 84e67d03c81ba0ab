"""hf-gradfix plan with pipeline parallelism and with CP x packing, against independent counts.

- per-stage parameters: a real tiny model split into stages with plain torch (``torch.tensor_split`` of its
  decoder layers, the embeddings on the first stage, norm and head on the last) and counted module by module;
- bubble and micro-batches in flight: a time-slot simulation written here, replaying each schedule's op order
  (GPipe and 1F1B written out here, interleaved 1F1B and zero bubble taken from torch's own schedule classes),
  with dependencies between stages (a forward waits for the previous chunk's, a backward for the next chunk's);
- the document mask's and the gathered K/V's bytes: what autograd saves through the packed-CP attention;
- bad input: one line, exit code 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_gradfix.parallel import ParallelDims
from hf_gradfix.plan import Settings, estimate, load_model_config
from hf_gradfix.plan.command import plan_main
from hf_gradfix.plan.pipeline import PipelineSpec, bubble_fraction, in_flight

# ------------------------------------------------------------------------------------------ per-stage parameters


def _real_stage_counts(config, pp: int, v: int) -> list[int]:
    """Parameters each stage holds, from a real model split with plain torch."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    chunks = torch.tensor_split(torch.arange(len(layers)), pp * v)
    counts = []
    for s in range(pp):
        mods = [layers[int(i)] for c in range(s, pp * v, pp) for i in chunks[c]]
        if s == 0:
            mods.append(model.model.embed_tokens)
        if s == pp - 1 if v == 1 else (pp * v - 1) % pp == s:
            mods += [model.model.norm, model.lm_head]
        seen = {id(p): p.numel() for m in mods for p in m.parameters()}  # a stage holds each tensor once
        counts.append(sum(seen.values()))
    return counts


@pytest.mark.parametrize("name,layers,pp,v", [("tiny-llama", 5, 2, 1), ("tiny-llama", 5, 3, 1),
                                                ("tiny-llama", 5, 2, 2), ("tiny-qwen2", 3, 3, 1)])
def test_stage_parameters_equal_a_real_split(name, layers, pp, v):
    cfg = load_model_config(name)
    cfg.num_hidden_layers = layers
    s = Settings(seq_len=32, dtype="fp32", pp=pp, grad_accum=2 * pp, zero=0,
                 pp_schedule="interleaved_1f1b" if v > 1 else "1f1b", pp_virtual_stages=v)
    plan = estimate(cfg, ParallelDims(1), s)
    planned = [st["parameters"] for st in plan.extra["stages"]]
    assert planned == _real_stage_counts(cfg, pp, v)
    if name == "tiny-qwen2":  # tied embeddings: the last stage holds its own copy of the head (= embedding)
        assert sum(planned) == plan.n_params + cfg.vocab_size * cfg.hidden_size
    # the worst stage's parameter bytes: 4 B x its parameters + the rotary buffer every stage keeps
    worst = plan.extra["pipeline"]["worst_stage"]
    buffers = plan.components["parameters"] - 4 * planned[worst]
    assert 0 <= buffers < 1024


# ------------------------------------------------------------------------------------------ schedules


def _order_gpipe(p: int, m: int) -> dict[int, list]:
    return {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}


def _order_1f1b(p: int, m: int) -> dict[int, list]:
    """Megatron's non-interleaved 1F1B: p - r - 1 warm-up forwards, then forward/backward pairs, then the rest."""
    out = {}
    for r in range(p):
        warm = min(m, p - r - 1)
        ops = [(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            ops += [(r, "F", f), (r, "B", b)]
            f, b = f + 1, b + 1
        ops += [(r, "B", i) for i in range(b, m)]
        out[r] = ops
    return out


def _order_torch(schedule: str, p: int, v: int, m: int) -> dict[int, list]:
    """torch's own op order for its interleaved schedules (computed without a process group)."""
    from torch.distributed.pipelining import schedules

    cls = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}[schedule]
    cls = getattr(schedules, cls)
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    sched._num_stages = p * v
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    try:
        return {r: [(a.stage_index, kinds[a.computation_type.name], a.microbatch_index)
                    for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(p)}
    except (AttributeError, TypeError) as exc:  # torch moved its private schedule internals
        pytest.skip(f"torch's schedule internals changed ({exc})")


def _simulate(orders: dict[int, list], p: int, v: int, dur: dict[str, float]) -> tuple[float, list[int]]:
    """Run every rank's ops in order as soon as their inputs exist: (bubble fraction, peak chunk activations
    held per rank; a forward adds one, the backward that frees it -- B, or W when the backward is split --
    removes it)."""
    n = p * v
    split = any(k == "I" for ops in orders.values() for _, k, _ in ops)
    finish: dict = {}
    clock, pos = [0.0] * p, [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                c, kind, i = orders[r][pos[r]]
                if kind == "F":
                    deps = [("F", c - 1, i)] if c > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", c, i)] + ([("I" if split else "B", c + 1, i)] if c < n - 1 else [])
                else:
                    deps = [("I", c, i)]
                if not all(d in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                finish[(kind, c, i)] = clock[r] = start + dur[kind]
                pos[r] += 1
                moved = True
        assert moved, "the op order deadlocks"
    makespan = max(clock)
    busy = sum(dur[k] for _, k, _ in orders[0])
    peaks = []
    free = "W" if split else "B"
    for r in range(p):
        held = peak = 0
        for _, kind in sorted((finish[(k, c, i)], k) for c, k, i in orders[r]):
            held += (kind == "F") - (kind == free)
            peak = max(peak, held)
        peaks.append(peak)
    return 1 - busy / makespan, peaks


@pytest.mark.parametrize("schedule,p,v,m", [
    ("gpipe", 2, 1, 4), ("gpipe", 4, 1, 8), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 3),
    ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 4, 2, 4),
    ("interleaved_1f1b", 4, 3, 12), ("interleaved_1f1b", 4, 2, 6), ("interleaved_1f1b", 4, 2, 10),
    ("interleaved_1f1b", 4, 2, 2), ("interleaved_1f1b", 4, 3, 3), ("interleaved_1f1b", 8, 2, 4),  # m < p
    ("zero_bubble", 4, 1, 8), ("zero_bubble", 4, 2, 8), ("zero_bubble", 2, 2, 4), ("zero_bubble", 2, 2, 3),
    ("zero_bubble", 4, 2, 6), ("zero_bubble", 4, 3, 6), ("zero_bubble", 4, 2, 10), ("zero_bubble", 4, 1, 6),
])
def test_bubble_and_in_flight_match_a_simulation_of_the_schedule(schedule, p, v, m):
    if schedule == "gpipe":
        orders = _order_gpipe(p, m)
    elif schedule == "1f1b":
        orders = _order_1f1b(p, m)
    else:
        orders = _order_torch(schedule, p, v, m)
    durations = {"F": 1.0, "B": 2.0} if schedule != "zero_bubble" else {"F": 1.0, "I": 1.0, "W": 1.0}
    spec = PipelineSpec(p, schedule, v, m)
    bubble, peaks = _simulate(orders, p, v, durations)
    assert bubble == pytest.approx(bubble_fraction(spec), abs=1e-12)
    assert [in_flight(spec, s) * v for s in range(p)] == pytest.approx(peaks)
    if schedule in ("gpipe", "1f1b"):  # the same with equal forward and backward times
        assert _simulate(orders, p, v, {"F": 1.0, "B": 1.0})[0] == pytest.approx(bubble_fraction(spec))


def test_gpipe_holds_every_micro_batch_1f1b_only_the_pipeline_depth():
    cfg = load_model_config("tiny-llama")
    cfg.num_hidden_layers = 4
    base = Settings(seq_len=64, dtype="fp32", pp=2, zero=0)

    def stage0(**kw):
        plan = estimate(cfg, ParallelDims(1), dataclasses.replace(base, **kw))
        return plan.extra["stages"][0]

    g, f, one = stage0(pp_schedule="gpipe", grad_accum=8), stage0(grad_accum=8), stage0(grad_accum=1)
    assert (g["in_flight"], f["in_flight"], one["in_flight"]) == (8, 2, 1)
    per_micro_batch = f["activations"] - one["activations"]  # one more micro-batch's saved activations
    assert per_micro_batch > 0
    assert g["activations"] - f["activations"] == pytest.approx(6 * per_micro_batch)
    # 1F1B: the last stage holds one micro-batch whatever m is
    last = estimate(cfg, ParallelDims(1), dataclasses.replace(base, grad_accum=8)).extra["stages"][1]
    assert last["in_flight"] == 1


def test_pp_halves_the_model_state_per_rank():
    cfg = load_model_config("tiny-llama")
    cfg.num_hidden_layers = 4
    flat = estimate(cfg, ParallelDims(1), Settings(seq_len=32, dtype="fp32"))
    piped = estimate(cfg, ParallelDims(1), Settings(seq_len=32, dtype="fp32", pp=2, grad_accum=2))
    state = lambda st: st["model_state"]  # noqa: E731
    assert sum(map(state, piped.extra["stages"])) == pytest.approx(
        sum(flat.components[k] for k in ("parameters", "master_weights", "gradients", "optimizer_state"))
        + flat.components["parameters"] - 4 * flat.n_params, rel=1e-6)  # + each stage's rotary buffer


# ------------------------------------------------------------------------------------------ CLI, suggest, bad input


def test_cli_pipeline_table_and_json(capsys):
    import json

    assert plan_main(["--model", "tiny-llama", "--num-gpus", "4", "--pp", "2", "--grad-accum", "4",
                      "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "pp=2" in out and "bubble 20.0 %" in out and "+emb" in out and "+head" in out
    assert plan_main(["--model", "tiny-llama", "--num-gpus", "4", "--pp", "2", "--pp-virtual-stages", "1",
                      "--pp-schedule", "gpipe", "--grad-accum", "4", "--seq-len", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["plan"]
    assert data["mesh"]["pp"] == 2 and data["mesh"]["world_size"] == 4 and data["mesh"]["dp_shard"] == 2
    assert [s["in_flight"] for s in data["extra"]["stages"]] == [4, 4]


@pytest.mark.parametrize("argv,needle", [
    (["--num-gpus", "4", "--pp", "3"], "--pp 3: does not divide the world size 4"),
    (["--num-gpus", "4", "--pp", "4"], "every chunk needs at least one layer"),
    (["--num-gpus", "2", "--pp", "2", "--pp-schedule", "1f1b", "--pp-virtual-stages", "2"],
     "virtual stages need interleaved_1f1b or zero_bubble"),
    (["--num-gpus", "2", "--pp", "2", "--pp-schedule", "gpipe", "--pp-virtual-stages", "0"],
     "--pp-virtual-stages 0: invalid value"),
    (["--num-gpus", "2", "--pp", "0"], "--pp 0: invalid value"),
    (["--num-gpus", "4", "--pp", "2", "--deepspeed"], "DeepSpeed's own pipeline engine is not planned"),
    (["--config", "configs/accelerate/deepspeed_zero2.yaml", "--pp", "2"],
     "DeepSpeed's own pipeline engine is not planned"),
    (["--num-gpus", "2", "--pp", "2", "--simulate", "--dtype", "fp32"], "--simulate / --timeline with pp=2"),
    (["--num-gpus", "2", "--pp", "2", "--pp-schedule", "zero_bubble"], "needs at least as many micro-batches"),
    (["--num-gpus", "2", "--pp", "2", "--pp-schedule", "zero_bubble", "--grad-accum", "5"],
     "--grad-accum 5: the interleaved schedules run the micro-batches in rounds"),
])
def test_bad_pipeline_input_is_one_line(argv, needle, capsys):
    rc = plan_main(["--model", "tiny-llama", "--seq-len", "32", *argv])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def _error_lines(err: str) -> list[str]:
    """stderr less the plugin's log lines (the progress lines go there, ``[hf_gradfix] INFO: plan: [1.2 s] ...``):
    an error is one line."""
    return [line for line in err.strip().splitlines() if not line.startswith("[hf_gradfix]")]


def test_interleaved_needs_whole_rounds(capsys):
    cfg = load_model_config("tiny-llama")
    cfg.num_hidden_layers = 4
    from hf_gradfix.plan import PlanError

    with pytest.raises(PlanError, match="--grad-accum 5: the interleaved schedules"):
        estimate(cfg, ParallelDims(1), Settings(seq_len=32, pp=2, pp_schedule="interleaved_1f1b",
                                                pp_virtual_stages=2, grad_accum=5))


def test_suggest_finds_pipeline_layouts_where_nothing_else_fits():
    """Heads 1 (no tp) and an odd sequence (no cp): only pipeline stages cut the activations of one rank."""
    from transformers import LlamaConfig

    from hf_gradfix.plan.command import suggest
    from hf_gradfix.plan.estimate import GiB

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=1,
                      num_key_value_heads=1, vocab_size=256)
    base = Settings(seq_len=2047, dtype="fp32")
    flat = min(estimate(cfg, ParallelDims(4, dp_shard=4), dataclasses.replace(base, recompute=rc)).peak
               for rc in ("none", "full"))
    piped = estimate(cfg, ParallelDims(1), dataclasses.replace(base, pp=4, recompute="full")).peak
    assert piped < flat
    rows = suggest(cfg, 4, (piped + flat) / 2, base, limit=100)
    assert rows and all(r["pp"] > 1 for r in rows)
    assert all(r["bubble"] == pytest.approx(bubble_fraction(PipelineSpec(r["pp"], r["pp_schedule"],
                                                                           r["pp_virtual_stages"], 1)), abs=1e-4)
               for r in rows)
    assert [r["tokens_per_s_per_gpu"] for r in rows] == sorted((r["tokens_per_s_per_gpu"] for r in rows),
                                                               reverse=True)
    assert max(r["peak_gib"] for r in rows) <= (piped + flat) / 2 / GiB + 0.01


def test_config_pipeline_keys_plan_like_the_flags(tmp_path, capsys):
    """A configuration's parallel.pp / pp_schedule plan like the flags."""
    cfg = tmp_path / "pp.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nhf_gradfix:\n"
                   "  parallel: {pp: 2, pp_schedule: gpipe, dp_shard: 2}\n")
    assert plan_main(["--model", "tiny-llama", "--config", str(cfg), "--seq-len", "64", "--grad-accum", "4",
                      "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)["plan"]
    assert data["mesh"]["pp"] == 2 and data["extra"]["pipeline"]["schedule"] == "gpipe"


# ------------------------------------------------------------------------------------------ CP x packing


def _saved_by_packed_attention(cfg, seq: int, cp: int, layers: int) -> tuple[int, int]:
    """Bytes autograd saves for ``layers`` attention calls of one cp rank through the packed-CP attention (one
    process: the gathered keys are given whole), split into (mask storages, K/V storages), each storage once."""
    from hf_gradfix.parallel.context_packing import PackedLayout, packed_attention_block

    ids = torch.arange(1, seq + 1)[None]
    quarter = seq // 4 // (2 * cp) * (2 * cp)  # three documents, each a whole number of the balancer's chunks
    positions = torch.cat([torch.arange(n) for n in (quarter, seq - 2 * quarter, quarter)])[None]
    layout = PackedLayout.build({"input_ids": ids, "labels": ids, "position_ids": positions}, cp=cp, pad_token_id=0)
    assert layout.length == seq  # no padding: the documents' lengths are multiples of 2 x cp already
    length, heads = layout.length, cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    mask = layout.mask(0)
    storages: dict[int, tuple[str, int]] = {}
    q = torch.randn(1, heads, length // cp, head_dim, requires_grad=True)

    def pack(t):
        kind = "mask" if t.dim() == 4 and t.shape[1] == 1 else "kv" if t.dim() == 4 and t.shape[2] == length else "other"
        storages[t.untyped_storage().data_ptr()] = (kind, t.untyped_storage().nbytes())
        return t

    with packed_attention_block(mask, None), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(layers):  # the model's grouped K/V (kv heads) over the whole row, as after the all-gather
            kv = torch.randn(1, cfg.num_key_value_heads, length, head_dim, requires_grad=True)
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv.clone(), is_causal=True)
    by_kind = {k: sum(n for kind, n in storages.values() if kind == k) for k in ("mask", "kv")}
    return by_kind["mask"] + mask.untyped_storage().nbytes(), by_kind["kv"]


def test_cp_packing_document_mask_equals_what_attention_saves():
    """The planner's document mask = the boolean mask kept for the step + the additive mask SDPA saves, ONE
    storage for every layer (measured through the packed-CP attention the training uses)."""
    cfg = load_model_config("tiny-llama")
    seq, cp = 250, 2  # padded to a multiple of 2 x cp
    plan = estimate(cfg, ParallelDims(2, dp_shard=1, cp=cp), Settings(seq_len=seq, dtype="fp32", packing=True))
    assert plan.extra["padded_seq_len"] == 252
    mask_bytes, _ = _saved_by_packed_attention(cfg, 252, cp, layers=3)
    assert plan.extra["document_mask_bytes"] == mask_bytes


def test_cp_packing_counts_the_gathered_kv_of_every_layer():
    cfg = load_model_config("tiny-llama")
    mesh = ParallelDims(2, dp_shard=1, cp=2)
    plain = estimate(cfg, mesh, Settings(seq_len=1024, dtype="fp32"))
    packed = estimate(cfg, mesh, Settings(seq_len=1024, dtype="fp32", packing=True))
    # what attention saves per layer, measured: K and V over the whole row, every query head
    _, kv_saved_per_layer = _saved_by_packed_attention(cfg, 1024, 2, layers=1)
    local_kv = 2 * torch.empty(1, cfg.num_key_value_heads, 1024 // 2, cfg.hidden_size // cfg.num_attention_heads).nbytes
    extra_per_layer = kv_saved_per_layer - local_kv  # beyond the local K/V the unpacked trace already counts
    expected = cfg.num_hidden_layers * extra_per_layer + packed.extra["document_mask_bytes"]
    assert packed.activations_no_recompute - plain.activations_no_recompute == pytest.approx(expected)
    assert "all-gathered K/V" in packed.explain["activations"] and "all-gather" in packed.explain["comm_buffers"]


def test_cp_packing_from_the_flag(capsys):
    assert plan_main(["--model", "tiny-llama", "--num-gpus", "2", "--seq-len", "1000", "--packing"]) == 0
    assert plan_main(["--model", "tiny-llama", "--config", "configs/cpu_cp.yaml", "--seq-len", "1000",
                      "--packing"]) == 0
    out = capsys.readouterr().out
    assert "document mask" in out and "padded to 1,000" not in out


def test_pp_flag_with_a_config_shares_the_rest_of_the_world(tmp_path, capsys):
    import json

    cfg = tmp_path / "ddp.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nhf_gradfix:\n"
                   "  parallel: {dp_replicate: -1, dp_shard: 1, tp: 2}\n")
    assert plan_main(["--model", "tiny-llama", "--config", str(cfg), "--pp", "2", "--grad-accum", "2",
                      "--seq-len", "64", "--json"]) == 0
    mesh = json.loads(capsys.readouterr().out)["plan"]["mesh"]
    assert (mesh["world_size"], mesh["pp"], mesh["dp_replicate"], mesh["tp"]) == (8, 2, 2, 2)
    # FSDP2 over the tp stages (dp_shard 2 x tp 2 under pp): the run refuses it, so does the planner, in its line
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nhf_gradfix:\n  parallel: {dp_shard: -1, tp: 2}\n")
    assert plan_main(["--model", "tiny-llama", "--config", str(cfg), "--pp", "2", "--grad-accum", "2",
                      "--seq-len", "64"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "parallel.pp=2 with tp=2 and dp_shard=2" in err[0], err
    assert plan_main(["--model", "tiny-llama", "--config", str(cfg), "--pp", "3", "--seq-len", "64"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "--pp 3: does not divide the world size 8" in err[0], err


def test_packing_config_plans_its_rows(tmp_path, capsys):
    """A --config with packing.enabled: rows of token_budget tokens; with cp > 1 too, the CP x packing count
    (or, until issue 29's loader accepts cp with packing, its one-line refusal)."""
    import json

    cfg = tmp_path / "packed.yaml"
    cfg.write_text("num_processes: 2\nhf_gradfix:\n  packing: {enabled: true, token_budget: 512}\n")
    assert plan_main(["--model", "tiny-llama", "--config", str(cfg), "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["plan"]["settings"]
    assert settings["packing"] is True and settings["seq_len"] == 512
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nhf_gradfix:\n"
                   "  packing: {enabled: true, token_budget: 512}\n  parallel: {dp_shard: 1, cp: 2}\n")
    rc = plan_main(["--model", "tiny-llama", "--config", str(cfg), "--json"])
    captured = capsys.readouterr()
    if rc == 0:
        assert json.loads(captured.out)["plan"]["extra"]["document_mask_bytes"] > 0
    else:
        err = _error_lines(captured.err)
        assert rc == 2 and len(err) == 1 and "packing" in err[0], err


# what the run refuses under pp (hf_gradfix.parallel.pipeline.check_combination, config check's line) was planned
# from the flags without a word: a layout that never runs
@pytest.mark.parametrize("argv, needle", [
    (["--num-gpus", "2", "--pp", "2", "--packing"], "parallel.pp=2 with packing enabled"),
    (["--num-gpus", "4", "--pp", "2", "--cp", "2"], "parallel.pp=2 with cp=2"),
    (["--num-gpus", "8", "--pp", "2", "--tp", "2", "--dp-shard", "2"], "parallel.pp=2 with tp=2 and dp_shard=2"),
    (["--num-gpus", "2", "--pp", "2", "--optimizer", "galore_adamw"], "parallel.pp=2 with --optimizer='galore_adamw'"),
])
def test_the_planner_refuses_what_the_run_refuses_under_pp(argv, needle, capsys):
    from hf_gradfix.parallel.pipeline import PipelineError, check_combination

    rc = plan_main(["--model", "tiny-llama", "--seq-len", "32", "--grad-accum", "2", *argv])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    # the same words as the run's own refusal
    with pytest.raises(PipelineError) as run:
        kw = {"--packing": dict(packing=True), "--cp": dict(cp=2), "--tp": dict(tp=2, dp_shard=2),
              "--optimizer": dict(optimizer="galore_adamw", optimizer_key="--optimizer")}[argv[4]]
        check_combination(pp=2, **kw)
    assert err[0] == f"hf-gradfix plan: error: {run.value}"


def test_pp_with_packing_from_one_file_is_refused_by_the_library_config_check_and_the_planner(tmp_path, capsys):
    """parallel.pp and packing.enabled in one YAML: the pipeline refuses the pair at run time (packed rows' document
    boundaries are not carried to the stages). load_config (what patch(config=...) and $HF_GRADFIX_CONFIG read),
    config check and the planner say so before launch, in one and the same line naming both keys and the fix; the
    planner also with --pp on a file that packs. Control: each key alone loads and plans."""
    from hf_gradfix.cli import main
    from hf_gradfix.config import ConfigError, load_config

    head = "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nhf_gradfix:\n"
    both = tmp_path / "both.yaml"
    both.write_text(head + "  parallel: {pp: 2}\n  packing: {enabled: true, token_budget: 128}\n")
    with pytest.raises(ConfigError) as lib:
        load_config(str(both))
    line = str(lib.value)
    assert "\n" not in line and "parallel.pp=2 with packing enabled" in line and "packing.enabled: false" in line
    assert "pp: 1" in line and line.startswith(f"{both}: hf_gradfix.parallel.pp=2")
    assert main(["config", "check", str(both)]) == 2
    assert capsys.readouterr().err.strip() == f"hf-gradfix config check: {line}"
    assert plan_main(["--model", "tiny-llama", "--config", str(both), "--grad-accum", "2"]) == 2
    assert _error_lines(capsys.readouterr().err) == [f"hf-gradfix plan: error: {line}"]
    packs = tmp_path / "packs.yaml"
    packs.write_text(head + "  packing: {enabled: true, token_budget: 128}\n")
    assert load_config(str(packs)).packing.enabled  # control: packing alone
    assert plan_main(["--model", "tiny-llama", "--config", str(packs), "--grad-accum", "2"]) == 0
    capsys.readouterr()
    assert plan_main(["--model", "tiny-llama", "--config", str(packs), "--pp", "2", "--grad-accum", "2"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "parallel.pp=2 with packing enabled" in err[0], err
    pp_only = tmp_path / "pp.yaml"
    pp_only.write_text(head + "  parallel: {pp: 2}\n")
    assert load_config(str(pp_only)).parallel.pp == 2  # control: pp alone
    assert main(["config", "check", str(pp_only)]) == 0


def test_zero_bubble_runs_one_stage_per_rank_and_every_entry_point_agrees(tmp_path, capsys):
    """pp_schedule zero_bubble with pp_virtual_stages 1: torch's ScheduleInterleavedZeroBubble takes one stage per rank
    (ZB-H1: its op order splits each backward into input (I) and weight (W) gradients, not 1F1B's whole B), the run
    is exact on 2 gloo ranks (tests/parallel/test_pipeline.py, pp2_zero_bubble_v1_ga4), so config check accepts it, the schema
    says so, and the planner plans it with the bubble config check prints."""
    import dataclasses as dc
    import json

    from hf_gradfix.cli import main
    from hf_gradfix.config.schema import ParallelConfig

    kinds = {k for ops in _order_torch("zero_bubble", 2, 1, 4).values() for _, k, _ in ops}
    assert kinds == {"F", "I", "W"}, kinds
    path = tmp_path / "zb.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nhf_gradfix:\n"
                    "  parallel: {pp: 2, pp_schedule: zero_bubble, pp_virtual_stages: 1}\n")
    assert main(["config", "check", str(path), "--grad-accum", "4"]) == 0
    bubble = bubble_fraction(PipelineSpec(2, "zero_bubble", 1, 4))
    assert f"bubble (p-1)/(3*v*m+p-1) = {100 * bubble:.0f}%" in capsys.readouterr().out
    assert plan_main(["--model", "tiny-llama", "--config", str(path), "--grad-accum", "4", "--seq-len", "32",
                      "--json"]) == 0
    pipe = json.loads(capsys.readouterr().out)["plan"]["extra"]["pipeline"]
    assert (pipe["schedule"], pipe["virtual_stages"], pipe["bubble_fraction"]) == ("zero_bubble", 1, bubble)
    helps = {f.name: f.metadata["help"] for f in dc.fields(ParallelConfig)}
    assert "1 with every schedule" in helps["pp_virtual_stages"] and "1 included" in helps["pp_schedule"]
