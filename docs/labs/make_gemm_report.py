"""Tables and plots for the GEMM, pipeline and Triton labs, generated from their recorded JSON only.

    PYTHONPATH=src:. python docs/labs/make_gemm_report.py --gemm gemm.json --pipeline pipeline.json \
        --triton triton.json [--out docs/labs]

Writes <out>/gemm_results.md, pipeline_results.md, triton_results.md (whichever inputs are given)
and PNGs under <out>/img/: TFLOP/s per rung against cuBLAS for each size, the pipeline's TFLOP/s
against K per stage count, and the Triton comparison. Every file states the GPU, versions, date and
the command that produced the JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tileattn.bench import read_run
from tileattn.bench.report import environment_line, markdown_table, plot


def _fmt(v, kind=""):
    if v is None:
        return "-"
    if kind == "pct":
        return f"{v:.0f}%"
    if kind == "err":
        return f"{v:.1e}"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def gemm_report(path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env, recs = read_run(path)
    lines = ["# GEMM ladder: measured", "", environment_line(env), ""]
    selftest = env.get("tma_selftest") or {}
    if selftest:
        lines += ["TMA / wgmma self-test: " + "; ".join(f"{k}: {v}" for k, v in selftest.items()), ""]
    preds = env.get("predictions") or {}
    if preds:
        lines += ["Predictions recorded before the measurement (labs/gemm.py PREDICTIONS):", ""]
        lines += [f"- rung {k}: {v}" for k, v in preds.items()] + [""]
    cols = [("impl", ""), ("median_ms", ""), ("tflops", ""), ("pct_cublas", "pct"), ("rel_err", "err"),
            ("registers", ""), ("static_smem", ""), ("dynamic_smem", ""), ("spill_bytes", ""), ("occupancy", "occ"),
            ("sass_FFMA", ""), ("sass_LDG.E.128", ""), ("sass_LDS", ""), ("sass_LDS.128", ""), ("sass_LDSM", ""),
            ("sass_LDGSTS", ""), ("sass_HMMA", ""), ("sass_HGMMA", ""), ("sass_UTMALDG", ""), ("sass_LDL/STL", "")]
    heads = ["impl", "ms", "TFLOP/s", "% cuBLAS", "rel err", "regs", "smem", "dyn smem", "spill B", "occupancy",
             "FFMA", "LDG.128", "LDS", "LDS.128", "LDSM", "LDGSTS", "HMMA", "HGMMA", "UTMALDG", "LDL/STL"]
    sizes = list(dict.fromkeys(r["size"] for r in recs))
    img = out / "img"
    img.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        rs = [r for r in recs if r["size"] == size]
        lines += [f"## {size} (M x N x K)", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for r in rs:
            cells = []
            for k, kind in cols:
                v = r.get(k)
                cells.append(f"{100 * v:.0f}%" if (kind == "occ" and v is not None) else _fmt(v, kind))
            if r.get("error"):
                cells[1] = "ERROR: " + r["error"][:80].replace("|", "/")
            elif r.get("correct") is False:
                cells[1] = "WRONG " + cells[1]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        # bar chart: TFLOP/s per implementation, cuBLAS bars highlighted
        ok = [r for r in rs if r.get("tflops") is not None]
        fig, ax = plt.subplots(figsize=(9, 0.32 * len(ok) + 1.2))
        names = [r["impl"] for r in ok]
        vals = [r["tflops"] for r in ok]
        colors = ["tab:gray" if r["rung"] == "cuBLAS" else ("tab:red" if r["rung"] == "x" else
                  ("tab:blue" if r["dtype"] == "fp32" else "tab:green")) for r in ok]
        ax.barh(range(len(ok)), vals, color=colors)
        ax.set_yticks(range(len(ok)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("TFLOP/s (log)")
        ax.set_title(f"GEMM {size}: rungs vs cuBLAS (gray); fp32 blue, 16-bit green, spilling red", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        png = img / f"gemm_{size}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        lines += [f"![TFLOP/s per rung, {size}](img/{png.name})", ""]
    path_md = out / "gemm_results.md"
    path_md.write_text("\n".join(lines) + "\n")
    return path_md


def pipeline_report(path: Path, out: Path) -> Path:
    env, recs = read_run(path)
    val = [r for r in recs if r["suite"] == "pipeline-validate"]
    bench = [r for r in recs if r["suite"] == "pipeline"]
    lines = ["# Asynchronous pipelines: measured", "", environment_line(env), ""]
    bad = [r for r in val if not r.get("correct")]
    lines += [f"Validation: {len(val)} cases (stages x K x shapes), {len(bad)} failed; every case run twice, "
              f"bitwise repeatable: {all(r.get('bitwise_repeatable') for r in val)}.", ""]
    for r in bad:
        lines.append(f"- FAILED M={r['M']} N={r['N']} K={r['K']} stages={r['stages']}: rel err {r['rel_err']:.3g}")
    lines += ["", "TFLOP/s at M = N = 4096 (bf16):", "", markdown_table(bench, ["K"], "impl", "tflops"), ""]
    lines += ["Resident blocks per SM (occupancy API; registers and shared memory are in the JSON):", "",
              markdown_table([r for r in bench if r.get("stages")], ["impl"], "K", "blocks_per_sm"), ""]
    img = out / "img"
    png = plot(bench, "K", "impl", "tflops", img / "pipeline_tflops.png", title="rung 9: stages vs K (M=N=4096, bf16)",
               ylabel="TFLOP/s")
    lines += [f"![pipeline TFLOP/s]({png.relative_to(out)})", ""]
    path_md = out / "pipeline_results.md"
    path_md.write_text("\n".join(lines) + "\n")
    return path_md


def triton_report(path: Path, out: Path) -> Path:
    env, recs = read_run(path)
    lines = ["# Triton route: measured", "", environment_line(env), ""]
    for suite in dict.fromkeys(r["suite"] for r in recs):
        rs = [r for r in recs if r["suite"] == suite]
        keys = [k for k in ("n", "M", "N", "K", "causal") if k in rs[0]]
        for r in rs:
            r["shape"] = ", ".join(f"{k}={r[k]}" for k in keys)
        unit = rs[0].get("unit", "")
        lines += [f"## {suite} ({unit})", "", markdown_table(rs, ["shape"], "impl", "rate"), "",
                  "First call (compile + load, s):", "", markdown_table(rs, ["shape"], "impl", "cold_s"), ""]
    path_md = out / "triton_results.md"
    path_md.write_text("\n".join(lines) + "\n")
    return path_md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemm")
    ap.add_argument("--pipeline")
    ap.add_argument("--triton")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arg, fn in ((args.gemm, gemm_report), (args.pipeline, pipeline_report), (args.triton, triton_report)):
        if arg:
            print(f"wrote {fn(Path(arg), out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
