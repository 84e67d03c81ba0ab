"""RL runs: what a rank holds in each phase of a TRL 1.16 ``GRPOTrainer`` / ``RLOOTrainer`` step.

A GRPO / RLOO step has three phases that never overlap, on top of the model state (weights, master copy,
gradients, optimizer state), the reference model (``beta > 0``) and the communication buffers, which live
throughout:

1. **generation** (``transformers.generate``, no gradients): the local generation batch,
   ``per_device_train_batch_size x steps_per_generation`` samples, each a left-padded prompt of up to ``P`` tokens
   and up to ``C`` generated ones. transformers' ``DynamicCache`` keeps ``2 x kv_heads x head_dim`` elements per
   layer and position; after the last step it holds ``P + C - 1`` positions (the last token is never fed back),
   and the last step's ``torch.cat`` holds one layer's keys (then values) twice. Before it, the prefill runs the
   prompts' ``P`` positions through the backbone with the cache so far (``P`` positions) alive. Under DeepSpeed
   ZeRO-3 TRL gathers the whole model for generation (``ds3_gather_for_generation``, on by default). The KV cache
   is freed when generation returns.
2. **no-grad log-prob forwards** (``_generate_and_score_completions``): the old policy's (RLOO always; GRPO when
   ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation``) and the reference model's
   (``beta > 0``), chunk by chunk (``per_device_train_batch_size`` rows): the backbone's no-grad peak
   (:func:`~hf_gradfix.plan.activations.trace_inference`), then the fused head on its output.
3. **the training step**: every micro-batch's forward and backward with TRL's fused LM head
   (``add_fused_lm_head``) in place of the ``(rows, positions, vocabulary)`` logits and their loss gradients.

TRL's fused head (``trl/kernels/chunked_logprob.py``, ``ChunkedLogProbFunction``) projects the scored positions
through the head in tiles of ``4096`` positions (``TOKEN_CHUNK_SIZE``) x ``32768`` vocabulary columns
(``_CHUNKED_LOGPROB_CHUNK_SIZE`` in ``trl/trainer/utils.py``): its tile buffer ``mm_buf`` is allocated
``min(N, 4096) x 32768`` in the compute dtype (autocast's, else the hidden states'), **even for a smaller
vocabulary**; a larger one runs through the same buffer 32768 columns at a time. On a Triton device (CUDA, XPU) it
scores only the ``N`` positions whose label is set (the completion tokens) and gathers their hidden states
(``hidden[mask]``, saved for backward); elsewhere it scores every position. Its backward rebuilds each tile and
accumulates the hidden-state and head-weight gradients in fp32.

Rows: padded (TRL's own layout), ``per_device_train_batch_size`` rows of ``P + C`` positions (the generation
batch's longest prompt and completion); packed (``packing.rl_forwards``), one row of the chunk's real tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RLRun", "TOKEN_TILE", "VOCAB_TILE", "fused_head_bytes", "kv_cache_bytes", "TRAINERS"]

TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE (TRL 1.16)
VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (TRL 1.16): the tile buffer's width
TRAINERS = ("grpo", "rloo")
DEFAULT_BETA = {"grpo": 0.0, "rloo": 0.05}  # GRPOConfig.beta / RLOOConfig.beta (TRL 1.16)
MAX_LEN = 2**24


@dataclass
class RLRun:
    """A TRL 1.16 GRPO / RLOO run as the planner needs it (``Settings.rl``).

    The micro-batch is ``Settings.micro_batch`` (``per_device_train_batch_size``); the row length ``prompt_len +
    completion_len`` replaces ``Settings.seq_len``.
    """

    trainer: str = "grpo"  # grpo | rloo
    prompt_len: int = 512  # the generation batch's longest prompt (TRL pads to it)
    completion_len: int = 512  # the longest completion (max_completion_length)
    num_generations: int = 8  # completions per prompt (the generation batch over every rank is a multiple)
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps (TRL's default)
    beta: float | None = None  # KL coefficient; > 0 loads a reference model. None: the trainer's default
    forwards: str = "padded"  # padded (TRL's layout) | packed (packing.rl_forwards: one row of the real tokens)
    # mean lengths over the generation batch (the real tokens of a packed row, the positions the fused head scores
    # on a GPU); None: the maximum (every sample as long as the longest, no padding)
    mean_prompt_len: float | None = None
    mean_completion_len: float | None = None

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def beta_value(self) -> float:
        return DEFAULT_BETA[self.trainer] if self.beta is None else float(self.beta)

    @property
    def prompt_mean(self) -> float:
        return float(self.prompt_len if self.mean_prompt_len is None else self.mean_prompt_len)

    @property
    def completion_mean(self) -> float:
        return float(self.completion_len if self.mean_completion_len is None else self.mean_completion_len)

    def check(self) -> None:
        from .common import PlanError

        if self.trainer not in TRAINERS:
            raise PlanError(f"--rl {self.trainer!r}: choose one of {', '.join(TRAINERS)}")
        for flag, value, low in (("--prompt-len", self.prompt_len, 1), ("--completion-len", self.completion_len, 1),
                                 ("--num-generations", self.num_generations, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_LEN:
                raise PlanError(f"{flag} {value!r}: invalid value; it must be a whole number >= {low} and <= {MAX_LEN}")
        spg = self.steps_per_generation
        if spg is not None and (isinstance(spg, bool) or not isinstance(spg, int) or not 1 <= spg <= 2**20):
            raise PlanError(f"--steps-per-generation {spg!r}: invalid value; it must be a whole number >= 1 and "
                            "<= 1048576")
        if self.beta is not None and not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta)
                                          and self.beta >= 0):
            raise PlanError(f"--beta {self.beta!r}: invalid value; give a number >= 0 (0: no reference model)")
        if self.forwards not in ("padded", "packed"):
            raise PlanError(f"--rl-forwards {self.forwards!r}: padded | packed")
        for flag, mean, top in (("--mean-prompt-len", self.mean_prompt_len, self.prompt_len),
                                ("--mean-completion-len", self.mean_completion_len, self.completion_len)):
            if mean is not None and not (isinstance(mean, (int, float)) and math.isfinite(mean) and 1 <= mean <= top):
                raise PlanError(f"{flag} {mean!r}: invalid value; it must lie between 1 and the maximum length "
                                f"({top}; {flag.replace('mean-', '')})")

    def generation_rows(self, micro_batch: int, grad_accum: int) -> int:
        """Samples per rank in one generation batch: ``per_device_train_batch_size x steps_per_generation``."""
        return micro_batch * (self.steps_per_generation or grad_accum)

    def old_forward(self, grad_accum: int) -> bool:
        """Whether the old policy's log-probs are computed (RLOO: always; GRPO: when the optimizer window is not
        a whole number of generation batches, ``gradient_accumulation_steps % steps_per_generation != 0``; with
        ``num_iterations`` 1)."""
        return self.trainer == "rloo" or grad_accum % (self.steps_per_generation or grad_accum) != 0


def fused_head_bytes(n_scored: int, hidden_size: int, vocab: int, *, hidden_bytes: int, weight_bytes: int,
                     compute_bytes: int, entropy: bool = True, weight_grad_fresh: bool = True) -> dict:
    """Bytes of TRL 1.16's ``ChunkedLogProbFunction`` over ``n_scored`` positions on a Triton device (the GPU path).

    * ``tile``: its buffer, ``min(N, 4096) x 32768`` elements of the compute dtype (allocated that wide even when
      the vocabulary is smaller);
    * ``inputs``: what TRL's wrapper hands it, the gathered hidden states ``hidden[mask]`` (``N x hidden``) and
      their labels (int64);
    * ``forward``: the forward's working set on top of the inputs: the tile, seven fp32 running statistics per
      position, and the compute-dtype copies of one hidden chunk and one 32768-row weight chunk when the dtypes
      differ (autocast over fp32 weights);
    * ``saved``: what the forward leaves for backward besides the inputs: ``log_z`` and the entropy (fp32);
    * ``backward``: the backward's working set on top of the inputs and ``saved``: the tile, the chunk copies, the
      fp32 accumulators of the hidden-state gradient (``N x hidden``) and of the head weight's (``vocab x hidden``;
      ``weight_grad_fresh=False`` when that fp32 tensor becomes the weight's ``.grad`` itself: fp32 weights, no
      ``.grad`` yet), the incoming log-prob gradient, and at its return the gradients cast back to the hidden
      states' and the weight's dtypes.

    >>> b = fused_head_bytes(8192, 4096, 128256, hidden_bytes=2, weight_bytes=2, compute_bytes=2)
    >>> b["tile"] == 4096 * 32768 * 2, b["backward"] > b["tile"] + 128256 * 4096 * 4
    (True, True)
    >>> fused_head_bytes(100, 64, 500, hidden_bytes=4, weight_bytes=4, compute_bytes=4)["tile"] == 100 * 32768 * 4
    True
    """
    n, h, v = int(n_scored), int(hidden_size), int(vocab)
    rows = min(n, TOKEN_TILE)
    tile = rows * VOCAB_TILE * compute_bytes
    casts = (rows * h * compute_bytes if hidden_bytes != compute_bytes else 0) + (
        min(v, VOCAB_TILE) * h * compute_bytes if weight_bytes != compute_bytes else 0)
    inputs = n * h * hidden_bytes + 8 * n
    forward = tile + casts + 7 * 4 * n
    saved = 4 * n * (2 if entropy else 1)
    grad_hidden = n * h * 4 + (n * h * hidden_bytes if hidden_bytes != 4 else 0)
    grad_weight = (v * h * 4 if weight_grad_fresh or weight_bytes != 4 else 0) + (
        v * h * weight_bytes if weight_bytes != 4 else 0)
    backward = tile + casts + grad_hidden + grad_weight + 4 * n
    return {"tile": float(tile), "casts": float(casts), "inputs": float(inputs), "forward": float(forward),
            "saved": float(saved), "backward": float(backward), "rows": rows}


def kv_cache_bytes(config, rows: int, positions: int, elem_bytes: int, tp: int = 1) -> tuple[float, float, str]:
    """(bytes of transformers' ``DynamicCache`` holding ``positions`` positions of ``rows`` samples, the largest
    layer's share, how). Per layer ``2 x kv_heads x head_dim`` elements per position; sliding-window and chunked
    layers keep at most their window (transformers' ``DynamicSlidingWindowLayer``); KV-sharing and attention-free
    layers none; tensor parallelism splits the KV heads.

    >>> from hf_gradfix.plan import load_model_config
    >>> kv_cache_bytes(load_model_config("tiny-llama"), rows=4, positions=100, elem_bytes=2)[0] == 4 * 100 * 2 * 2 * 2 * 32 * 2
    True
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    n_layers = text.num_hidden_layers
    try:  # transformers' own rule for which cache layer each decoder layer gets
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(text)
        windows = [kw.get("sliding_window") for kw in kwargs]
    except Exception:  # noqa: BLE001 - an older transformers: every layer a full one
        types, windows = ["full_attention"] * n_layers, [None] * n_layers
    per_pos = 2 * math.ceil(kv_heads / tp) * head_dim * elem_bytes * rows
    sizes, kinds = [], set()
    for kind, window in zip(types, windows):
        if kind == "dummy":
            sizes.append(0)
            continue
        kinds.add(kind)
        keep = min(positions, int(window)) if window else positions
        sizes.append(per_pos * keep)
    how = (f"{rows} samples x {positions:,} positions x {sum(1 for s in sizes if s)} layers x 2 x {kv_heads} kv heads"
           f"{' / tp ' + str(tp) if tp > 1 else ''} x {head_dim} x {elem_bytes} B")
    if kinds - {"full_attention"}:
        how += f" ({', '.join(sorted(kinds - {'full_attention'}))} layers: at most their window)"
    return float(sum(sizes)), float(max(sizes, default=0)), how


def training_head(config, rl: RLRun, *, micro_batch: int, rows: int, row_len: int, hidden_bytes: int,
                  weight_bytes: int, compute_bytes: int, weight_grad_fresh: bool) -> dict:
    """TRL's fused head on one micro-batch (``rows x row_len`` positions; it scores ``micro_batch x mean completion``
    of them): what the training forward keeps for backward (``kept``), the backward's working set (``transient``),
    and a no-grad forward's working set on top of the backbone's output (``no_grad``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, v = text.hidden_size, text.vocab_size
    n = math.ceil(micro_batch * rl.completion_mean)
    fh = fused_head_bytes(n, h, v, hidden_bytes=hidden_bytes, weight_bytes=weight_bytes, compute_bytes=compute_bytes,
                          weight_grad_fresh=weight_grad_fresh)
    # TRL's wrapper scatters log-probs and entropies back to (rows, row_len - 1) fp32 (the loss keeps views of
    # them) and masks the labels (bool, saved by masked_scatter)
    outputs = rows * (row_len - 1) * (2 * 4 + 1)
    # after the kernel's backward: the gathered positions' gradient, scattered into (rows, row_len - 1, hidden)
    # zeros (index backward), then into (rows, row_len, hidden) zeros (slice backward)
    scatter = (n + rows * (row_len - 1) + rows * row_len) * h * hidden_bytes
    return {"n": n, "fused": fh, "outputs": float(outputs), "kept": fh["inputs"] + fh["saved"] + outputs,
            "transient": max(fh["backward"], float(scatter)), "no_grad": fh["inputs"] + fh["forward"] + outputs}


def plan_phases(config, rl: RLRun, *, micro_batch: int, grad_accum: int, rows: int, row_len: int, training: float,
                head: dict, trace_dtype: str, attention: str, elem_bytes: int, tp: int,
                gather_for_generation: float = 0.0) -> dict:
    """The three phases of a step (module docstring), each its bytes on top of what lives throughout, and which
    one is the peak."""
    from .activations import trace_inference

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    v = text.vocab_size
    fmt = _fmt
    # no-grad log-prob forwards: one chunk of per_device_train_batch_size rows at a time
    inf = trace_inference(config, micro_batch=rows, seq_len=row_len, dtype=trace_dtype, attention=attention)
    no_grad = max(inf.peak, inf.output + head["no_grad"])
    which = (["old policy"] if rl.old_forward(grad_accum) else []) + (["reference"] if rl.beta_value > 0 else [])
    fused = head["fused"]
    tile_txt = f"{fused['rows']:,} x {VOCAB_TILE:,} tile {fmt(fused['tile'])}"
    ng_how = (f"{' + '.join(which) if which else 'none run'}: a chunk of {rows} x {row_len:,}: backbone peak "
              f"{fmt(inf.peak)}, or its output {fmt(inf.output)} + the fused head ({tile_txt})")
    if not which:
        no_grad = 0.0
    # generation: the local generation batch, prefill of the prompts, then one token at a time
    g_rows = rl.generation_rows(micro_batch, grad_accum)
    pre = trace_inference(config, micro_batch=g_rows, seq_len=rl.prompt_len, dtype=trace_dtype, attention=attention,
                          generation=True)
    kv_p, _, _ = kv_cache_bytes(config, g_rows, rl.prompt_len, elem_bytes, tp)
    final = rl.prompt_len + rl.completion_len - 1
    kv_t, kv_layer, kv_how = kv_cache_bytes(config, g_rows, final, elem_bytes, tp)
    logits = g_rows * v * (elem_bytes + 4)  # the last position's logits and generate's fp32 copy of them
    prefill = kv_p + max(pre.peak, pre.output + logits)
    decode = kv_t + kv_layer / 2 + logits  # DynamicLayer.update: torch.cat of the keys, then of the values
    generation = max(prefill, decode) + gather_for_generation
    gen_how = (f"KV cache {fmt(kv_t)} ({kv_how}) + the last step's copy of one layer's keys {fmt(kv_layer / 2)} + logits "
               f"{fmt(logits)}" if decode >= prefill else
               f"prefill of {g_rows} x {rl.prompt_len:,}: KV cache {fmt(kv_p)} + backbone peak {fmt(pre.peak)} "
               f"(full cache after the last token: {fmt(kv_t)}, {kv_how})")
    if gather_for_generation:
        gen_how += f" + the ZeRO-3 gather of every weight for generate {fmt(gather_for_generation)}"
    phases = {"generation": {"bytes": generation, "how": gen_how, "kv_cache": kv_t, "kv_cache_prefill": kv_p,
                             "prefill_peak": pre.peak, "rows": g_rows},
              "no_grad": {"bytes": no_grad, "how": ng_how, "forwards": which, "backbone_peak": inf.peak,
                          "backbone_output": inf.output},
              "training": {"bytes": training, "how": ""}}
    peak_phase = max(phases, key=lambda k: phases[k]["bytes"])
    return {"phases": phases, "peak_phase": peak_phase, "peak": phases[peak_phase]["bytes"]}


def _fmt(b: float) -> str:
    from .common import _fmt as fmt

    return fmt(b)
