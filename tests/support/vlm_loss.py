"""The VLM loss-fix check shared by ``tests/loss/test_vlm_families.py`` and ``benchmarks/bench_vlm_loss.py``: one
2-process gloo launch (``vlm_loss_worker.py``) trains every case (family x path x patched/stock x tower trained /
frozen); this module names the cases, and computes, in this process, each recorded window's float64 ground truth
and the errors of the trainer's gradient and logged loss against it.

Ground truth (plain PyTorch, independent of hf_gradfix): the model at rank 0's initial weights, cast to float64;
every sample of the window alone (its own images, the labels the trainer's collator gave it), the causal-LM
cross-entropy SUM (``labels[1:]``), summed over the window's samples (both ranks, both micro-batches), divided by
the window's total target count; its gradient by autograd. The trainer's gradient is read at
``on_pre_optimizer_step`` (after accumulation and the DDP all-reduce), with SGD lr 0.

Cases: ``path:family:mode:tower`` with path ``trainer`` (``transformers.Trainer`` over per-sample processor outputs,
``vlm.collate_processed``), ``trl`` (TRL's ``SFTTrainer`` with its own ``DataCollatorForVisionLanguageModeling``,
conversational samples with ``assistant_only_loss``) or ``trlpc`` (prompt-completion samples,
``completion_only_loss``); mode ``patched`` / ``stock``; tower ``trained`` / ``frozen`` (vision tower
``requires_grad=False``, projector trained).
"""

from __future__ import annotations

from typing import Sequence

import torch

import harness as H
import vlm

N_SAMPLES = 12  # a full window (bs 2 x GA 2 x 2 ranks = 8 samples), then a partial one (1 micro-batch per rank)
BS, GA = 2, 2
#: images per sample: consecutive pairs are the micro-batches: (1, 0), (3, 2), (0, 0): a text-only micro-batch,
#: (2, 1); images of different sizes (vlm.IMAGE_SIZES)
COUNTS = (1, 0, 3, 2, 0, 0, 2, 1)
SEED = 0

TRAINER_FAMILIES = vlm.FAMILIES
TRL_FAMILIES = ("qwen2_5_vl", "gemma3")  # accepts_loss_kwargs False (stock biased) and True (stock passes the count)
TRLPC_FAMILIES = ("qwen2_5_vl",)


def all_cases() -> list[str]:
    cases = []
    for fam in TRAINER_FAMILIES:
        cases += [f"trainer:{fam}:patched:trained", f"trainer:{fam}:stock:trained", f"trainer:{fam}:patched:frozen"]
    for fam in TRL_FAMILIES:
        cases += [f"trl:{fam}:patched:trained", f"trl:{fam}:stock:trained"]
    for fam in TRLPC_FAMILIES:
        cases += [f"trlpc:{fam}:patched:trained", f"trlpc:{fam}:stock:trained"]
    return cases


def parse(case: str) -> tuple[str, str, str, str]:
    path, family, mode, tower = case.split(":")
    return path, family, mode, tower


def samples_for(path: str, family: str) -> list[dict]:
    kind = "prompt_completion" if path == "trlpc" else "messages"
    return vlm.make_samples(family, N_SAMPLES, SEED, kind=kind, counts=COUNTS)


def build_model(family: str, tower: str):
    model = vlm.build_vlm(family, SEED)
    if tower == "frozen":
        vlm.freeze_tower(model)
    return model


def trl_collator(path: str, processor):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    if path == "trl":
        return DataCollatorForVisionLanguageModeling(processor=processor, assistant_only_loss=True)
    return DataCollatorForVisionLanguageModeling(processor=processor, completion_only_loss=True)


#: Qwen2.5-VL trainer-path samples that also carry a video (vlm.add_video): sample 1 has no image (video only),
#: sample 7 has an image and a video
VIDEO_IDX = (1, 7)


def trainer_features(family: str, samples: Sequence[dict], processor) -> list[dict]:
    """The Trainer path's per-sample features (``vlm.process_one``, assistant-only labels), with a video on
    :data:`VIDEO_IDX` for Qwen2.5-VL."""
    out = []
    for s in samples:
        f = vlm.process_one(family, s, processor)
        if family == "qwen2_5_vl" and s["idx"] in VIDEO_IDX:
            f = vlm.add_video(family, f, processor, seed=s["idx"])
        out.append(f)
    return out


def features_for(path: str, family: str, samples: Sequence[dict], processor) -> dict[int, dict]:
    """Each sample alone, as the trainer's collator labels it: ``vlm.process_one`` (Trainer path) or TRL's
    collator on a one-sample batch (TRL paths; no padding), as a one-row batch."""
    if path == "trainer":
        return {f["idx"]: vlm.collate_processed(family, [f]) for f in trainer_features(family, samples, processor)}
    out = {}
    for s in samples:
        ex = {k: (list(v) if isinstance(v, list) else v) for k, v in s.items() if k != "idx"}
        out[s["idx"]] = dict(trl_collator(path, processor)([ex]))
    return out


def ground_truth(model64, window_batches: Sequence[dict], micro_sizes: Sequence[int]) -> dict:
    """float64 loss sum over the window's samples (each its own one-row batch) / their total target count, and its
    gradient (``loss``, ``grads``, ``count``). Also the planted bug from the same per-sample sums (``biased_loss``,
    ``biased_grads``): each micro-batch's own target mean (``micro_sizes``: the window's micro-batches, in order),
    averaged over the window's micro-batches, what stock computes when the count is not passed."""
    import torch.nn.functional as F

    model64.zero_grad(set_to_none=True)
    sums, counts = [], []
    for batch in window_batches:
        batch = dict(batch)
        labels = batch.pop("labels")
        batch = {k: (v.double() if torch.is_floating_point(v) else v) for k, v in batch.items()}
        logits = model64(**batch).logits[:, :-1].double()
        target = labels[:, 1:]
        sums.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    ignore_index=vlm.IGNORE_INDEX, reduction="sum"))
        counts.append(int(target.ne(vlm.IGNORE_INDEX).sum()))
    loss = sum(sums) / sum(counts)
    means, at = [], 0
    for size in micro_sizes:
        means.append(sum(sums[at : at + size]) / max(1, sum(counts[at : at + size])))
        at += size
    biased = sum(means) / len(means)
    names = [n for n, p in model64.named_parameters() if p.requires_grad]
    params = [p for n, p in model64.named_parameters() if p.requires_grad]

    def grads_of(value, retain):
        gs = torch.autograd.grad(value, params, retain_graph=retain, allow_unused=True)
        return {n: (g if g is not None else torch.zeros_like(p)) for n, g, p in zip(names, gs, params)}

    grads = grads_of(loss, True)
    return dict(loss=float(loss.detach()), grads=grads, count=sum(counts), biased_loss=float(biased.detach()),
                biased_grads=grads_of(biased, False))


def _sub(g: dict, keys: Sequence[str]) -> dict:
    return {k: g[k] for k in keys if k in g}


def compare(case: str, ranks: Sequence[dict], processor=None, cache: dict | None = None) -> list[dict]:
    """Per recorded window: rel err of the gradient (all trainable parameters; the vision tower + projector alone;
    the language model + head alone: a tower with a large gradient norm cannot hide a text error), of the logged
    loss, the window's target count; rank 0's record holds the initial state."""
    path, family, mode, tower = parse(case)
    processor = processor or vlm.build_processor(family)
    samples = samples_for(path, family)
    cache = {} if cache is None else cache
    if (path, family) not in cache:
        cache[path, family] = features_for(path, family, samples, processor)
    feats = cache[path, family]
    model64 = build_model(family, tower)
    model64.load_state_dict(ranks[0]["initial_state"])
    model64.double()
    vision = set(vlm.tower_and_projector_names(model64))
    rows = []
    for k, step0 in enumerate(ranks[0]["steps"]):
        micro = [b for r in ranks for b in r["steps"][k]["idx_batches"]]
        window = [i for b in micro for i in b]
        ref = ground_truth(model64, [feats[i] for i in window], [len(b) for b in micro])
        gt_loss, gt, count = ref["loss"], ref["grads"], ref["count"]
        g = step0["grads"]
        vkeys = [n for n in gt if n in vision]
        tkeys = [n for n in gt if n not in vision]
        logged = ranks[0]["logged_losses"][k] if k < len(ranks[0]["logged_losses"]) else None
        rank_diff = max(float((r["steps"][k]["grads"][n] - g[n]).abs().max()) for r in ranks[1:] for n in g)
        rows.append(dict(
            case=case, step=k, n_samples=len(window), n_targets=count,
            images=sum(len(samples[i]["images"]) for i in window),
            rel_err=H.rel_err(g, gt),
            vision_rel_err=H.rel_err(_sub(g, vkeys), _sub(gt, vkeys)) if vkeys else None,
            vision_params=len(vkeys),
            text_rel_err=H.rel_err(_sub(g, tkeys), _sub(gt, tkeys)),
            loss_rel_err=None if logged is None else abs(logged - gt_loss) / abs(gt_loss),
            logged_loss=logged, gt_loss=gt_loss, mean_of_means_rel_err=H.rel_err(ref["biased_grads"], gt),
            mean_of_means_loss_rel_err=abs(ref["biased_loss"] - gt_loss) / abs(gt_loss),
            videos=sum(1 for i in window if path == "trainer" and family == "qwen2_5_vl" and i in VIDEO_IDX),
            rank_grad_max_diff=rank_diff,
            accepts_loss_kwargs=ranks[0]["meta"].get("model_accepts_loss_kwargs"),
            seconds=ranks[0]["meta"].get("seconds"),
        ))
    return rows


def loss_honours_count(family: str) -> bool:
    """Measured: does the family's model loss scale as sum / num_items_in_batch (two counts, one batch)?"""
    model = vlm.build_vlm(family, SEED)
    proc = vlm.build_processor(family)
    batch = vlm.collate_processed(family, vlm.processed_samples(family, vlm.make_samples(family, 2, SEED), proc))
    with torch.no_grad():
        a, b = (float(model(**batch, num_items_in_batch=torch.tensor(n)).loss) for n in (1, 2))
    return abs(a - 2 * b) <= 1e-5 * abs(a)


def launch(cases: Sequence[str] | None = None) -> dict[str, list[dict]]:
    from multiproc import launch_cases

    runs, _ = launch_cases("vlm_loss_worker.py", list(cases or all_cases()), nproc=2)
    return runs
