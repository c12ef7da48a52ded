"""A/B of source trees in alternating processes: one `tileattn bench` command run with each tree
first on PYTHONPATH, tree after tree, --repeat times, then each point's median per process, its
ratio to a peer timed in the same process, and each tree against the first.

    python scripts/ab_trees.py --tree main=/tmp/main-src --tree trial=src --repeat 2 --out ab -- \\
        bench attention --seq 2048 --seq 4096 --impl tileattn --impl sdpa_cudnn --forward-only --rounds 3
    python scripts/ab_trees.py --summary ab/*.json

A tree is a directory holding the `tileattn` package: a checkout's src/, or another commit's, made by
`git archive REV src | tar x -C DIR --strip-components=1`. Why processes in turn: on the H200 the
machine's state moved by up to 15 % between processes a minute apart (docs/BENCHMARKS.md, session 28),
so each tree gets processes spread over the same minutes (the order rotates every repetition: A B,
B A, ...), and the ratio to a peer of the same process (cuDNN) travels with every figure. The trials
of docs/attention_fwd_sm90.md (sessions 29-31) followed this protocol from shell scripts outside the
repository, before this script existed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # tileattn from a checkout

from tileattn.bench.records import read_run  # noqa: E402
from tileattn.bench.report import MATCH_KEYS  # noqa: E402

# Fields that name a point: the report's matching keys without the implementation (a column here),
# the mask first so that a point reads "causal=True n=2048".
POINT_FIELDS = ("suite", "pass", "causal") + tuple(k for k in MATCH_KEYS if k not in ("impl", "suite", "pass", "causal"))


def parse_tree(text: str) -> tuple[str, Path]:
    """NAME=PATH, PATH holding the tileattn package."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree takes NAME=PATH, got {text!r}")
    if not (Path(path) / "tileattn" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {name}: {path} holds no tileattn package (tileattn/__init__.py)")
    return name, Path(path)


def run_order(names: list[str], repeat: int) -> list[tuple[str, int]]:
    """(tree, repetition) in the order the processes run: every tree once per repetition, the
    starting tree rotating from one repetition to the next."""
    order = []
    for rep in range(repeat):
        shift = rep % len(names)
        order += [(name, rep) for name in names[shift:] + names[:shift]]
    return order


def load(paths) -> list[tuple[str, dict]]:
    """(process label, record) for every timed record of the given JSON files (the harness's
    {"environment", "records"}); the label is the file's stem, e.g. trial-1."""
    out = []
    for path in paths:
        _, records = read_run(path)
        out += [(Path(path).stem, r) for r in records if r.get("tflops") is not None and r.get("status", "ok") == "ok"]
    return out


def summary(paths, peer: str = "sdpa_cudnn") -> str:
    """A Markdown table: per point and implementation, each process's median TFLOP/s over its
    timing rounds (with the ratio to `peer` in the same process, for every implementation but the
    peer: tileattn against sdpa_cudnn, or a variant against `plain` in `bench variants`), and per
    tree the median of its processes against the first tree's."""
    medians = collections.defaultdict(list)  # (point, impl, process) -> TFLOP/s of each round
    for label, r in load(paths):
        point = tuple((f, r[f]) for f in POINT_FIELDS if f in r)
        medians[(point, r["impl"], label)].append(r["tflops"])
    if not medians:
        return "no timed records"
    processes = sorted({label for _, _, label in medians})
    trees = list(dict.fromkeys(label.rsplit("-", 1)[0] for label in processes))
    lines = ["| point | impl | " + " | ".join(trees) + " | " + " | ".join(f"{t} / {trees[0]}" for t in trees[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(trees) - 1)]
    points = {p for p, _, _ in medians}
    varying = {k for k in POINT_FIELDS if len({dict(p).get(k) for p in points}) > 1}  # name points by these
    for point, impl in sorted({(p, i) for p, i, _ in medians}, key=str):
        cells, per_tree = [], []
        for tree in trees:
            values = []
            for label in (p for p in processes if p.rsplit("-", 1)[0] == tree):
                rounds = medians.get((point, impl, label))
                if not rounds:
                    continue
                value = statistics.median(rounds)
                peer_rounds = medians.get((point, peer, label))
                ratio = f" ({value / statistics.median(peer_rounds):.3f})" if impl != peer and peer_rounds else ""
                values.append((value, f"{value:.0f}{ratio}"))
            cells.append(", ".join(text for _, text in values) or "-")
            per_tree.append(statistics.median(v for v, _ in values) if values else None)
        ratios = [f"{v / per_tree[0]:.3f}" if v and per_tree[0] else "-" for v in per_tree[1:]]
        name = " ".join(f"{k}={v}" for k, v in point if k in varying) or "-"
        lines.append(f"| {name} | {impl} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=parse_tree, action="append", default=[], help="NAME=PATH (at least two)")
    ap.add_argument("--repeat", type=int, default=2, help="processes per tree (default 2)")
    ap.add_argument("--out", type=Path, help="folder for the records, one NAME-REP.json per process")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one process may take")
    ap.add_argument("--peer", default="sdpa_cudnn", help="the implementation ratios are taken to")
    ap.add_argument("--summary", nargs="+", metavar="JSON", help="only summarize these records")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- bench ... (a `tileattn bench` command)")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(args.summary, args.peer))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    names = [name for name, _ in args.tree]
    if len(args.tree) < 2 or len(set(names)) != len(names):
        ap.error("give at least two --tree NAME=PATH with different names")
    if not command or command[0] != "bench" or "--json" in command:
        ap.error("the command is a `tileattn bench ...` command without --json (this script adds it)")
    if args.repeat < 1 or args.out is None:
        ap.error("need --out and --repeat >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    paths = dict(args.tree)
    written = []
    for name, rep in run_order(names, args.repeat):
        path = args.out / f"{name}-{rep + 1}.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(paths[name].resolve())] + [p for p in [env.get("PYTHONPATH")] if p])
        print(f"== {name}, process {rep + 1}: {' '.join(command)}", flush=True)
        try:
            result = subprocess.run([sys.executable, "-m", "tileattn", *command, "--json", str(path)], env=env,
                                    timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            print(f"{name}, process {rep + 1}: still running after --timeout {args.timeout:g} s, stopped", file=sys.stderr)
            return 1
        if result.returncode != 0:
            print(result.stdout[-2000:] + result.stderr[-2000:], file=sys.stderr)
            print(f"{name}, process {rep + 1}: exit status {result.returncode}", file=sys.stderr)
            return 1
        written.append(path)
    print(summary(written, args.peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
