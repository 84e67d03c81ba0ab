"""Device-to-host syncs per optimizer window and per micro-batch, stock vs ``hf_gradfix.patch()``, per path.

    python benchmarks/bench_host_syncs.py                  # plain, packing, moe, rl -> results/host-syncs.md
    python benchmarks/bench_host_syncs.py --paths plain    # one path

Counted by :class:`hf_gradfix.diagnostics.host_syncs.HostSyncCounter` (structural: the operations that sync on
CUDA, residence inferred as a GPU run would have it; on CPU here). Each path trains twice (2 and 4 optimizer
windows, GA 4; ``tests/support/host_sync_runs.py``): the per-window figure is the difference, so what runs once
(the probe, the optimizer state's first allocation) cancels out. The plugin's extra syncs are patched minus stock;
the table also lists the syncs whose innermost non-torch frame is hf_gradfix's, by site.
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import ROOT, command_line, md_row, on_path, results_path, versions

on_path(ROOT, ROOT / "tests" / "support")

import host_sync_runs as S  # noqa: E402

PATH_NOTES = {
    "plain": "causal LM (tiny Llama), Trainer, AdamW, clipping, logging every step",
    "packing": "hf_gradfix packing (varlen rows, reference kernel) vs stock padded batches",
    "moe": "tiny Mixtral, router loss aux_loss=global vs stock's per-micro-batch router loss",
    "rl": "TRL GRPOTrainer (generation included in both)",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=",".join(S.PATHS), help=f"comma-separated subset of {','.join(S.PATHS)}")
    ap.add_argument("--out", default=results_path("host-syncs.md"))
    a = ap.parse_args(argv)
    rows, details = [], []
    for path in a.paths.split(","):
        t0 = time.perf_counter()
        try:
            r = S.measure(path)
        except Exception as e:  # a path this environment cannot run: said, not hidden
            rows.append(md_row([path, PATH_NOTES[path], "-", "-", "-", "-", "-", f"error: {type(e).__name__}: {e}"]))
            continue
        print(f"{path}: stock {r.stock_per_window:g}, patched {r.patched_per_window:g}, extra "
              f"{r.extra_per_window:+g} per window ({time.perf_counter() - t0:.0f} s)")
        rows.append(md_row([path, PATH_NOTES[path], f"{r.stock_per_window:g}", f"{r.patched_per_window:g}",
                            f"{r.extra_per_window:+g}", f"{S.per_micro_batch(r.extra_per_window):+g}",
                            f"{r.plugin_per_window:g}", ""]))
        sites = sorted(r.plugin_sites.items(), key=lambda kv: -kv[1])
        details += [f"### {path}: hf_gradfix's syncs in the 4-window patched run, by site", ""]
        details += [f"- {n} x `{site.replace(str(ROOT) + '/', '')}`" for site, n in sites] or ["- none"]
        details.append("")
    text = "\n".join([
        "# Host syncs per path, stock vs patched", "",
        f"Command: `{command_line()}`", "",
        f"{versions('torch', 'transformers', 'trl')}; CPU, structural count (`hf_gradfix.diagnostics.host_syncs`), "
        f"GA {S.GA}; per window = the 4-window run minus the 2-window run, over 2.", "",
        "| path | setup | stock / window | patched / window | extra / window | extra / micro-batch | "
        "hf_gradfix's own / window | note |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "", *details,
    ])
    with open(a.out, "w") as f:
        f.write(text + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
