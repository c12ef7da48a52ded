"""Turn recorded runs into Markdown tables and PNG plots (never from anything but the JSON), and
compare a run with a baseline run point by point.

    python -m tileattn.bench.report RUN.json --rows n --cols impl --value tflops [--plot out.png]
    python -m tileattn.bench.report RUN.json --compare BASELINE.json [--tolerance 0.03] [--impl tileattn]

--compare matches records on MATCH_KEYS and prints value(run) / value(baseline) per point; the exit
status is 1 when a point of the selected implementation moved by more than the tolerance either
way, or has no partner (e.g. issue #9: the seed table stays within 3% of docs/BENCHMARKS.md).
With --relative-to PEER each side's value is first divided by PEER's at the same point of the same
run, so the check compares tileattn / PEER then with tileattn / PEER now: a machine state that moves
both (the H200's SM clock stepped 1980 -> ~1620 MHz between measurements of one process on
2026-12-04, docs/BENCHMARKS.md session 28) cancels; a point whose peer is missing on either side fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .records import read_run


def fmt_number(v, digits: int = 3) -> str:
    """A table cell: "-" for None, `digits` significant digits below 1000, whole numbers above."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def fmt_cell(v, kind: str = "") -> str:
    """A table cell by kind: "frac" a fraction shown as a percentage, "pct" a value already in
    percent, "err" a relative error; anything else goes to fmt_number. "-" for None."""
    if v is None:
        return "-"
    if kind == "frac":
        return f"{100 * v:.0f}%"
    if kind == "pct":
        return f"{v:.0f}%"
    if kind == "err":
        return f"{v:.1e}"
    return fmt_number(v)


def environment_line(env: dict) -> str:
    keys = ("gpu", "driver", "torch", "torch_cuda", "nvrtc", "cuda_core", "triton", "l2_flush", "date_utc")
    commit = env.get("git_commit")
    code = f"; commit: {commit[:10]}{' (dirty)' if env.get('git_dirty') else ''}" if commit else ""
    return ("; ".join(f"{k}: {env.get(k)}" for k in keys if env.get(k) is not None) + code
            + f"; command: `{env.get('command')}`")


def pivot(records: list[dict], rows: list[str], col: str, value: str, where: dict | None = None):
    """(row keys, column names, {row: {col: value}}) in first-seen order."""
    where = where or {}
    table: dict[tuple, dict] = {}
    cols: list = []
    for r in records:
        if any(r.get(k) != v for k, v in where.items()):
            continue
        key = tuple(r.get(k) for k in rows)
        c = r.get(col)
        if c not in cols:
            cols.append(c)
        table.setdefault(key, {})[c] = r.get(value)
    return rows, cols, table


def markdown_table(records: list[dict], rows: list[str], col: str, value: str, where: dict | None = None) -> str:
    row_keys, cols, table = pivot(records, rows, col, value, where)
    lines = ["| " + " | ".join(row_keys + [str(c) for c in cols]) + " |",
             "|" + "---|" * (len(row_keys) + len(cols))]
    for key, cells in table.items():
        lines.append("| " + " | ".join([fmt_number(k) for k in key] + [fmt_number(cells.get(c)) for c in cols]) + " |")
    return "\n".join(lines)


def plot(records: list[dict], x: str, series: str, value: str, path: str | Path, *, where: dict | None = None,
         title: str = "", logx: bool = True, ylabel: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, names, table = pivot(records, [x], series, value, where)
    xs = [k[0] for k in table]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in names:
        ys = [table[(xv,)].get(name) for xv in xs]
        pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=str(name))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or value)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# The fields that name a benchmark point (a record lacking one has None there); the rest are results.
# (mode, block_size, config: the variant, paged-prefill and tuning records' points, absent elsewhere)
MATCH_KEYS = ("suite", "impl", "pass", "b", "h", "hkv", "n", "nk", "d", "dtype", "causal", "mode", "block_size",
              "config")


def median_rounds(records: list[dict]) -> list[dict]:
    """Records of repeated rounds (`bench attention / decode / variants --rounds`, field `round`) reduced to one per
    benchmark point (MATCH_KEYS): the round whose TFLOP/s is the median (the lower middle one for
    an even count), with `rounds` and every round's TFLOP/s added; a point where a round failed
    keeps that round's record. Records without `round` pass through unchanged, in order."""
    rounds_of: dict[tuple, list[dict]] = {}
    for r in records:
        if "round" in r:
            rounds_of.setdefault(tuple(r.get(k) for k in MATCH_KEYS), []).append(r)
    out = []
    for r in records:
        if "round" not in r:
            out.append(r)
            continue
        rounds = rounds_of.pop(tuple(r.get(k) for k in MATCH_KEYS), None)
        if rounds is None:  # the point's first round already stood for it
            continue
        failed = [x for x in rounds if x.get("status", "ok") != "ok" or "tflops" not in x]
        if failed or len(rounds) == 1:
            out.append(failed[0] if failed else rounds[0])
            continue
        ordered = sorted(rounds, key=lambda x: x["tflops"])
        out.append(dict(ordered[(len(ordered) - 1) // 2], rounds=len(ordered),
                        tflops_rounds=[round(x["tflops"], 1) for x in rounds]))
    return out


def compare(baseline: list[dict], run: list[dict], value: str = "tflops", impl: str | None = "tileattn",
            tolerance: float = 0.03, relative_to: str | None = None) -> tuple[list[dict], bool]:
    """Points of `run` beside their partners in `baseline` (same MATCH_KEYS, both carrying `value`),
    restricted to `impl` (None: all): [{"point": {...}, "baseline", "run", "ratio", "ok"}] and
    whether every point is within `tolerance` of its baseline. A point on one side only is listed
    with ratio None and counts as a failure. relative_to: compare value / relative_to's value at the
    same point of the same run instead of value itself (a point without that peer is None there);
    the peer's own points are not checked."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    impl_at = MATCH_KEYS.index("impl")

    def index(records):
        values = {tuple(r.get(k) for k in MATCH_KEYS): r[value] for r in records
                  if value in r and r[value] is not None}
        out = {}
        for key, v in values.items():
            if (impl is not None and key[impl_at] != impl) or (relative_to is not None and key[impl_at] == relative_to):
                continue
            if relative_to is not None:
                peer = values.get(key[:impl_at] + (relative_to,) + key[impl_at + 1:])
                v = v / peer if peer else None
            out[key] = v
        return out

    base, new = index(median_rounds(baseline)), index(median_rounds(run))
    rows, ok = [], True
    for key in sorted(set(base) | set(new), key=_point_order):
        b, n = base.get(key), new.get(key)
        ratio = n / b if b and n is not None else None  # b, n: None where a point or its peer is missing
        good = ratio is not None and abs(ratio - 1.0) <= tolerance
        ok &= good
        rows.append({"point": {k: v for k, v in zip(MATCH_KEYS, key) if v is not None}, "baseline": b, "run": n,
                     "ratio": ratio, "ok": good})
    return rows, ok


def _point_order(key: tuple) -> tuple:
    """Numbers in numeric order (4096 before 32768), then strings, None last, field by field."""
    return tuple((v is None, v if isinstance(v, (int, float)) else 0, str(v)) for v in key)


def compare_table(rows: list[dict], value: str, tolerance: float) -> str:
    """`value`: what the baseline and run columns hold (e.g. "tflops / sdpa_cudnn's")."""
    lines = [f"| point | baseline {value} | run {value} | run / baseline | within {tolerance:.0%} |", "|---|---|---|---|---|"]
    for r in rows:
        point = " ".join(f"{k}={v}" for k, v in r["point"].items())
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {point} | {fmt_cell(r['baseline'])} | {fmt_cell(r['run'])} | {ratio} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="JSON written by a tileattn benchmark")
    ap.add_argument("--rows", default="n", help="comma-separated keys that identify a row")
    ap.add_argument("--cols", default="impl", help="key whose values become columns")
    ap.add_argument("--value", default="tflops", help="key shown in the cells")
    ap.add_argument("--plot", help="also write a PNG line plot (x = first row key)")
    ap.add_argument("--compare", metavar="BASELINE", help="a baseline run: print each point's run / baseline ratio")
    ap.add_argument("--tolerance", type=float, default=0.03, help="--compare: allowed relative change (0.03 = 3%%)")
    ap.add_argument("--impl", default="tileattn", help="--compare: the implementation checked ('all': every one)")
    ap.add_argument("--relative-to", metavar="PEER",
                    help="--compare: check value / PEER's value at the same point (e.g. sdpa_cudnn), per run")
    args = ap.parse_args(argv)
    if args.tolerance < 0:
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")
    env, records = read_run(args.run)
    if args.relative_to and not args.compare:
        ap.error("--relative-to needs --compare")
    if args.compare:
        base_env, base_records = read_run(args.compare)
        for name, recs in (("run", records), ("baseline", base_records)):
            if args.relative_to and not any(r.get("impl") == args.relative_to for r in recs):
                ap.error(f"--relative-to {args.relative_to}: the {name} has no record of that implementation "
                         f"(it has {sorted({str(r.get('impl')) for r in recs})})")
        print("run:      " + environment_line(env))
        print("baseline: " + environment_line(base_env) + "\n")
        rows, ok = compare(base_records, records, args.value, None if args.impl == "all" else args.impl,
                           args.tolerance, relative_to=args.relative_to)
        shown = args.value if args.relative_to is None else f"{args.value} / {args.relative_to}'s"
        print(compare_table(rows, shown, args.tolerance))
        print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} points within {args.tolerance:.0%}")
        return 0 if ok and rows else 1
    rows = args.rows.split(",")
    records = median_rounds(records)  # a run timed in rounds: one cell per point, its median round
    print(environment_line(env) + "\n")
    print(markdown_table(records, rows, args.cols, args.value))
    if args.plot:
        print(f"\nplot: {plot(records, rows[0], args.cols, args.value, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
