"""``--simulate`` / ``--timeline`` for ``--rl``: one TRL 1.16 GRPO / RLOO optimizer step of rank 0 under fake tensors.

The step as ``GRPOTrainer`` / ``RLOOTrainer`` runs it with ``use_vllm=False`` (``_generate_and_score_completions``
then ``_compute_loss`` per micro-batch), traced by the same machinery as :func:`hf_gradfix.plan.simulate.simulate`:
the model built inside ``FakeTensorMode``, torch's ``MemTracker`` counting every storage by category, sampled after
every op into a :class:`~hf_gradfix.diagnostics.memory_timeline.MemoryTimeline` whose ``phases`` name the RL
phase of each sample:

* ``generation``: ``generate`` of the local generation batch (``micro-batch x steps_per_generation`` left-padded
  prompts of ``P`` tokens) under ``no_grad``, the policy in training mode (gradient checkpointing does not drop
  the cache without gradients): the prefill with a ``DynamicCache``, then one token at a time as transformers'
  ``_sample`` does it (the last position's logits, their fp32 copy, ``softmax``, ``multinomial``, the ids and the
  cache grown by ``torch.cat``). Decode steps are alike and the cache only grows: after ``TRACED_DECODE_STEPS``
  the cache is grown to the size the last step finds and only that step is traced;
* ``old log-probs`` (RLOO; GRPO when ``gradient_accumulation_steps % steps_per_generation``) and ``ref
  log-probs`` (``beta > 0``): ``_get_per_token_logps_and_entropies`` under ``no_grad``, ``micro-batch`` rows
  per chunk, each through TRL's fused LM head;
* the training micro-batches of the window (``forward`` / ``backward``, at most
  :data:`~hf_gradfix.plan.simulate.TRACED_MICRO_BATCHES`; a new generation batch every ``steps_per_generation``
  micro-batches, with the accumulated gradients alive), TRL's ``dapo`` loss, then ``optimizer`` step.

TRL's fused head is TRL's own ``ChunkedLogProbFunction`` (``trl.kernels.chunked_logprob``) driven the way TRL's
``add_fused_lm_head`` wrapper drives it. ``kernel="triton"`` (the default: the GPU the planner plans) takes the
Triton path: only the scored positions are gathered, and the tile folds (``_forward_kernel`` / ``_backward_kernel``,
``_addmm_fp32``'s CUDA branch) write in place into the buffers they are handed, so in the trace they are calls that
allocate nothing. ``kernel="torch"`` is TRL's path on a device without Triton (every position scored, the torch
tile folds with their temporaries): what a CPU run measures, which is how the trace is checked.

Rows: padded (TRL's ``micro-batch x (P + C)``) or packed (``packing.rl_forwards``: one row of
``ceil(micro-batch x (mean prompt + mean completion))`` real tokens per chunk). Attention is the planner's fused
profile; no padding mask is materialized (FlashAttention 2 takes none, and a mask's ``all()`` is a data-dependent
step fake tensors cannot take). The gather of the scored positions (TRL: ``hidden[mask]``, a data-dependent
shape) is the same gather by two int64 index tensors of the scored count, which ``hidden[mask]`` builds itself.

Not traced (refused in one line): sharded meshes (FSDP2 / ZeRO-3: TRL gathers the weights for ``generate``),
tensor / context / pipeline parallelism, DeepSpeed ZeRO and optimizer offload.
"""

from __future__ import annotations

import contextlib
import math
import time
import types
from typing import Any

from ..torch_private import private
from .estimate import PlanError, Settings

__all__ = ["TRACED_DECODE_STEPS", "RL_PHASES", "check_rl_traceable", "simulate_rl", "plot_rl_timeline"]

_SIM = "hf-gradfix plan --rl --simulate"

#: decode steps traced one by one before the cache is grown to the size the last decode step finds
TRACED_DECODE_STEPS = 4

#: the timeline's phases of an RL step, in the order they run
RL_PHASES = ("generation", "old log-probs", "ref log-probs", "forward", "backward", "optimizer", "other")

# TRL 1.16 GRPOConfig defaults of the dapo loss
_EPSILON_LOW = _EPSILON_HIGH = 0.2


def check_rl_traceable(mesh, settings: Settings) -> None:
    """Refuse, in one line naming the flag, its value and the fix, what the RL trace does not cover.

    >>> from hf_gradfix.parallel import ParallelDims
    >>> from hf_gradfix.plan.rl import RLRun
    >>> s = Settings(dtype="fp32", rl=RLRun(prompt_len=8, completion_len=8))
    >>> check_rl_traceable(ParallelDims(1), s) is None
    True
    >>> try:
    ...     check_rl_traceable(ParallelDims(2), s)
    ... except PlanError as e:
    ...     print(str(e)[:62])
    --simulate / --timeline with --rl and dp_shard=2 (FSDP2 / ZeRO
    """
    rl = settings.rl
    if rl is None:
        raise PlanError("simulate_rl: Settings.rl is None; give an RLRun (--rl grpo|rloo)")
    flag = "--simulate / --timeline with --rl"
    closed = "drop --simulate / --timeline (the closed form plans it)"
    if mesh.pp > 1 or settings.pp > 1:
        raise PlanError(f"{flag} and pp={max(mesh.pp, settings.pp)}: TRL runs no pipeline stages; drop --pp")
    if mesh.dp_shard * mesh.cp > 1:
        raise PlanError(f"{flag} and dp_shard={mesh.dp_shard * mesh.cp} (FSDP2 / ZeRO-3 sharding): the RL trace runs "
                        f"one unsharded replica (TRL gathers the sharded weights for generate); trace one process "
                        f"(--num-gpus 1, or a --config with dp_replicate) or {closed}")
    if mesh.tp > 1:
        raise PlanError(f"{flag} and tp={mesh.tp}: tensor parallelism is not traced for RL steps; trace tp 1 or "
                        f"{closed}")
    if settings.deepspeed or (settings.zero or 0) > 0 or settings.offload_optimizer:
        raise PlanError(f"{flag} and DeepSpeed (--deepspeed / --zero {settings.zero or 0} / --offload-optimizer): "
                        f"ZeRO partitions are not traced for RL steps; drop them to trace one replica or {closed}")
    from .trace_setup import check_traced_dtype

    check_traced_dtype(settings.dtype)
    if settings.lowrank_grads:
        raise PlanError(f"{flag} and --lowrank-grads: GaLore's low-rank accumulation is not traced for RL steps; "
                        f"drop --lowrank-grads or {closed}")


class _InPlaceKernel:
    """A Triton tile kernel as the trace sees it: ``kernel[grid](...)`` writes into the buffers it is handed and
    allocates nothing (fake tensors cannot run Triton)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _trl_head(kernel: str):
    """TRL's ``ChunkedLogProbFunction``; ``kernel="triton"``: its Triton path for the length of the trace (the
    module's switches put back on exit)."""
    try:
        from trl.kernels import chunked_logprob as ck
    except ImportError as exc:
        raise PlanError("--simulate / --timeline with --rl traces TRL's fused LM head (trl.kernels.chunked_logprob): "
                        "pip install 'trl>=1.16' or drop --simulate / --timeline") from exc
    if kernel == "torch":
        yield ck.ChunkedLogProbFunction
        return
    if kernel != "triton":
        raise PlanError(f"simulate_rl(kernel={kernel!r}): triton (the GPU path) | torch (TRL's path without Triton)")
    missing = object()
    names = ("_use_triton", "_forward_kernel", "_backward_kernel", "triton", "_addmm_fp32")
    saved = {k: ck.__dict__.get(k, missing) for k in names}
    ck._use_triton = lambda device: True
    ck._forward_kernel = ck._backward_kernel = _InPlaceKernel()
    ck.triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    # CUDA's branch: torch.addmm(acc, a, b, out_dtype=float32, out=acc), in place
    ck._addmm_fp32 = lambda acc, a, b: None
    try:
        yield ck.ChunkedLogProbFunction
    finally:
        for k, v in saved.items():
            if v is missing:
                ck.__dict__.pop(k, None)
            else:
                setattr(ck, k, v)


def _fused_head(torch, function, model, hidden, labels, *, compact: bool, n_scored: int, entropy: bool):
    """TRL 1.16's ``add_fused_lm_head`` forward after the backbone: (log-probs, entropies or None), each ``labels``'s
    shape less the first column, 0 where not scored. ``entropy``: the head computes it (TRL's policy head; the
    reference model's head computes log-probs only)."""
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    from .rl import VOCAB_TILE

    hidden_states, labels = hidden[:, :-1], labels[:, 1:]
    mask = labels != -100
    weight = model.get_output_embeddings().weight
    bias = getattr(model.get_output_embeddings(), "bias", None)
    if compact:
        # hidden_states[mask]: aten.index builds two int64 index tensors of the scored count and gathers by them
        flat = torch.arange(n_scored, device=hidden.device)
        rows, cols = flat // labels.shape[1], flat % labels.shape[1]
        del flat
        per_token = function.apply(hidden_states[rows, cols], weight, bias, labels[rows, cols], 1.0, VOCAB_TILE,
                                   None, 1.0, outputs)
        # TRL: x.new_zeros(mask.shape).masked_scatter(mask, x); the same scatter by the indices
        log_probs, entropy = (None if x is None else x.new_zeros(mask.shape).index_put((rows, cols), x)
                              for x in per_token[:2])
    else:
        per_token = function.apply(hidden_states.reshape(-1, hidden_states.size(-1)), weight, bias,
                                   labels.clamp(min=0).reshape(-1), 1.0, VOCAB_TILE, None, 1.0, outputs)
        log_probs, entropy = (None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token[:2])
    del per_token
    _loss = -log_probs.sum() / mask.sum().clamp(min=1)  # the wrapper's own loss (GRPO does not use it)
    return log_probs, entropy


def simulate_rl(config, mesh, settings: Settings, *, kernel: str = "triton", progress: Any = None,
                _omit: tuple[str, ...] = ()) -> dict[str, Any]:
    """Trace one RL optimizer step of rank 0 (module docstring) and return bytes: ``peak``, ``at_peak`` (per
    component), ``phase`` (the RL phase of the peak), ``phases`` (per RL phase: ``max``, its highest total, and
    ``above_start``, that minus what lived when the step began), ``after_step``, ``max`` (each component's own
    maximum), ``timeline``, ``seconds``. ``_omit``: parts of the step left out on purpose (the tests' controls).

    >>> from hf_gradfix.parallel import ParallelDims
    >>> from hf_gradfix.plan import load_model_config
    >>> from hf_gradfix.plan.rl import RLRun
    >>> s = Settings(micro_batch=2, grad_accum=2, dtype="fp32", recompute="full",
    ...              rl=RLRun(prompt_len=8, completion_len=8, num_generations=2, beta=0.04))
    >>> r = simulate_rl(load_model_config("tiny-qwen2"), ParallelDims(1), s)
    >>> sorted(r["phases"]) == sorted(["generation", "ref log-probs", "forward", "backward", "optimizer"])
    True
    >>> r["peak"] == max(p["max"] for p in r["phases"].values()) == r["timeline"].peak
    True
    """
    say = progress or (lambda line: None)
    import torch
    from transformers import AutoModelForCausalLM

    from ..diagnostics.memory_timeline import timeline_tracker_class
    from .activations import (data_dependent_refused, decoder_layers, fake_kernel_mode, prepare_config,
                              set_trace_attention)
    from .trace_setup import _MAP, TRACED_MICRO_BATCHES, _make_optimizer

    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode", feature=_SIM)
    MemTracker = private("torch.distributed._tools.mem_tracker", "MemTracker", feature=_SIM)
    settings.check()
    mesh.check_model(config)
    check_rl_traceable(mesh, settings)
    rl = settings.rl
    t0 = time.perf_counter()
    amp = settings.dtype == "amp-bf16"
    dtype = torch.bfloat16 if settings.dtype == "bf16-pure" else torch.float32
    mb, ga = settings.micro_batch, settings.grad_accum
    P, C = rl.prompt_len, rl.completion_len
    spg = rl.steps_per_generation or ga
    g_rows = rl.generation_rows(mb, ga)
    packed = rl.forwards == "packed"
    compact = kernel == "triton"
    n_scored = math.ceil(mb * rl.completion_mean)  # completion tokens a chunk scores (the closed form's count)
    real = math.ceil(mb * (rl.prompt_mean + rl.completion_mean))  # a packed row's real tokens
    n_scored = min(n_scored, real - 1) if packed else min(n_scored, mb * (P + C - 1))
    old_forward = rl.old_forward(ga)
    ref_forward = rl.beta_value > 0

    class _RLTracker(timeline_tracker_class(MemTracker)):
        """The timeline tracker; while ``rl_phase`` is set every sample carries it (generation, old / ref log-prob
        forwards) and a forward there is no training micro-batch."""

        rl_phase: str | None = None
        rl_label = ""

        def _label(self):
            if self.rl_phase is not None:
                return self.rl_phase, self.rl_label
            return super()._label()

        def _root_forward_begins(self, module):
            micro = self._tl_micro
            super()._root_forward_begins(module)
            if self.rl_phase is not None:
                self._tl_micro = micro

        # a module that ran in a no-grad phase only (the head in generate) keeps torch's backward hooks from that
        # forward while its statistics were reset at the next root forward: no statistics to update for it
        def _pre_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._post_bw_hook(module, args)

    @contextlib.contextmanager
    def phase(tracker, name, label):
        tracker.rl_phase, tracker.rl_label = name, label
        try:
            yield
        finally:
            tracker.rl_phase = None

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if amp else contextlib.nullcontext

    def backbone(model, ids, **kw):
        return model.base_model(input_ids=ids, use_cache=False, **kw).last_hidden_state

    def row_inputs(ids, attention_mask):
        """One chunk's forward inputs as the trainer builds them: (input ids, labels, position ids or None)."""
        if not packed:  # TRL: labels = ids.masked_fill(mask == 0, -100); labels[:, :-C] = -100
            labels = ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-C] = -100
            return ids, labels, None
        # packing.rl_forwards (integration/rl/packing.pack_chunk): the chunk's real tokens in one row, positions
        # restarted per sample, labels on the completion tokens, int32 document bounds
        rows = ids.shape[0]
        flat_ids = ids.reshape(-1)[:real].clone()[None]
        positions = torch.arange(real)[None]
        labels = flat_ids.clone()
        labels[:, : real - n_scored] = -100
        cu = torch.zeros(rows + 1, dtype=torch.int32)
        return flat_ids, labels, (positions, cu)

    def log_probs(model, head_fn, ids, attention_mask, *, entropy: bool, keep_entropy: bool, tracker=None):
        """TRL's ``_get_per_token_logps_and_entropies`` over ``micro-batch`` rows per chunk: (log-probs, entropies)
        of the completions, ``(rows, C)``. ``entropy``: the model's head computes entropies; ``keep_entropy``: the
        caller asks for them (``compute_entropy``: the training forward only)."""
        all_lp, all_ent = [], []
        for start in range(0, ids.shape[0], mb):
            if tracker is not None:
                tracker.rl_label = f"{tracker.rl_phase}: chunk {start // mb + 1} backbone"
            chunk_ids, labels, packing = row_inputs(ids[start:start + mb], attention_mask[start:start + mb])
            with autocast():
                kw = {"position_ids": packing[0]} if packing else {}
                hidden = backbone(model, chunk_ids, **kw)
                if tracker is not None:
                    tracker.rl_label = f"{tracker.rl_phase}: chunk {start // mb + 1} fused head"
                lp, ent = _fused_head(torch, head_fn, model, hidden, labels, compact=compact, n_scored=n_scored,
                                      entropy=entropy)
                if not keep_entropy:
                    ent = None
            del hidden
            rows_here = min(mb, ids.shape[0] - start)
            if packing:  # rl_packing._scatter: the row's values back into TRL's (rows, C) layout
                idx = torch.arange(n_scored)
                r, c = idx % rows_here, idx % C
                lp, ent = (None if x is None else x[0].new_zeros((rows_here, C)).index_put((r, c), x[0][idx])
                           for x in (lp, ent))
                del idx, r, c
            else:
                lp, ent = lp[:, -C:], (None if ent is None else ent[:, -C:])
            all_lp.append(lp)
            if ent is not None:
                all_ent.append(ent)
            del lp, ent, labels, chunk_ids, packing
        return torch.cat(all_lp, 0), (torch.cat(all_ent, 0) if all_ent else None)

    def generate(tracker, model, prompt_ids):
        """transformers' ``generate`` (``_sample``, TRL's sampling defaults: no logits processor), greedy length:
        every completion ``C`` tokens (the longest the plan allows)."""
        from transformers import DynamicCache

        rows = prompt_ids.shape[0]
        cache = DynamicCache(config=config)
        ids = prompt_ids
        unfinished = torch.ones(rows, dtype=torch.long)
        positions = torch.arange(P).expand(rows, P).contiguous()  # from the mask's cumsum: per row
        # amp-bf16: accelerate wraps the prepared model's forward in autocast, generate's calls included (the
        # KV cache holds bf16 keys and values)
        with phase(tracker, "generation", "generation: prefill"), autocast():
            out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        del positions
        jump = all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
        decoded = 0
        with phase(tracker, "generation", "generation: decode step 1"):
            while True:
                logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
                del out
                probs = torch.nn.functional.softmax(logits, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                del probs, logits
                next_tokens = next_tokens * unfinished  # + pad_token_id * (1 - unfinished): no EOS here
                ids = torch.cat([ids, next_tokens[:, None]], dim=-1)
                del next_tokens
                if ids.shape[1] >= P + C:  # the last token is never fed back: C - 1 decode forwards
                    break
                missing = P + C - 1 - ids.shape[1]
                if jump and decoded == TRACED_DECODE_STEPS and missing > 0:
                    # decode steps are alike and the cache only grows: grow it (and the ids) to what the last
                    # decode step finds, then trace that step
                    tracker.rl_label = f"generation: cache grown to {P + C - 2} positions"
                    for layer in cache.layers:
                        for name in ("keys", "values"):
                            t = getattr(layer, name)
                            setattr(layer, name, torch.cat([t, t.new_zeros((*t.shape[:2], missing, t.shape[3]))],
                                                           dim=-2))
                            del t
                    ids = torch.cat([ids, ids.new_zeros((rows, missing))], dim=-1)
                    tracker.rl_label = f"generation: decode step {C - 1} (the last)"
                else:
                    tracker.rl_label = f"generation: decode step {decoded + 1}"
                position = torch.full((rows, 1), ids.shape[1] - 1)
                with autocast():
                    out = model(input_ids=ids[:, -1:], position_ids=position, past_key_values=cache,
                                use_cache=True, logits_to_keep=1)
                decoded += 1
                del position
        del cache  # freed when generate returns
        return ids

    def generate_and_score(tracker, model, ref, head_fn):
        """``_generate_and_score_completions``: the generation batch's buffered inputs."""
        prompt_ids = torch.randint(3, config.vocab_size, (g_rows, P))
        prompt_mask = torch.ones(g_rows, P, dtype=torch.long)
        with torch.no_grad():
            prompt_completion_ids = generate(tracker, model, prompt_ids)
        completion_ids = prompt_completion_ids[:, P:]
        # TRL: everything after the first EOS masked (int)
        completion_mask = torch.ones(g_rows, C, dtype=torch.int)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
               "completion_mask": completion_mask}
        with torch.no_grad():
            if old_forward and "old" not in _omit:
                with phase(tracker, "old log-probs", "old log-probs"):
                    out["old_per_token_logps"] = log_probs(model, head_fn, ids, attention_mask, entropy=True,
                                                                  keep_entropy=False, tracker=tracker)[0]
            if ref_forward and "reference" in _omit:  # a control: the log-probs without the forward that makes them
                out["ref_per_token_logps"] = torch.zeros(g_rows, C)
            elif ref_forward:
                with phase(tracker, "ref log-probs", "ref log-probs"):
                    out["ref_per_token_logps"] = log_probs(ref, head_fn, ids, attention_mask, entropy=False,
                                                                  keep_entropy=False, tracker=tracker)[0]
        del ids, attention_mask
        out["advantages"] = torch.zeros(g_rows)
        # shuffle_sequence_dict (a permuted copy of each), then split_tensor_dict: steps_per_generation views
        perm = torch.randperm(g_rows)
        out = {k: v[perm] for k, v in out.items()}
        return [{k: v[i * mb:(i + 1) * mb] for k, v in out.items()} for i in range(spg)]

    def training_micro_batch(model, head_fn, inputs):
        """``_compute_loss`` (dapo, TRL's default) and its backward."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        logps, entropies = log_probs(model, head_fn, input_ids, attention_mask, entropy=True, keep_entropy=True)
        del input_ids, attention_mask
        advantages = inputs["advantages"].unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        coef_1 = torch.exp(logps - old)
        coef_2 = torch.clamp(coef_1, 1 - _EPSILON_LOW, 1 + _EPSILON_HIGH)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if ref_forward:
            ref_lp = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_lp - logps) - (ref_lp - logps) - 1
            per_token_loss = per_token_loss + rl.beta_value * per_token_kl
            del per_token_kl
        loss = (per_token_loss * mask).sum() / max(1.0, float(g_rows * C) * ga / spg)
        del per_token_loss, coef_1, coef_2, old, logps, entropies, advantages, mask
        loss.backward()
        del loss

    source_config, config = config, prepare_config(config)
    with _trl_head(kernel) as head_fn, FakeTensorMode(), data_dependent_refused(config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.train()
        set_trace_attention(model, settings.attention)
        if settings.recompute == "full":  # GRPOConfig's gradient_checkpointing (non-reentrant)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # transformers then makes the embeddings' output require grad (enable_input_require_grads), also in
            # the no-grad forwards (generate, old log-probs), where torch's module tracker would keep that leaf
            # alive through its backward hooks: one tokens x hidden tensor per forward that a real run frees.
            # Without gradients the flag changes nothing else, so the trace takes it back there.
            def _no_grad_leaf(module, args, output):
                if not torch.is_grad_enabled() and output.requires_grad and output.is_leaf:
                    output.requires_grad_(False)

            model.get_input_embeddings().register_forward_hook(_no_grad_leaf)
        ref = None
        if ref_forward:  # TRL loads the reference model in the policy's dtype, in eval mode; it runs under no_grad only (its
            # parameters keep requires_grad: torch's tracker hooks every parameter a forward uses)
            ref = AutoModelForCausalLM.from_config(prepare_config(source_config), dtype=dtype).eval()
            set_trace_attention(ref, settings.attention)
        opt = _make_optimizer(model, settings)
        say(f"policy{' and reference model' if ref is not None else ''} built under fake tensors "
            f"({time.perf_counter() - t0:.1f} s); tracing the RL step ...")
        tracker = _RLTracker()
        tracker.timeline_setup([m for _, m in decoder_layers(model)], torch.device("cpu"))
        tracker.track_external(*(x for x in (model, opt, ref) if x is not None))
        traced = min(ga, TRACED_MICRO_BATCHES)
        with tracker, fake_kernel_mode():
            # a first optimizer step makes the optimizer state (one micro-batch, no generation)
            warm = {"prompt_ids": torch.randint(3, config.vocab_size, (mb, P)),
                    "prompt_mask": torch.ones(mb, P, dtype=torch.long),
                    "completion_ids": torch.randint(3, config.vocab_size, (mb, C)),
                    "completion_mask": torch.ones(mb, C, dtype=torch.int), "advantages": torch.zeros(mb)}
            if ref_forward:
                warm["ref_per_token_logps"] = torch.zeros(mb, C)
            training_micro_batch(model, head_fn, warm)
            opt.step()
            opt.zero_grad()
            del warm
            tracker.reset_mod_stats()
            tracker._peak_mem.clear(); tracker._peak_mem_snap.clear()
            tracker.timeline_sample(("other", "step start"))
            tracker.timeline_on()
            buffered = None
            for i in range(traced):
                if i % spg == 0:
                    say(f"tracing a generation batch ({g_rows} samples, prompt {P:,} + completion {C:,} tokens) and "
                        "its log-prob forwards ...")
                    buffered = generate_and_score(tracker, model, ref, head_fn)
                    say(f"generation batch traced ({g_rows} samples; {time.perf_counter() - t0:.1f} s)")
                training_micro_batch(model, head_fn, buffered[i % spg])
            opt.step()
            opt.zero_grad()
            del buffered
            tracker.timeline_on(False)
            tracker.timeline_sample(("other", "after step"))
            after_snap = tracker.get_tracker_snapshot()
        peak_snap = tracker.get_tracker_snapshot("peak")
    say(f"RL step traced ({traced} micro-batch(es) of {ga}; {time.perf_counter() - t0:.1f} s)")

    def by_component(snapshot):
        out: dict[str, int] = {}
        for k, v in snapshot.items():
            key = getattr(k, "value", k)
            if key != "Total":
                out[_MAP.get(key, "other")] = out.get(_MAP.get(key, "other"), 0) + v
        return out

    timeline = tracker.timeline(source="fake-tensor trace", title=f"rank 0 of {mesh.world_size}")
    timeline.meta.update(grad_accum=ga, micro_batches_traced=traced, rl=rl.trainer, kernel=kernel,
                         rl_forwards=rl.forwards, generation_rows=g_rows)
    start = timeline.totals[0]
    phases: dict[str, dict[str, int]] = {}
    for i, (ph, total) in enumerate(zip(timeline.phases, timeline.totals)):
        if ph == "other":
            continue
        entry = phases.setdefault(ph, {"max": 0, "first": i})
        if total > entry["max"]:
            entry["max"] = total
    for entry in phases.values():
        entry["above_start"] = entry["max"] - start
        entry.pop("first")
    snap = next(iter(peak_snap.values()))
    return {"peak": snap["Total"], "at_peak": by_component(snap), "phase": timeline.peak_phase, "phases": phases,
            "start": start, "after_step": by_component(next(iter(after_snap.values()))), "timeline": timeline,
            "max": {c: max(v) for c, v in timeline.series.items() if any(v)},
            "seconds": time.perf_counter() - t0}


_BANDS = {"generation": "#D9EAD3", "old log-probs": "#FFF2CC", "ref log-probs": "#FCE5CD", "forward": "#DCE9F5",
          "backward": "#F8E1CF", "optimizer": "#F5D0D0", "other": "#EEEEEE"}


def plot_rl_timeline(tl, path: str, *, estimate: dict | None = None, gpu_memory: float | None = None,
                     title: str = "", phases_estimate: dict | None = None) -> str:
    """The RL step's timeline: categories stacked over the step's events, a band per RL phase along the top
    (generation, old / ref log-probs, each training micro-batch's forward and backward, the optimizer step), the
    peak and what is live there, and the closed form's components beside it. Writes ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlanError("--timeline needs matplotlib: pip install matplotlib (or drop --timeline)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from ..diagnostics.memory_timeline import _COLORS, CATEGORIES, _event_x, _with_gpu_in_scale, draw_gpu_reference

    xs, events = _event_x(tl)
    top = _with_gpu_in_scale(max([tl.peak] + ([sum(estimate.values())] if estimate else [])), gpu_memory)
    unit, div = next((u, d) for u, d in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))
                     if top >= 2 * d or d == 1)
    cats = [c for c in CATEGORIES if any(tl.series[c])]
    fig, (ax, axb) = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True,
                                  gridspec_kw={"width_ratios": [10, 1], "wspace": 0.03})
    handles = ax.stackplot(xs, [[v / div for v in tl.series[c]] for c in cats], colors=[_COLORS[c] for c in cats],
                           labels=[c.replace("_", " ") for c in cats], lw=0)
    ymax = top / div * 1.45
    x_end = events[-1]["x1"]
    ax.set_ylim(0, ymax)
    ax.set_xlim(0, x_end)
    k = 0
    while k < len(events):  # one band per run of the same phase (and micro-batch in training)
        ph, micro = events[k]["phase"], events[k].get("micro_batch")
        j = k
        while j + 1 < len(events) and events[j + 1]["phase"] == ph and (
                ph not in ("forward", "backward") or events[j + 1].get("micro_batch") == micro):
            j += 1
        a, b = events[k]["x0"], events[j]["x1"]
        ax.axvspan(a, b, ymin=0.93, ymax=1.0, color=_BANDS.get(ph, "#EEEEEE"), lw=0)
        if ph != "other":
            short = {"generation": "gen", "old log-probs": "old", "ref log-probs": "ref", "forward": "fw",
                     "backward": "bw", "optimizer": "opt"}[ph]
            name = ph if b - a >= x_end * 0.12 else short
            if ph in ("forward", "backward") and micro:
                name += f" {micro}"
            ax.text((a + b) / 2, ymax * 0.965, name, ha="center", va="center", fontsize=7.5)
            ax.axvline(a, color="#999999", lw=0.5)
        k = j + 1
    pi = tl.peak_index
    px, py = xs[pi], tl.peak / div
    live = sorted(((v, c) for c, v in tl.at_peak.items() if v), reverse=True)
    text = f"peak {py:.3g} {unit}: {tl.phases[pi]} ({tl.labels[pi]})\n" + "\n".join(
        f"  {c.replace('_', ' ')} {v / div:.3g}" for v, c in live[:6])
    right = px > x_end * 0.55
    ax.annotate(text, (px, py), xytext=(px + (-0.04 if right else 0.04) * x_end, ymax * 0.9), fontsize=7.5,
                ha="right" if right else "left", va="top", multialignment="left",
                arrowprops=dict(arrowstyle="->", color="k", lw=0.8),
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#666666"))
    ax.plot([px], [py], marker="o", color="k", ms=4)
    lines = draw_gpu_reference([ax, axb], gpu_memory, top, div, unit, ymax)
    ax.set_xticks([])
    ax.set_xlabel("the RL step's events: generation (prefill, decode), the no-grad log-prob forwards, each traced "
                  "training micro-batch (forward, backward), the optimizer step", fontsize=8)
    ax.set_ylabel(unit)
    extra = []
    if estimate:
        comps = [c for c in ("parameters", "reference_model", "master_weights", "gradients", "optimizer_state",
                             "activations", "comm_buffers", "fragmentation") if estimate.get(c)]
        bottom = 0.0
        for c in comps:
            v = estimate[c] / div
            axb.bar(0, v, bottom=bottom, color=_COLORS.get(c, "#4C72B0" if c == "reference_model" else "#BBBBBB"),
                    width=0.7, hatch="//" if c in ("master_weights", "fragmentation", "reference_model") else None,
                    edgecolor="white", lw=0.3)
            bottom += v
        axb.text(0, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=8)
        extra = [Patch(facecolor=_COLORS.get(c, "#4C72B0"), hatch="//", edgecolor="white", label=c.replace("_", " "))
                 for c in comps if c in ("master_weights", "fragmentation", "reference_model")]
    axb.set_xticks([0], ["closed\nform"], fontsize=8)
    axb.set_xlim(-0.6, 0.6)
    axb.tick_params(axis="y", left=False)
    items = list(handles) + extra + lines
    fig.legend(handles=items, fontsize=7.5, loc="lower center", ncol=min(len(items), 9), frameon=False)
    ax.set_title(title or tl.title, fontsize=10)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.93, bottom=0.17)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
