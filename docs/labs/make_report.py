"""Generate the labs report's tables and plots from the JSON the labs write (and from nothing else).

    python docs/labs/make_report.py --reduction RUN.json --transpose RUN.json --sanitize RUN.json

Each run given replaces the block between `<!-- BEGIN GENERATED: NAME -->` and
`<!-- END GENERATED: NAME -->` in docs/labs/NAME.md (NAME = reduction, transpose, sanitizer) and
writes its PNG plots under docs/labs/img/. The runs come from

    PYTHONPATH=src:. python3 -m labs.reduction --json docs/labs/runs/reduction.json
    PYTHONPATH=src:. python3 -m labs.transpose --ncu --json docs/labs/runs/transpose.json
    PYTHONPATH=src:. python3 -m labs.sanitize --json docs/labs/runs/sanitize.json

`--print` writes the generated Markdown to stdout instead of into the documents.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from tileattn.bench.records import read_run  # noqa: E402
from tileattn.bench.report import environment_line, fmt_number, markdown_table  # noqa: E402


def _env(env: dict) -> str:
    """The harness's environment line plus the facts it leaves out (compute capability, SMs, bindings)."""
    extra = "; ".join(f"{k}: {env[k]}" for k in ("compute_capability", "sm_count", "cuda_bindings") if env.get(k) is not None)
    return f"Measured: {environment_line(env)}" + (f"; {extra}" if extra else "")


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt_number(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(out)


def replace_block(text: str, name: str, content: str) -> str:
    """Replace what lies between the BEGIN/END GENERATED markers for `name`; ValueError if absent."""
    begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no '{begin}' ... '{end}' block")
    return pattern.sub(lambda _: f"{begin}\n{content.strip()}\n{end}", text, count=1)


def _bar_plot(groups: list[str], series: dict[str, list[float | None]], path: Path, ylabel: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rotate = max(len(g) for g in groups) * len(groups) > 90  # long labels would overlap
    fig, ax = plt.subplots(figsize=(9, 5.2 if rotate else 4.2))
    width = 0.8 / max(1, len(series))
    for i, (name, ys) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [y or 0 for y in ys], width, label=name)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=8,
                  rotation=35 if rotate else 0, ha="right" if rotate else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    top = max((y or 0) for ys in series.values() for y in ys)
    ax.set_ylim(0, 1.25 * top)  # headroom so the legend never covers a bar
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- reduction ----------------------------------------------------------------------------------
def _sweep_plot(sweep: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in dict.fromkeys(r["impl"] for r in sweep):
        rs = sorted((r for r in sweep if r["impl"] == impl), key=lambda r: r["n"])
        ns = [r["n"] for r in rs]
        ax_t.errorbar(ns, [1e3 * r["median_ms"] for r in rs], marker="o", ms=4, capsize=2, label=impl,
                      yerr=[[1e3 * (r["median_ms"] - r["q1_ms"]) for r in rs], [1e3 * (r["q3_ms"] - r["median_ms"]) for r in rs]])
        ax_b.plot(ns, [r["tbps"] for r in rs], marker="o", ms=4, label=impl)
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (fp32 elements)")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("median time, us (bars: IQR)")
    ax_t.set_title("sum: time against length")
    ax_b.set_yscale("log")
    ax_b.set_ylabel("TB/s (4 n bytes / median time)")
    ax_b.set_title("sum: bandwidth against length")
    ax_b.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reduction_section(env: dict, records: list[dict], img: Path) -> str:
    out = [_env(env), ""]
    corr = [r for r in records if r.get("kind") == "correctness"]
    if corr:
        lengths = sorted({r["n"] for r in corr})
        versions = list(dict.fromkeys(r["impl"] for r in corr))
        rows = []
        for v in versions:
            row = [v]
            for n in lengths:
                cell = []
                for op in ("sum", "max"):
                    r = next((q for q in corr if q["impl"] == v and q["n"] == n and q["op"] == op), None)
                    if r is None:
                        cell.append("-")
                    elif op == "sum":
                        cell.append(f"{r['rel_err']:.1e}" + ("" if r["correct"] else " WRONG"))
                    else:
                        cell.append("exact" if r.get("exact") else "DIFF")
                row.append(" / ".join(cell))
            rows.append(row)
        out += ["### Correctness (sum: relative error against a float64 sum / max: exact)", "",
                _table(["version"] + [f"n={n}" for n in lengths], rows), ""]
    bw = [r for r in records if r.get("kind") == "bandwidth"]
    if bw:
        n = bw[0]["n"]
        out += [f"### Bandwidth at n = {n} (4 bytes x n / median time, L2 flushed; torch measured in the same run)", ""]
        out += [_table(["version", "op", "median ms", "IQR ms", "TB/s", "x torch"],
                       [[r["impl"], r["op"], r["median_ms"], f"{r['q1_ms']:.4f}-{r['q3_ms']:.4f}", r["tbps"], r.get("ratio_to_torch")]
                        for r in bw]), ""]
        ours = [r for r in bw if r["op"] == "sum" and not r["impl"].startswith("torch")]
        if ours:
            best = max(ours, key=lambda r: r["tbps"])
            ratio = best.get("ratio_to_torch") or 0
            out += [f"Best multi-block sum: **{best['impl']}**, {best['tbps']:.3f} TB/s = **{ratio:.3f}x torch.sum** "
                    f"(target >= 0.95x: {'met' if ratio >= 0.95 else 'NOT met'}).", ""]
        groups = list(dict.fromkeys(r["impl"] for r in bw if not r["impl"].startswith("torch")))
        series = {op: [next((r["tbps"] for r in bw if r["impl"] == g and r["op"] == op), None) for g in groups] for op in ("sum", "max")}
        peers = {op: next((r["tbps"] for r in bw if r["op"] == op and r["impl"].startswith("torch")), None) for op in ("sum", "max")}
        p = _bar_plot(groups, series, img / "reduction_bandwidth.png", "TB/s",
                      f"reduction, n={n} (torch.sum {fmt_number(peers['sum'])}, torch.amax {fmt_number(peers['max'])} TB/s)")
        out += [f"![reduction bandwidth]({p.relative_to(img.parent)})", ""]
    sweep = [r for r in records if r.get("kind") == "sweep"]
    if sweep:
        out += ["### Sum against length (median us / TB/s; same run)", "",
                markdown_table([dict(r, cell=f"{1e3 * r['median_ms']:.1f} us / {r['tbps']:.3g}") for r in sweep], ["n"], "impl", "cell"), ""]
        p = _sweep_plot(sweep, img / "reduction_sweep.png")
        out += [f"![time and bandwidth against n]({p.relative_to(img.parent)})", ""]
    return "\n".join(out)


# ---- transpose ----------------------------------------------------------------------------------
def transpose_section(env: dict, records: list[dict], img: Path) -> str:
    out = [_env(env), ""]
    corr = [r for r in records if r.get("kind") == "correctness"]
    if corr:
        out += ["### Correctness (exact equality with `x.t().contiguous()`, output poisoned with NaN)", "",
                _table(["version", "dtype", "shapes", "result"],
                       [[r["impl"], r["dtype"], str(len(r["shapes"])), "ok" if r["correct"] else "WRONG at " + ", ".join(r["failed"])]
                        for r in corr]), ""]
    bw = [r for r in records if r.get("kind") == "bandwidth"]
    if bw:
        out += ["### Useful bandwidth, TB/s (2 x rows x cols x element size / median time)", "",
                markdown_table(bw, ["shape", "dtype"], "impl", "tbps"), ""]
        big = [r for r in bw if r["shape"] == "32768x32768" and r["dtype"] == "fp32" and r["impl"] in ("naive", "tiled", "padded", "vec4")]
        if big:
            best = max(big, key=lambda r: r["tbps"])
            out += [f"Best fp32 32768x32768: **{best['impl']}**, {best['tbps']:.3f} TB/s = **{best['x_torch']:.2f}x** torch "
                    f"`t().contiguous()` (target >= 3: {'met' if best['x_torch'] >= 3 else 'NOT met'}) and "
                    f"**{best['of_copy']:.0%}** of the device copy (target >= 85%: {'met' if best['of_copy'] >= 0.85 else 'NOT met'}).", ""]
        for dtype in dict.fromkeys(r["dtype"] for r in bw):
            sub = [r for r in bw if r["dtype"] == dtype]
            shapes = list(dict.fromkeys(r["shape"] for r in sub))
            impls = list(dict.fromkeys(r["impl"] for r in sub))
            series = {i: [next((r["tbps"] for r in sub if r["shape"] == s and r["impl"] == i), None) for s in shapes] for i in impls}
            p = _bar_plot(shapes, series, img / f"transpose_bandwidth_{dtype}.png", "useful TB/s", f"transpose, {dtype}")
            out += [f"![transpose {dtype}]({p.relative_to(img.parent)})", ""]
    ncu = [r for r in records if r.get("kind") == "ncu"]
    if ncu:
        shape = f"{ncu[0]['rows']}x{ncu[0]['cols']}"

        def mp(r, key, digits=3):
            p = (r.get("predicted") or {}).get(key)
            return f"{fmt_number(r.get(key), digits)} / {fmt_number(p, digits)}"

        out += [f"### Nsight Compute, {shape}, one launch each (`ncu --clock-control none`): measured / predicted", "",
                _table(["dtype", "version", "ld sectors/req", "st sectors/req", "bank conflicts ld", "bank conflicts st",
                        "shared ld wavefronts/inst", "shared st wavefronts/inst", "DRAM bytes", "time us"],
                       [[r.get("dtype") or "-", r["impl"], mp(r, "ld_sectors_per_request"), mp(r, "st_sectors_per_request"),
                         mp(r, "bank_conflicts_ld", 6), mp(r, "bank_conflicts_st", 6), mp(r, "shared_ld_wavefronts_per_inst"),
                         mp(r, "shared_st_wavefronts_per_inst"), mp(r, "dram_bytes", 4),
                         fmt_number((r.get("duration_ns") or 0) / 1e3) if r.get("duration_ns") else "-"] for r in ncu]), ""]
    if ncu:
        raw = lambda r, k: (r.get("raw") or {}).get(k)  # noqa: E731
        pre = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_"
        out += ["Raw counters behind the ratios (bank conflicts = wavefronts beyond one per shared instruction here), "
                "DRAM traffic split, and the profiled kernel duration beside the event-timed median of the same shape:", "",
                _table(["dtype", "version", "shared ld inst", "shared ld wavefronts", "shared st inst", "shared st wavefronts",
                        "DRAM read B", "DRAM write B", "ideal each way B", "ncu us", "events median us"],
                       [[r.get("dtype") or "-", r["impl"], raw(r, "smsp__sass_inst_executed_op_shared_ld.sum"), raw(r, pre + "ld.sum"),
                         raw(r, "smsp__sass_inst_executed_op_shared_st.sum"), raw(r, pre + "st.sum"),
                         raw(r, "dram__bytes_read.sum"), raw(r, "dram__bytes_write.sum"),
                         (r.get("predicted") or {}).get("dram_bytes", 0) // 2 or "-",
                         fmt_number((r.get("duration_ns") or 0) / 1e3) if r.get("duration_ns") else "-",
                         next((fmt_number(1e3 * b["median_ms"]) for b in bw if b["shape"] == f"{r['rows']}x{r['cols']}"
                               and b["dtype"] == r.get("dtype") and b["impl"] == r["impl"]), "-")] for r in ncu]), ""]
    ncu_env = env.get("ncu")
    if ncu_env and ncu_env.get("error"):
        out += [f"ncu reported: {ncu_env['error']}", ""]
    return "\n".join(out)


# ---- sanitizer ----------------------------------------------------------------------------------
def sanitizer_section(env: dict, records: list[dict], img: Path) -> str:
    cells = [r for r in records if r.get("kind") == "cell"]
    verdicts = [r for r in records if r.get("kind") == "verdict"]
    info = env.get("sanitize", {})
    cs = env.get("compute_sanitizer") or ""
    m = re.search(r"Version (\S+)(?: \((build \d+)\))?", cs)
    cs = f"{m.group(1)}" + (f" ({m.group(2)})" if m.group(2) else "") if m else cs
    out = [f"{_env(env)}; compute-sanitizer: {cs}; "
           f"wall time {info.get('wall_seconds')} s{' (--quick)' if info.get('quick') else ''}", ""]
    tools = list(dict.fromkeys(r["tool"] for r in cells))
    cases = list(dict.fromkeys(r["impl"] for r in cells))

    def cell(case, tool):
        r = next((q for q in cells if q["impl"] == case and q["tool"] == tool), None)
        if r is None:
            return "-"
        if tool == "none" and r["outcome"] == "clean":
            return "right result" if r.get("result_ok") else "**wrong result**"
        return f"**{r['outcome']}**" if r["outcome"] != "clean" else "clean"

    out += ["### Case x tool (`none` = the same cases without a sanitizer)", "",
            _table(["case", "broken?"] + tools, [[c, "broken" if next(q for q in cells if q["impl"] == c).get("broken") else ""]
                                                 + [cell(c, t) for t in tools] for c in cases]), ""]
    caught = [r for r in cells if r["outcome"] in ("CAUGHT", "hung", "crashed", "error")]
    if caught:
        out += ["### First report of each flagged cell", ""]
        out += [f"- `{r['impl']}` / {r['tool']}: {r['outcome']}: {r.get('first') or r.get('detail') or r.get('error')}"
                + (f" ({r['reports']} reports)" if r.get("reports") else "") for r in caught]
        out.append("")
    tools_info = info.get("tools") or {}
    if tools_info:
        out += ["### Sanitizer processes (a case that kills the CUDA context restarts the rest in a fresh process)", "",
                _table(["tool", "processes", "cases per process", "exit codes", "ERROR SUMMARY per process", "hung"],
                       [[t, str(len(v.get("attempts", []))), ", ".join(str(len(a.get("cases", []))) for a in v.get("attempts", [])),
                         ", ".join(str(a.get("returncode")) for a in v.get("attempts", [])),
                         ", ".join("-" if a.get("errors") is None else str(a["errors"]) for a in v.get("attempts", [])),
                         "yes" if any(a.get("hung") for a in v.get("attempts", [])) else "no"] for t, v in tools_info.items()]), ""]
    if verdicts:
        cap = lambda t: re.sub(r"\. ([a-z])", lambda m: ". " + m.group(1).upper(), t)  # noqa: E731
        out += ["### Verdicts", ""] + [f"- `{r['impl']}`: {cap(r['verdict'])}" for r in verdicts] + [""]
    return "\n".join(out)


SECTIONS = {"reduction": reduction_section, "transpose": transpose_section, "sanitizer": sanitizer_section}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduction", help="JSON written by python -m labs.reduction --json")
    ap.add_argument("--transpose", help="JSON written by python -m labs.transpose [--ncu] --json")
    ap.add_argument("--sanitize", help="JSON written by python -m labs.sanitize --json")
    ap.add_argument("--docs", default=str(HERE), help="directory of the lab documents (default: docs/labs)")
    ap.add_argument("--print", action="store_true", help="print the generated Markdown instead of editing the documents")
    args = ap.parse_args(argv)
    docs = Path(args.docs)
    todo = {"reduction": args.reduction, "transpose": args.transpose, "sanitizer": args.sanitize}
    if not any(todo.values()):
        ap.error("give at least one of --reduction, --transpose, --sanitize")
    for name, run in todo.items():
        if not run:
            continue
        env, records = read_run(run)
        content = SECTIONS[name](env, records, docs / "img")
        if args.print:
            print(f"<!-- {name} -->\n{content}\n")
            continue
        doc = docs / f"{name}.md"
        doc.write_text(replace_block(doc.read_text(), name, content))
        print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
