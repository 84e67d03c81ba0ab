"""``scripts/gpu_check.sh`` / ``benchmarks/gpu_check.py`` on a CPU machine: the skip path, and the logic of every
check it runs on a GPU, run here with the reference varlen kernel, fp32 (and bf16 where meaningful), tiny sizes.

Skip path (documented choice): without CUDA both the script and the driver print ONE line starting with
``gpu_check: skipped:``, exit 0 and write no results file (a CPU run must never overwrite a GPU's results).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

import hang_bound
import harness as H

sys.path.insert(0, str(H.REPO_ROOT / "benchmarks"))
G = importlib.import_module("gpu_check")

from hf_gradfix.packing.attention import REFERENCE_VARLEN_ATTENTION as REF  # noqa: E402
from hf_gradfix.packing.attention import register_reference_varlen_attention  # noqa: E402

register_reference_varlen_attention()
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the skip path does not apply")
SMALL = dict(lengths=(13, 29, 5, 21), config_kw=dict(hidden=64, heads=2, window=8))


# ------------------------------------------------------------------------------------------ the skip path
@NO_CUDA
def test_script_without_cuda_prints_one_line_exits_0_and_writes_nothing():
    venv = H.REPO_ROOT / "benchmarks" / "results" / "gpu-check"  # the default output folder
    results = H.REPO_ROOT / "benchmarks" / "results" / "gpu-check.md"
    before = (venv.exists(), results.stat().st_mtime if results.exists() else None)
    env = {**os.environ, "PYTHON": sys.executable, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = hang_bound.run(["bash", str(H.REPO_ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, step="gpu_check.py on the CPU")
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA device"), lines
    after = (venv.exists(), results.stat().st_mtime if results.exists() else None)
    assert after == before  # no output folder created, no results written


@NO_CUDA
def test_driver_without_cuda_prints_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu.md"
    assert G.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu_check: skipped: no CUDA device")
    assert not out.exists()


def test_driver_rejects_an_unknown_section():
    with pytest.raises(SystemExit):
        G.main(["--only", "packing,flashy", "--device", "cpu"])


# ------------------------------------------------------------------------------------------ offline preparation
def _fake_wheel(folder, name="hgf_probe", version="0.1"):
    """A minimal pure-Python wheel, built here without network."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def _script(name, *args, **env):
    full = {**os.environ, "PYTHON": sys.executable, **{k: str(v) for k, v in env.items()}}
    return hang_bound.run(["bash", str(H.REPO_ROOT / "scripts" / name), *args], env=full, capture_output=True,
                          text=True, step="gpu_check.py on the CPU")


def test_wheels_size_check_counts_the_folder_and_the_repository(tmp_path):
    wheels = tmp_path / "w"
    _fake_wheel(wheels)
    (wheels / "big-1.0-py3-none-any.whl").write_bytes(b"\0" * 3_000_000)
    ok = _script("gpu_wheels.sh", "--check-only", GPU_WHEELS_DIR=wheels)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    line = ok.stdout.strip().splitlines()[-1]
    assert "2 wheels, 2.86 MiB" in line and "of the 64.00 MiB carry limit" in line
    repo_mib = float(line.split("repository ")[1].split(" MiB")[0])
    assert 0.5 < repo_mib < 30  # the repository's own files count too
    over = _script("gpu_wheels.sh", "--check-only", GPU_WHEELS_DIR=wheels,
                   GPU_CARRY_LIMIT_BYTES=int((repo_mib + 1.0) * 2**20))
    assert over.returncode == 1 and "over the carry limit" in over.stdout


def test_wheels_refuse_two_versions_of_one_package(tmp_path):
    wheels = tmp_path / "w"
    _fake_wheel(wheels, version="0.1")
    _fake_wheel(wheels, version="0.2")
    r = _script("gpu_wheels.sh", "--check-only", GPU_WHEELS_DIR=wheels)
    assert r.returncode == 1 and "several versions of: hgf_probe" in r.stdout


def test_wheels_dry_run_names_the_gpu_machines_python_and_pins(tmp_path):
    r = _script("gpu_wheels.sh", "--dry-run", GPU_WHEELS_DIR=tmp_path / "none")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.splitlines()[0]
    for flag in ("download", "--no-deps", "--only-binary=:all:", "--python-version 3.12", "manylinux2014_x86_64",
                 "scripts/gpu_wheels.txt"):
        assert flag in cmd, (flag, cmd)
    pins = [line for line in (H.REPO_ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert all("==" in p for p in pins) and {p.split("==")[0] for p in pins} >= {"trl", "datasets", "galore-torch"}
    assert not (tmp_path / "none").exists()  # a dry run downloads nothing


def test_offline_install_into_a_scratch_target(tmp_path):
    """gpu_check.sh's install step on its own: pip install --no-index --target from the carried folder, then the
    imports it reports come from the working tree (hf_gradfix) and the scratch target (the wheels)."""
    wheels, site = tmp_path / "w", tmp_path / "site"
    _fake_wheel(wheels)
    r = _script("gpu_check.sh", "--install-only", GPU_WHEELS_DIR=wheels, GPU_SITE=site,
                GPU_CHECK_IMPORTS="hf_gradfix hgf_probe", GPU_CHECK_LOG_DIR=tmp_path / "log",
                PIP_INDEX_URL="http://127.0.0.1:9/nowhere")  # any index access would fail
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed 1 wheels" in r.stdout and (site / "hgf_probe" / "__init__.py").exists()
    assert f"import hgf_probe: ok from {site / 'hgf_probe'}" in r.stdout
    assert f"import hf_gradfix: 0.1.0 from {H.REPO_ROOT / 'hf_gradfix'}" in r.stdout
    assert "varlen_attn(" in r.stdout and (tmp_path / "log" / "gpu-check.log").exists()


# ------------------------------------------------------------------------------------------ time bounds
def test_a_section_past_its_budget_keeps_its_finished_rows():
    import time

    def slow(device, quick):
        rows = G._section_rows()
        for i in range(100):
            rows.append({"i": i})
            time.sleep(0.05)
        return dict(status="passed", summary="never", rows=rows)

    written = []
    G.RUNNERS["slow_test"] = slow
    G.RUNNERS["fast_test"] = lambda device, quick: dict(status="passed", summary="ok")
    try:
        t0 = time.perf_counter()
        results = G.run_sections("cpu", ["slow_test", "fast_test"], quick=True, log=lambda *_: None,
                                 budgets={"slow_test": 0.5, "fast_test": 60},
                                 on_section=lambda r: written.append(list(r["sections"])))
        assert time.perf_counter() - t0 < 30
    finally:
        del G.RUNNERS["slow_test"], G.RUNNERS["fast_test"]
    sec = results["sections"]["slow_test"]
    assert sec["status"] == "timeout" and "budget" in sec["summary"]
    assert 3 <= len(sec["rows"]) < 100 and sec["budget_s"] == 0.5
    assert results["sections"]["fast_test"]["status"] == "passed"  # the next section still ran
    assert written == [["slow_test"], ["slow_test", "fast_test"]]  # results written after every section


def test_sections_past_the_total_budget_are_skipped_not_run():
    results = G.run_sections("cpu", ["guard", "packing"], quick=True, log=lambda *_: None, total_s=3)
    assert all(s["status"] == "skipped: no time left" for s in results["sections"].values())


def test_profiles_fit_one_device_call_each():
    """full: the section budgets fit its total, which fits the script's 470 s bound and a run call of 520 s;
    rerun: 150 s inside 170 s. 15 minutes of device time: start (40-100 s seen) + 470 + 200 s, with room to spare."""
    full, rerun = G.PROFILES["full"], G.PROFILES["rerun"]
    assert list(full["sections"]) == list(G.SECTIONS)  # every section, in order of value
    assert sum(full["sections"].values()) <= full["budget_s"] + 30 and full["budget_s"] + 20 <= 470
    assert rerun["quick"] and rerun["budget_s"] + 15 <= 170
    assert list(rerun["sections"])[:3] == ["packing", "guard", "trainer"]


def test_driver_writes_incrementally_under_out_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(G.RUNNERS, "guard", lambda device, quick: dict(status="passed", summary="stand-in"))
    assert G.main(["--device", "cpu", "--only", "guard", "--quick", "--out-dir", str(tmp_path)]) == 0
    back = json.loads((tmp_path / "gpu-check.json").read_text())
    assert back["sections"]["guard"]["status"] == "passed"
    assert G.read_results(tmp_path / "gpu-check.md")["sections"]["guard"]["status"] == "passed"


def test_galore_torch_imports_without_bitsandbytes(monkeypatch):
    """galore-torch's __init__ imports bitsandbytes (too large to carry): GaLoreAdamW is loaded without it."""
    pytest.importorskip("galore_torch")
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ModuleNotFoundError("No module named 'bitsandbytes'", name="bitsandbytes")
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m.startswith(("galore_torch", "bitsandbytes"))]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_bnb)
    ok, line = G.import_galore_torch()
    assert ok and "bitsandbytes absent" in line
    import galore_torch

    assert galore_torch.GaLoreAdamW.__name__ == "AdamW"


# ------------------------------------------------------------------------------------------ 1. packing
@pytest.mark.parametrize("arch", G.ARCHS)
def test_packed_vs_separate_fp32_reference_is_exact(arch):
    r = G.packed_vs_separate(arch, REF, torch.float32, "cpu", **SMALL)
    assert r["passed"], r["why"]
    assert r["logits"]["packed"] <= 1e-5 and r["grads"]["packed"] <= 1e-5
    assert r["logits"]["control"] > 1e-2  # mixing sequences would have shown
    assert r["reference_branches"] == {"cu_seq_lens": 2}  # the varlen path really ran, once per layer


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_packed_vs_separate_bf16_rule_passes_a_correct_path(arch):
    """bf16 on CPU (reference kernel, fp32 math inside, bf16 in and out): the half-precision rule accepts it."""
    r = G.packed_vs_separate(arch, REF, torch.bfloat16, "cpu", **SMALL)
    assert r["passed"], r["why"]
    assert 1e-4 < r["logits"]["separate"] < 0.1  # bf16 noise is real and not tiny: why 1e-5 cannot apply
    assert r["logits"]["control"] > G.CONTROL_FACTOR * r["logits"]["separate"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_vs_separate_fails_when_sequences_mix(monkeypatch, dtype):
    """The check can fail: a collator that loses the boundaries (no position_ids, no cu_seq_lens) is caught."""
    from hf_gradfix.packing.collator import PackedCollator

    original = PackedCollator.__call__

    def lossy(self, features):
        batch = original(self, features)
        return {k: v for k, v in batch.items() if k in ("input_ids", "labels")}

    monkeypatch.setattr(PackedCollator, "__call__", lossy)
    import hf_gradfix.packing.collator as C

    monkeypatch.setattr(C, "check_packed_batch", lambda b: None)
    r = G.packed_vs_separate("llama", REF, dtype, "cpu", **SMALL)
    assert not r["passed"], r["why"]
    assert r["logits"]["packed"] > 1e-2


def test_half_precision_verdict_rule():
    ok = lambda *a: G.half_precision_verdict(*a)[0]  # noqa: E731
    assert ok(1e-5, 0.0, 1.0, torch.float32) and not ok(1.1e-5, 0.0, 1.0, torch.float32)
    # a device whose fp32 floor (each sequence alone vs fp64) is above 5e-6: packed may be 2x that floor, no more
    assert ok(1.5e-5, 1e-5, 1.0, torch.float32) and not ok(2.01e-5, 1e-5, 1.0, torch.float32)
    assert ok(2e-3, 1e-3, 1e-1, torch.bfloat16) and not ok(2.01e-3, 1e-3, 1e-1, torch.bfloat16)
    assert not ok(1e-3, 1e-3, 9.9e-3, torch.float16)  # control within 10x of the noise: cannot tell, fails
    assert ok(1e-3, 1e-3, None, torch.float16)  # gradients: no control


# ------------------------------------------------------------------------------------------ 2-3. trainer, guard
def test_packed_trainer_against_the_unpacked_ground_truth_on_this_device():
    r = G.packed_trainer_vs_ground_truth("cpu", REF)
    assert r["passed"], r["why"]
    assert r["attention"] == REF and r["steps"] == 3 and max(r["grad_rel_err"]) <= 1e-5


def test_guard_section_accepts_the_reference_and_refuses_the_mixing_control():
    sec = G.section_guard("cpu", quick=True)
    assert sec["status"] == "passed", sec
    by_arch = {r["arch"]: r for r in sec["rows"]}
    assert not by_arch["llama"]["refused"] and by_arch["mixing_control"]["refused"]
    assert "LlamaForCausalLM cannot be trained on packed sequences" in by_arch["mixing_control"]["message"]
    assert "sequences attend to each other" in by_arch["mixing_control"]["message"]


# ------------------------------------------------------------------------------------------ 4. plan
def test_compare_memory_errors_are_relative_to_the_allocator():
    closed = {"parameters": 120, "gradients": 100, "optimizer_state": 150, "activations": 90, "peak": 500}
    traced = {"max": {"parameters": 100, "gradients": 100, "activations_and_temporaries": 80},
              "after_step": {"optimizer_state": 200}, "peak": 400}
    measured = {"parameters": 100, "gradients": 80, "optimizer_state": 200, "activations": 100, "peak": 400}
    rows = {r["component"]: r for r in G.compare_memory(closed, traced, measured)}
    assert rows["parameters"]["closed_err"] == pytest.approx(0.2) and rows["parameters"]["traced_err"] == 0
    assert rows["gradients"]["traced_err"] == pytest.approx(0.25)
    assert rows["optimizer_state"]["closed_err"] == pytest.approx(-0.25)
    assert rows["activations"]["traced"] == 80 and rows["activations"]["traced_err"] == pytest.approx(-0.2)
    assert rows["peak"]["closed_err"] == pytest.approx(0.25) and rows["peak"]["traced_err"] == 0


def test_measure_training_step_needs_cuda():
    from hf_gradfix.plan import Settings, load_model_config

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        G.measure_training_step(load_model_config("tiny-llama"), Settings(seq_len=16), "cpu")


class LiveTensorBytes:
    """A stand-in for ``torch.cuda``'s allocator statistics on CPU: bytes of the distinct storages of the live
    tensors Python can see (parameters, gradients, optimizer state; not every autograd-saved tensor)."""

    def __init__(self):
        self.peak = 0

    def memory_allocated(self) -> int:
        import gc
        import itertools

        seen, total = set(), 0
        objects = gc.get_objects()
        kinds = {torch.Tensor, torch.nn.Parameter}.__contains__
        for o in itertools.compress(objects, map(kinds, map(type, objects))):  # the filter runs in C: fast
            if o.device.type == "cpu":
                storage = o.untyped_storage()
                if storage.data_ptr() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        self.peak = max(self.peak, total)
        return total

    def max_memory_allocated(self) -> int:
        return max(self.peak, self.memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        self.peak = 0

    def synchronize(self) -> None:
        pass


def test_plan_vs_allocator_on_cpu_with_a_live_tensor_counter():
    """The whole plan check on CPU: the measurement splits the allocator into components that come out as the
    model's own parameter bytes (x1 parameters, x1 gradients, x2 AdamW state), and the rows compare them."""
    import transformers

    from hf_gradfix.plan import load_model_config

    config = load_model_config("tiny-llama")
    r = G.plan_vs_allocator(config, "cpu", seq_len=32, dtype="fp32", mem=LiveTensorBytes())
    rows = {row["component"]: row for row in r["rows"]}
    assert set(rows) == {"parameters", "gradients", "optimizer_state", "activations", "peak"}
    model = transformers.AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    measured = {k: v["measured"] for k, v in rows.items()}
    assert measured["parameters"] == n + buffers and measured["gradients"] == n
    assert 0 <= measured["optimizer_state"] - 2 * n <= 1024  # + one step counter per parameter and the input ids
    assert 0 < measured["activations"] and measured["peak"] >= measured["parameters"] + measured["optimizer_state"]
    # the closed form and the trace agree with the allocator on the model state (activations are not all visible
    # to the CPU stand-in, so only the state is checked here)
    for comp in ("parameters", "gradients", "optimizer_state"):
        assert abs(rows[comp]["closed_err"]) < 0.01 and abs(rows[comp]["traced_err"]) < 0.01, rows[comp]
    assert "closed form" in r["summary"] and "--simulate" in r["summary"]


def test_module_doctests():
    import doctest

    assert doctest.testmod(G).failed == 0


def test_llama_1b_config_is_about_a_billion_parameters():
    from hf_gradfix.plan import param_table

    n = sum(p.numel for p in param_table(G.llama_1b_config()))
    assert 1.1e9 < n < 1.4e9, n


# ------------------------------------------------------------------------------------------ 5-6. throughput, optim
def test_throughput_arms_see_the_same_tokens_and_ratios_are_consistent():
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    arms = ("padded", "packed", "trl-padding-free")  # padded-sdpa is the padded arm again when attn is sdpa
    r = G.throughput("cpu", "sdpa", torch.float32, samples=8, budget=1024, batch=4, sigma=0.5, warmup_steps=0,
                     model_kw=tiny, arms=arms)
    assert tuple(r["arms"]) == arms
    assert 0 < r["padding_waste"] < 1 and r["limit"] == pytest.approx(1 / (1 - r["padding_waste"]))
    for arm in r["arms"].values():
        assert arm["real_tokens_per_s"] == pytest.approx(r["real_tokens"] / arm["seconds"], rel=1e-2)
        assert arm["of_limit"] == pytest.approx(arm["vs_padded"] / r["limit"])


def test_optimizer_cost_reports_state_against_adamw():
    pytest.importorskip("galore_torch")
    r = G.optimizer_cost("cpu", arms=("adamw", "galore-torch", "svd"), hidden=64, intermediate=128, heads=2,
                         vocab=128, seq=16, steps=4, gap=2)
    arms = r["arms"]
    assert arms["adamw"]["state_vs_adamw"] == 1.0
    assert arms["svd"]["state_bytes"] < arms["galore-torch"]["state_bytes"] < arms["adamw"]["state_bytes"]
    assert all(a["step_ms"] > 0 and a["refresh_ms"] > 0 for a in arms.values())


# ------------------------------------------------------------------------------------------ the results file
def test_results_file_round_trips_and_names_what_one_gpu_cannot_prove(tmp_path):
    results = G.run_sections("cpu", ["guard"], quick=True, log=lambda *_: None)
    path = G.write_results(results, tmp_path / "r.md")
    text = path.read_text()
    assert text.startswith("# GPU check: cpu")
    assert "| guard | passed |" in text and "## What one GPU cannot prove" in text
    back = G.read_results(path)
    assert back["sections"]["guard"]["status"] == "passed"
    assert back["not_provable_on_one_gpu"] == G.NOT_PROVABLE_ON_ONE_GPU


def test_a_section_that_raises_is_recorded_not_fatal(monkeypatch):
    def boom(device, quick):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(G.RUNNERS, "guard", boom)
    results = G.run_sections("cpu", ["guard"], log=lambda *_: None)
    sec = results["sections"]["guard"]
    assert sec["status"] == "error" and "kernel exploded" in sec["summary"] and "Traceback" in sec["traceback"]


# ------------------------------------------------------------------------------------------ found while writing it
def test_guard_in_the_trainer_runs_under_the_trainers_mixed_precision():
    """flash-attn refuses fp32 inputs; transformers' FA2 path casts fp32 queries to the autocast dtype, so an fp32
    model trains under ``bf16=True``. The packing guard runs before accelerate wraps the model's forward in
    autocast: outside autocast it would hand fp32 to flash-attn and refuse a model that trains fine. Shown on CPU
    with a stand-in that has flash-attn's dtype rule, as transformers dispatches it."""
    import transformers
    from transformers import AttentionInterface, Trainer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    import hf_gradfix
    from hf_gradfix.packing.attention import _set_on_every_config, reference_varlen_attention_forward
    from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_correctly

    def half_only(module, query, key, value, attention_mask, **kwargs):
        device_type = query.device.type
        if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        return reference_varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = "flash_half_only_standin"
    AttentionInterface.register(name, half_only)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    try:
        model = H.build_model("llama", attn_implementation="sdpa")
        _set_on_every_config(model, model.config, name)
        with pytest.raises(PackingCheckError, match="raised RuntimeError"):  # the guard alone, no autocast
            check_model_packs_correctly(model)
        args = transformers.TrainingArguments(
            output_dir="/tmp/hgf_gpu_check_amp", bf16=True, use_cpu=True, max_steps=2, per_device_train_batch_size=1,
            report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no", remove_unused_columns=False,
        )
        hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64, "attention": "keep"}, "log_fixes": False})
        try:
            trainer = Trainer(model=model, args=args, train_dataset=H.TokenDataset(H.make_samples("causal", n=8)))
            trainer.train()  # the guard passed under the Trainer's autocast, and the packed steps ran
        finally:
            hf_gradfix.unpatch()
        assert trainer.state.global_step == 2
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
        # accelerate keeps this Trainer's bf16 mixed precision in its process-wide AcceleratorState: a later
        # Accelerator() in this process (TRL's padded forward in tests/rl/test_rl_packing.py) would run under it
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def test_results_file_renders_every_table(tmp_path):
    results = G.run_sections("cpu", ["guard"], quick=True, log=lambda *_: None)
    plan_rows = G.compare_memory({"parameters": 2 * 2**30, "peak": 9 * 2**30}, {"max": {"parameters": 2 * 2**30}, "peak": 8 * 2**30},
                                 {"parameters": 2 * 2**30, "peak": 8 * 2**30})
    results["sections"]["plan"] = dict(status="measured", summary="s", rows=[dict(settings={"dtype": "bf16-pure"}, rows=plan_rows)])
    results["sections"]["optim"] = dict(status="measured", summary="s", rows=[dict(arms={"adamw": dict(step_ms=2.0, state_bytes=3 * 2**20)})])
    results["sections"]["throughput"] = dict(status="measured", summary="s",
                                             rows=[dict(arms={"packed": dict(vs_padded=1.9, of_limit=0.95)})])
    text = G.write_results(results, tmp_path / "r.md").read_text()
    assert "| {'dtype': 'bf16-pure'} | peak | 8.000 | 9.000 | +12.5% | 8.000 | +0.0% |" in text
    assert "| adamw | 3.0 MiB | 2 |" in text and "| packed | 0.95 | 1.9 |" in text
    assert G.read_results(tmp_path / "r.md")["sections"]["optim"]["rows"][0]["arms"]["adamw"]["step_ms"] == 2.0


def test_lean_section_runs_on_cpu_and_renders():
    """The GPU check's lean section on this CPU (one small cell: no allocator figures, the gradient agreement and the
    lean path's use are measured), and its table in the results file."""
    G._ROWS.append([])
    try:
        sec = G.section_lean("cpu", True, grid=[(4096, 256, "fp32")])
    finally:
        G._ROWS.pop()
    row = sec["rows"][0]
    assert row["lean_calls"] > 0 and row["grad_rel_err"] <= 1e-5 and row["stock_peak_bytes"] is None, row
    results = dict(environment={"device": "cpu"}, sections={"lean": dict(sec, seconds=1.0)},
                   not_provable_on_one_gpu=[], started="now")
    assert "## The lean loss head beside the stock head" in G.render_markdown(results)


def test_hybrid_section_runs_on_cpu_and_renders():
    """The GPU check's hybrid section on this CPU (torch fallbacks: every state-carrying layer split): each family's
    packed row within 1e-5 of each document alone, stock's row on the same model beside it as the control (a larger
    error, or transformers' refusal), and its table in the results file."""
    G._ROWS.append([])
    try:
        sec = G.section_hybrid("cpu", False)
    finally:
        G._ROWS.pop()
    assert sec["status"] == "passed" and sec["rows"], sec
    for row in sec["rows"]:
        assert row["layers"] and not any(x["handed_to_kernels"] for x in row["layers"]), row
        assert row["grad_rel_err"] <= 1e-5, row
        stock = row["stock_grad_rel_err"]
        assert (isinstance(stock, str) and stock.startswith("raised")) or stock > 1e-5, row
    results = dict(environment={"device": "cpu"}, sections={"hybrid": dict(sec, seconds=1.0)},
                   not_provable_on_one_gpu=[], started="now")
    text = G.render_markdown(results)
    assert "## Hybrid packing" in text and "| lfm2 | split: conv (Lfm2ShortConv" in text, text


def test_vlm_section_runs_on_cpu_within_30_s_and_renders(tmp_path):
    """``--device cpu --quick --only vlm``: the packed Qwen2.5-VL row within 1e-5 (fp32) of each document alone
    against an fp32 eager ground truth, the no-restarted-positions control far off, and the packed / padded
    throughput row in the results file; the whole run under 30 CPU seconds."""
    import time

    t = time.process_time()
    assert G.main(["--device", "cpu", "--quick", "--only", "vlm", "--out-dir", str(tmp_path)]) == 0
    assert time.process_time() - t < 30
    sec = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]["vlm"]
    exact = [r for r in sec["rows"] if "passed" in r]
    assert sec["status"] == "passed" and exact and all(r["passed"] for r in exact), sec
    assert exact[0]["logits"]["packed"] <= 1e-5 and exact[0]["grads"]["packed"] <= 1e-5, exact[0]
    assert exact[0]["logits"]["control"] > 1e-3, exact[0]
    tp = next(r["throughput"] for r in sec["rows"] if "throughput" in r)
    assert tp["arms"]["packed"]["padding"] < tp["arms"]["padded"]["padding"], tp
    text = (tmp_path / "gpu-check.md").read_text()
    assert "## VLM packing" in text and "| packed |" in text and "| padded |" in text, text


def test_vlm_exactness_fails_on_a_collator_without_restarted_positions(monkeypatch):
    """Control: a collator that drops the per-document positions (the model sees one long document) is FAILED."""
    import hf_gradfix.packing.multimodal as M

    real = M.MultimodalPackedCollator

    class Planted(real):
        def __call__(self, samples):
            batch = super().__call__(samples)
            return {k: v for k, v in batch.items() if not k.startswith(("position_ids", "cu_seq_lens", "max_length"))}

    monkeypatch.setattr(M, "MultimodalPackedCollator", Planted)
    row = G.vlm_packed_vs_alone("cpu", torch.float32, "sdpa")
    assert not row["passed"] and row["logits"]["packed"] > 1e-3, row
