"""Memory of the lean loss head (``loss.head: lean``, :mod:`hf_gradfix.loss.lean_head`) for the planner.

The stock head keeps a micro-batch's ``(tokens, vocab)`` logits, the loss's fp32 log-softmax and, during the loss's
backward, two more fp32 ``tokens x vocab`` tensors. The lean head never holds them; what it holds depends on its
path:

* **torch's op** (fp32 / fp64 inputs, torch >= 2.13: ``F.linear_cross_entropy`` with
  ``LinearCrossEntropyOptions(acc_policy="accurate")``). Its forward computes the gradients too and keeps them for
  the backward (``kept``): the hidden states' (``N x H``), the head weight's (``V x H``) and the bias's (``V``), in
  the input dtype. While it runs (``transient``) it also holds a ``V x H`` weight-gradient scratch and one chunk's
  logits (``rows x V``, plus ``rows``), ``rows`` from torch's "aspect_ratio:2" rule (its default for these calls:
  the next power of two >= ``ceil(N / ceil(V / H))``, halved, at most ``N``).
* **chunks** (bf16 / fp16 inputs or autocast, and torch < 2.13): :data:`~hf_gradfix.loss.lean_head.FALLBACK_CHUNK_TOKENS`
  tokens at a time, checkpointed, as the stock head computes them. The checkpoints keep their input, the final
  hidden states (``N x H``, ``kept``: nothing else holds them after the forward); the transient is one chunk's recomputation and backward, whose peak is the log-softmax backward: the
  saved fp32 log-softmax, its incoming fp32 gradient and the fp32 gradient it returns (``rows x V x 12``; the
  compute-dtype logits are freed by then), plus the weight cast to the compute dtype and its gradient when the
  weight is stored wider (autocast over fp32 weights).

Checked against the process's measured peak (tests/plan/test_plan_lean_head.py).

>>> b = lean_head_bytes(8192, 4096, 128256, compute_bytes=4, weight_bytes=4)
>>> b["path"], b["rows"], b["kept"] == 4 * (8192 * 4096 + 128256 * 4096)
('torch', 128, True)
>>> lean_head_bytes(8192, 4096, 128256, compute_bytes=2, weight_bytes=4)["path"]
'chunks'
"""

from __future__ import annotations

__all__ = ["FALLBACK_ROWS", "lean_head_bytes", "stock_head_reason", "torch_chunk_rows"]

#: hf_gradfix.loss.lean_head.FALLBACK_CHUNK_TOKENS (kept equal by a test; the planner does not import the loss code)
FALLBACK_ROWS = 1024


def torch_chunk_rows(tokens: int, hidden: int, vocab: int, factor: int = 2) -> int:
    """Rows per chunk of torch's ``linear_cross_entropy`` under its "aspect_ratio:N" rule (N = ``factor``)."""
    inc = -(-vocab // hidden)
    target = -(-tokens // inc)
    return max(1, min((1 << (target - 1).bit_length()) // factor, tokens))


def lean_head_bytes(tokens: int, hidden: int, vocab: int, *, compute_bytes: int, weight_bytes: int,
                    hidden_bytes: int | None = None, torch_op: bool = True, bias: bool = False) -> dict:
    """``{"path", "rows", "kept", "transient"}`` of the lean head over ``tokens`` positions of one micro-batch.

    ``compute_bytes``: the head's matmul dtype (autocast's, else the weights'); ``weight_bytes``: the stored weight;
    ``hidden_bytes``: the final hidden states' (default ``compute_bytes``; fp32 under autocast); ``torch_op``: the
    installed torch has ``linear_cross_entropy`` (>= 2.13).
    """
    n, h, v = int(tokens), int(hidden), int(vocab)
    if torch_op and compute_bytes >= 4 and weight_bytes == compute_bytes:
        e = compute_bytes
        rows = torch_chunk_rows(n, h, v)
        kept = e * (n * h + v * h + (v if bias else 0))
        transient = e * (v * h + rows * v + rows)
        return {"path": "torch", "rows": rows, "kept": float(kept), "transient": float(transient)}
    rows = min(n, FALLBACK_ROWS)
    transient = rows * v * 12
    if weight_bytes != compute_bytes:
        transient += 2 * v * h * compute_bytes  # the weight cast for the chunk and its gradient in that dtype
    kept = n * h * (hidden_bytes or compute_bytes)
    return {"path": "chunks", "rows": rows, "kept": float(kept), "transient": float(transient)}


def stock_head_reason(*, rl: str | None = None, tp: int = 1, pp_stage: bool = False, fsdp: bool = False,
                      schedule: str = "1f1b") -> str | None:
    """Why ``loss.head: lean`` runs the stock head in this layout: the one reason that applies (in the order the
    run decides it), or None where the lean head runs.

    ``rl``: a TRL trainer (``"grpo"`` / ``"rloo"``); ``pp_stage``: the head sits on a pipeline stage (``fsdp``: FSDP2
    shards that stage, ``schedule``: its schedule). Without pp, FSDP2 unshards the head for its forward, where the lean
    head reads it (hf_gradfix/integration/lean_head.py), so it runs lean; under pp the loss function applies the head
    outside the stage's forward (hf_gradfix/integration/parallel/pipeline.py).

    >>> stock_head_reason(tp=1, fsdp=True) is None
    True
    >>> stock_head_reason(rl="grpo")
    "TRL's GRPOTrainer computes its loss with its own fused LM head (loss.head applies to the Trainer's default loss)"
    """
    if rl is not None:
        trainer = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}.get(rl, rl)
        return (f"TRL's {trainer} computes its loss with its own fused LM head (loss.head applies to the Trainer's "
                "default loss)")
    if pp_stage and fsdp:
        return "FSDP2 (dp_shard > 1) shards the last pipeline stage's head outside the stage's forward"
    if tp > 1:
        return f"tp={tp}: tensor parallel shards the head (a DTensor inside its forward)"
    if pp_stage and schedule == "zero_bubble":
        return ("the zero-bubble schedule runs the last stage's backward twice (input, then weight gradients), which "
                "torch's linear_cross_entropy refuses")
    return None
