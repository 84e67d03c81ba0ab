"""The planner's count of the lean head (``hf_gradfix.plan.lean_head``) against what the head really allocates.

Ground truth: the process's resident high-water mark during one forward + backward of the lean head on real
tensors (``tests/plan_lean_head_probe.py``, one process per measurement; glibc's mmap threshold fixed at 64 KiB so
that every large buffer is mapped at allocation and returned at its free, so the high-water mark is the live peak).
The formula plus the gradients the probe's tensors receive must be within 10 % of it; the control: the other path's
formula for the same shapes misses by more than that. The planner's totals use it (``--loss-head lean``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_gradfix.plan.lean_head import FALLBACK_ROWS, lean_head_bytes, torch_chunk_rows

HERE = Path(__file__).parent
TOL = 0.10


def _measure(tokens: int, hidden: int, vocab: int, mode: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "plan_lean_head_probe.py"), str(tokens), str(hidden), str(vocab),
                           mode], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("tokens,hidden,vocab,mode", [(4096, 256, 32000, "fp32"), (4096, 256, 32000, "bf16-autocast")])
def test_formula_is_the_measured_peak_of_the_head(tokens, hidden, vocab, mode):
    from hf_gradfix.loss.lean_head import has_torch_linear_cross_entropy

    if mode == "fp32" and not has_torch_linear_cross_entropy():
        pytest.skip("torch's op path needs torch >= 2.13")
    compute = 4 if mode == "fp32" else 2
    got = _measure(tokens, hidden, vocab, mode)
    this = lean_head_bytes(tokens, hidden, vocab, compute_bytes=compute, weight_bytes=4)
    if this["path"] == "torch":  # control: the chunks path's count for the same shapes
        other = {"kept": 0.0, "transient": float(min(tokens, FALLBACK_ROWS) * vocab * 12)}
    else:  # control: torch's op's count (its precomputed gradients and scratch) in the compute dtype
        rows = torch_chunk_rows(tokens, hidden, vocab)
        other = {"kept": float(compute * (tokens * hidden + vocab * hidden)),
                 "transient": float(compute * (vocab * hidden + rows * vocab + rows))}
    # torch's op keeps its precomputed gradients and hands them back as the gradients; the chunks keep their input
    # (the probe's own hidden states, allocated before the measurement) and the backward allocates the gradients
    def err(b, torch_path):
        held = b["kept"] if torch_path else got["grads"]
        return abs(held + b["transient"] - got["peak"]) / got["peak"]

    assert err(this, this["path"] == "torch") <= TOL, (this, got)
    # control: the count of the other path does not pass
    assert err(other, this["path"] != "torch") > TOL, (other, got)


def test_chunk_rows_are_torchs_own():
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options_cls is None or not hasattr(options_cls, "_adjust"):
        pytest.skip("this torch has no linear_cross_entropy options")
    for n, h, v in [(8192, 4096, 128256), (8192, 256, 32000), (100, 64, 500), (32768, 5120, 151936), (7, 8, 50)]:
        for device in ("cpu", "cuda"):
            adjusted = options_cls(acc_policy="accurate")._adjust(num_batches=n, in_features=h, num_classes=v,
                                                                   dtype=torch.float32, device=torch.device(device))
            assert torch_chunk_rows(n, h, v) == adjusted.batch_chunk_size, (n, h, v, device)


def test_fallback_rows_are_the_loss_modules():
    from hf_gradfix.loss import lean_head

    assert FALLBACK_ROWS == lean_head.FALLBACK_CHUNK_TOKENS


def test_the_planner_counts_the_lean_head_instead_of_the_logits():
    """estimate(): with loss.head lean the activations lose the logits and the loss's fp32 tensors and gain the lean
    head's own count (this file's measured formula), for the traced and the formula activation models; under tp it
    counts the stock head (a DTensor head keeps it) and says so."""
    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, load_model_config

    from transformers import LlamaConfig

    # a vocabulary large enough for the head to set the peak (as at 128k-152k in a real model)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    tokens = 1024
    for model in ("traced", "formula"):
        base = dict(dtype="fp32", seq_len=512, micro_batch=2, activation_model=model)
        stock = estimate(cfg, ParallelDims(1), Settings(**base))
        lean = estimate(cfg, ParallelDims(1), Settings(**base, loss_head="lean"))
        b = lean.extra["lean_head"]
        assert b == lean_head_bytes(tokens, cfg.hidden_size, cfg.vocab_size, compute_bytes=4, weight_bytes=4,
                                    torch_op=b["path"] == "torch")
        # what the stock count holds for the head, written out: the fp32 logits, the loss's saved log-softmax, its
        # two fp32 tokens x vocab backward tensors, and the head's saved input (tokens x hidden)
        stock_head = 4 * tokens * cfg.vocab_size * 4 + 4 * tokens * cfg.hidden_size
        diff = stock.components["activations"] - lean.components["activations"]
        expected = stock_head - b["kept"] - b["transient"]
        assert abs(diff - expected) <= 0.01 * stock_head, (model, diff, expected, b)
        assert model == "formula" or "lean loss head" in lean.explain["activations"]
    cfg = load_model_config("tiny-llama")
    tp = estimate(cfg, ParallelDims(2, dp_shard=1, tp=2), Settings(dtype="fp32", seq_len=512, loss_head="lean"))
    assert "lean_head" not in tp.extra and "loss.head lean is not used here" in tp.explain["activations"]


def test_docstring_examples_run():
    import doctest

    from hf_gradfix.plan import lean_head

    result = doctest.testmod(lean_head)
    assert result.attempted > 0 and result.failed == 0


def test_the_cli_reads_the_lean_head_from_the_flag_and_the_config(tmp_path, capsys):
    import json as _json

    from hf_gradfix.plan_cli import plan_main

    def plan(*argv):
        assert plan_main(["--model", "tiny-llama", "--seq-len", "64", "--json", *argv]) == 0
        return _json.loads(capsys.readouterr().out)["plan"]

    assert "lean_head" in plan("--loss-head", "lean")["extra"]
    assert "lean_head" not in plan()["extra"]
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_processes: 1\nhf_gradfix:\n  loss: {head: lean}\n")
    assert "lean_head" in plan("--config", str(cfg))["extra"]
    # a flag that contradicts the file: one line naming both
    assert plan_main(["--model", "tiny-llama", "--seq-len", "64", "--config", str(cfg), "--loss-head", "stock"]) == 2
    assert "loss.head=lean" in capsys.readouterr().err


def test_the_simulated_step_runs_the_lean_head_and_names_what_it_cannot_see(capsys):
    """--simulate with --loss-head lean traces the backbone and the lean cross-entropy: the same peak on fake and on
    real tensors, below the stock head's; torch's op (fp32) keeps scratch the trace does not see, and the plan says
    so before the work; under FSDP2 the stock head is simulated, said."""
    from transformers import LlamaConfig

    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings
    from hf_gradfix.plan.simulate import simulate
    from hf_gradfix.plan_cli import plan_main

    cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    lean = Settings(dtype="fp32", seq_len=512, micro_batch=2, loss_head="lean")
    fake, real = (simulate(cfg, ParallelDims(1), lean, fake=f)["peak"] for f in (True, False))
    stock = simulate(cfg, ParallelDims(1), Settings(dtype="fp32", seq_len=512, micro_batch=2))["peak"]
    assert fake == real and fake < 0.5 * stock, (fake, real, stock)
    assert plan_main(["--model", "tiny-llama", "--seq-len", "32", "--dtype", "fp32", "--simulate", "--loss-head",
                      "lean"]) == 0
    err = capsys.readouterr().err
    assert "runs the lean head" in err and "scratch inside the op" in err
    assert err.index("scratch inside the op") < err.index("traced")  # before the work, not after it
    assert plan_main(["--model", "tiny-llama", "--seq-len", "32", "--dtype", "fp32", "--simulate", "--loss-head",
                      "lean", "--num-gpus", "2"]) == 0
    assert "runs the stock loss head" in capsys.readouterr().err


def test_the_planner_counts_the_lean_head_on_the_last_pipeline_stage():
    """Under pp the last stage's loss function applies the lean head (tests/test_pipeline.py runs it), except under
    the zero-bubble schedule (its backward runs twice, which torch's op refuses): counted on the last stage."""
    from transformers import LlamaConfig

    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate

    cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    base = dict(dtype="fp32", seq_len=512, micro_batch=2, grad_accum=4, pp=2)
    stock = estimate(cfg, ParallelDims(1), Settings(**base))
    lean = estimate(cfg, ParallelDims(1), Settings(**base, loss_head="lean"))
    zero_bubble = estimate(cfg, ParallelDims(1), Settings(**base, loss_head="lean", pp_schedule="zero_bubble"))
    assert "lean_head" in lean.extra and lean.peak < stock.peak, (lean.peak, stock.peak)
    assert "lean_head" not in zero_bubble.extra and "not used here" in zero_bubble.explain["activations"]
