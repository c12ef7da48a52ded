"""`make gpu-check`: the one command for a device run. Uses the machine's own python3, nothing installed.

Steps (each logged into REPORT_DIR, a summary table printed last):
  1. environment (tileattn info), and the resource audit with the machine's NVRTC (--no-audit skips it)
  2. pytest -m gpu                       -> junit-gpu.xml
  3. compute-sanitizer memcheck, racecheck, synccheck, initcheck over `pytest -m sanitize`
     (the GPU tests' small cases)        -> sanitizer-<tool>.log
  4. benchmarks named with --bench (vector_add always): each a `python3 -m MODULE --json ...`
                                          -> bench-<name>.json
Exit status is non-zero when a test fails, a GPU test was skipped, or a sanitizer reports errors. A
sanitizer tool's row says how many cases passed under it and counts a case that skips itself under
that tool ("N case(s) skipped").

With --sanitizer-jobs N > 1 the sanitizer runs go concurrently: the files holding `sanitize` cases
(found by `pytest --collect-only`) are split into shards of about equal case counts, one process per
(tool, shard), at most N at a time; a tool's result sums its shards' error counts (rc: the worst).

A whole run may not fit one 10-minute device call: run it in parts, each into its own report
directory (e.g. `--no-sanitizer`; then `--no-tests --no-audit --bench "" --sanitizer-tools
memcheck,synccheck`; then the same with racecheck,initcheck), then `--merge DIR --merge DIR ...`
writes one summary of the parts into --report-dir: the counts summed, each sanitizer tool's result,
and `whole` true only when the parts ran at one commit, the GPU tests ran, and all four sanitizer
tools did (each in one part); the exit status is 0 only for a whole, passing merge.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Benchmarks runnable by name: module and its arguments ("{out}" = the report directory; the
# JSON path is appended).
BENCHES = {
    "vector_add": ["-m", "labs.vector_add"],
    "attention": ["-m", "tileattn.cli", "bench", "attention"],
    "attention-quick": ["-m", "tileattn.cli", "bench", "attention", "--quick"],
    "overhead": ["-m", "tileattn.cli", "bench", "overhead"],
    "startup": ["-m", "tileattn.cli", "bench", "startup", "--profile", "{out}/startup-profile.txt"],
    "decode": ["-m", "tileattn.cli", "bench", "decode"],
    "decode-quick": ["-m", "tileattn.cli", "bench", "decode", "--quick"],
    "varlen": ["-m", "tileattn.cli", "bench", "varlen"],
    "engine-quick": ["-m", "tileattn.cli", "bench", "engine", "--quick"],
    "reduction": ["-m", "labs.reduction"],
    "transpose": ["-m", "labs.transpose", "--ncu"],
    "sanitize": ["-m", "labs.sanitize"],
    "gemm": ["-m", "labs.gemm"],
    "pipeline": ["-m", "labs.pipeline"],
    "triton": ["-m", "labs.triton_lab", "--ir-dir", "{out}/triton_ir"],
}


def run(cmd: list[str], log: Path, timeout: float, **env_extra: str) -> tuple[int, float]:
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nTIMEOUT after {timeout} s\n")
            rc = 124
    return rc, time.perf_counter() - start


def junit_counts(path: Path) -> dict:
    if not path.exists():
        return {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def sanitizer_summary(log: Path) -> str:
    text = log.read_text(errors="replace")
    # memcheck/synccheck/initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: ...
    # (N errors, M warnings)"
    m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"SUMMARY: .*\((\d+) errors?", text)
    if m:
        return f"{m.group(1)} errors"
    return "no summary (see log)"


class SanitizerRun(NamedTuple):
    """One compute-sanitizer process over a shard of the sanitize cases."""

    rc: int
    seconds: float
    summary: str   # sanitizer_summary of its log
    passed: int    # cases that passed under this tool (pytest_counts)
    skipped: int   # cases that skipped themselves under this tool (pytest_counts)


def pytest_counts(log: Path) -> tuple[int, int]:
    """(passed, skipped) of the last pytest summary line in a sanitizer run's log ((0, 0) if none): the
    passed count shows what the tool checked (a row of 0 errors over no cases would say nothing); a
    case that skips itself under a tool (e.g. initcheck, which cannot see cuBLAS's writes) is
    reported, not counted as checked."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    counts = [re.search(rf"(\d+) {word}", lines[-1]) if lines else None for word in ("passed", "skipped")]
    return tuple(int(m.group(1)) if m else 0 for m in counts)


def sanitize_files(py: str, targets: list[str], kw: list[str]) -> dict[str, int]:
    """{test file: number of `sanitize` cases} among the targets (pytest --collect-only)."""
    out = subprocess.run([py, "-m", "pytest", *targets, "-m", "sanitize", "--collect-only", "-q", "-p",
                          "no:cacheprovider", *kw], capture_output=True, text=True, timeout=600)
    files: dict[str, int] = {}
    for line in out.stdout.splitlines():
        if "::" in line:
            name = line.split("::", 1)[0]
            files[name] = files.get(name, 0) + 1
    return files


def shards(files: dict[str, int], n: int) -> list[list[str]]:
    """The files in at most n groups of about equal case counts (largest first, each to the lightest)."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, min(n, len(files))))]
    for name in sorted(files, key=lambda f: (-files[f], f)):
        i = min(range(len(groups)), key=lambda g: groups[g][0])
        groups[i] = (groups[i][0] + files[name], groups[i][1] + [name])
    return [sorted(g) for _, g in groups if g]


def combined_summary(summaries: list[str]) -> str:
    """One tool's summary from its shards' (sanitizer_summary strings)."""
    counts = [re.fullmatch(r"(\d+) errors", s) for s in summaries]
    if all(counts):
        return f"{sum(int(m.group(1)) for m in counts)} errors" + (f" ({len(counts)} shards)" if len(counts) > 1 else "")
    return "no summary (see logs)"


def git_commit() -> str | None:
    """The tree's commit: $TILEATTN_GIT_COMMIT on the GPU machine (its copy has no .git), else git's."""
    if os.environ.get("TILEATTN_GIT_COMMIT"):
        return os.environ["TILEATTN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip() if out.returncode == 0 else ""
    return commit or None


def step_table(rows) -> list[str]:
    return ["| step | result | seconds |", "|---|---|---|"] + [f"| {a} | {b} | {s:.0f} |" for a, b, s in rows]


def merge(parts: list[str], out: Path) -> int:
    """One summary of several parts' report directories (see the module docstring). Raises
    SystemExit naming the part when a summary is missing or a sanitizer tool ran in two parts."""
    summaries = []
    for part in parts:
        path = Path(part) / "summary.json"
        if not path.exists():
            raise SystemExit(f"--merge {part}: no summary.json (did that part finish?)")
        summaries.append(json.loads(path.read_text()))
    counts = {k: sum(s["pytest"][k] for s in summaries) for k in ("tests", "failures", "errors", "skipped")}
    sanitizer, benches, rows = {}, {}, []
    for part, s in zip(parts, summaries):
        for tool, result in s["sanitizer"].items():
            if tool in sanitizer:
                raise SystemExit(f"--merge: sanitizer {tool} ran in two parts ({sanitizer[tool]['part']} and {part})")
            sanitizer[tool] = dict(result, part=part)
        benches.update(s["benches"])
        rows += [(f"[{Path(part).name}] {a}", b, sec) for a, b, sec in s.get("steps", [])]
    commits = sorted({str(s.get("commit")) for s in summaries})  # "None": a part that knew no commit
    missing = [t for t in SANITIZER_TOOLS if t not in sanitizer]
    why_not_whole = ([f"parts at commits {commits}"] if len(commits) != 1 or commits == ["None"] else [])
    why_not_whole += [] if counts["tests"] else ["no GPU tests ran"]
    why_not_whole += [f"sanitizer tools not run: {', '.join(missing)}"] if missing else []
    ok, whole = all(s["ok"] for s in summaries), not why_not_whole
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(
        {"commit": commits[0] if len(commits) == 1 else commits, "parts": parts, "pytest": counts,
         "sanitizer": sanitizer, "benches": benches, "steps": rows, "ok": ok, "whole": whole}, indent=1))
    lines = step_table(rows)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nGPU CHECK (merged from {len(parts)} parts) " + ("PASSED" if ok else "FAILED") +
          ("; whole" if whole else "; NOT whole: " + "; ".join(why_not_whole)) + f" (report in {out})")
    return 0 if ok and whole else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-dir", default="gpu-report")
    ap.add_argument("--bench", default="vector_add", help=f"comma-separated, from {sorted(BENCHES)}")
    ap.add_argument("--tests", default="tests", help="pytest targets, comma-separated (files or directories)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression for the GPU tests")
    ap.add_argument("--ignore", action="append", default=[],
                    help="test file pytest skips collecting (repeatable): e.g. tests that need two GPUs on a one-GPU "
                         "machine, whose skips would otherwise count as failures")
    ap.add_argument("--workers", type=int, default=1,
                    help="pytest-xdist processes for the GPU tests (default 1: none). They share the one GPU; most "
                         "GPU tests are short launches plus host-side checking, so a few workers shorten a "
                         "device run. Needs pytest-xdist (carry its wheel to a machine without it)")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--no-audit", action="store_true",
                    help="skip step 1's resource audit with the machine's NVRTC (minutes of compiling every "
                         "program; a device call is capped at 10 minutes)")
    ap.add_argument("--sanitizer-tools", default=",".join(SANITIZER_TOOLS))
    ap.add_argument("--sanitizer-jobs", type=int, default=1,
                    help="sanitizer processes at a time (default 1: the tools one after another over every "
                         "target); N > 1 shards the files with sanitize cases into N / tools groups per tool")
    ap.add_argument("--no-tests", action="store_true", help="skip step 2 (a part that only sanitizes or benchmarks)")
    ap.add_argument("--merge", action="append", default=[], metavar="DIR",
                    help="merge the summaries of earlier parts' report directories into --report-dir (repeatable); "
                         "runs nothing")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.report_dir))
    if args.workers < 1:
        ap.error(f"--workers must be at least 1, got {args.workers}")
    if args.sanitizer_jobs < 1:
        ap.error(f"--sanitizer-jobs must be at least 1, got {args.sanitizer_jobs}")
    if args.workers > 1:
        import importlib.util

        if importlib.util.find_spec("xdist") is None:
            ap.error("--workers > 1 needs pytest-xdist, which this python3 cannot import (pip install --target DIR "
                     "its wheel and execnet's, then put DIR on PYTHONPATH)")
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    targets = [t for t in args.tests.split(",") if t]
    rows: list[tuple[str, str, float]] = []
    failed = False

    rc, sec = run([py, "-m", "tileattn.cli", "info"], out / "info.log", 120)
    rows.append(("tileattn info", "ok" if rc == 0 else f"rc={rc}", sec))

    # The resource audit again with this machine's NVRTC (CI audits with the PyPI NVRTC): a kernel
    # at the 255-register edge can spill under one compiler version and not another. Reported in
    # the table, not counted as a failure: the zero-spill rule is enforced by CI's `tileattn check`;
    # a difference here is a finding to record, not a wrong result.
    if not args.no_audit:
        rc, sec = run([py, "-m", "tileattn.cli", "check", "--arch", "sm_90a", "--with", "labs.kernels"],
                      out / "check-device-nvrtc.log", 900)
        lines = (out / "check-device-nvrtc.log").read_text(errors="replace").strip().splitlines()
        tail = lines[-1] if lines else "(no output)"
        rows.append(("tileattn check (device NVRTC)", tail if rc == 0 else f"rc={rc}: {tail}", sec))

    kw = (["-k", args.keyword] if args.keyword else []) + [f"--ignore={path}" for path in args.ignore]
    # With workers, the tests marked `exclusive` (they need the GPU to themselves) run afterwards in
    # one process.
    runs = [("gpu", [])] if args.workers == 1 else [("gpu and not exclusive", ["-n", str(args.workers)]),
                                                   ("gpu and exclusive", [])]
    if args.no_tests:
        runs = []
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for i, (marks, workers) in enumerate(runs):
        junit = out / ("junit-gpu.xml" if i == 0 else "junit-gpu-exclusive.xml")
        log = out / ("pytest-gpu.log" if i == 0 else "pytest-gpu-exclusive.log")
        rc, sec = run([py, "-m", "pytest", *targets, "-m", marks, "-q", "-rfEs", "-p", "no:cacheprovider",
                       f"--junitxml={junit}", *workers, *kw], log, 1800)
        counts = junit_counts(junit)
        c = {k: c[k] + counts[k] for k in c}
        # rc 5: nothing collected (e.g. no exclusive test among the targets)
        failed |= rc not in (0, 5) or (rc == 5 and i == 0)
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        rows.append((f"pytest -m '{marks}'", f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
                                             f"{counts['skipped']} skipped", sec))
    failed |= c["skipped"] > 0 or (c["tests"] == 0 and not args.no_tests)

    tools = [] if args.no_sanitizer else [t for t in args.sanitizer_tools.split(",") if t]
    groups = [targets]
    if tools and args.sanitizer_jobs > 1:
        files = sanitize_files(py, targets, kw)
        if not files:
            raise SystemExit("--sanitizer-jobs: pytest collected no sanitize case among the targets")
        groups = shards(files, max(1, args.sanitizer_jobs // len(tools)))
    jobs = [(tool, i, group) for tool in tools for i, group in enumerate(groups)]

    def sanitize(job):
        tool, i, group = job
        log = out / (f"sanitizer-{tool}.log" if len(groups) == 1 else f"sanitizer-{tool}-{i}.log")
        cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "1",
               py, "-m", "pytest", *group, "-m", "sanitize", "-q", "-p", "no:cacheprovider", *kw]
        # Tests read TILEATTN_SANITIZER to skip work that only slows the sanitizer down or that it
        # cannot follow (e.g. the backward tests' parallel precompile in child processes, which
        # crashed racecheck; the earlier plain pytest run has already filled the kernel cache).
        rc, sec = run(cmd, log, 900, TILEATTN_SANITIZER=tool)
        return SanitizerRun(rc, sec, sanitizer_summary(log), *pytest_counts(log))

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.sanitizer_jobs) as pool:
        results = list(pool.map(sanitize, jobs))
    sanitizer = {}
    for tool in tools:
        mine = [r for (t, _, _), r in zip(jobs, results) if t == tool]
        rc = next((r.rc for r in mine if r.rc != 0), 0)
        summary, sec = combined_summary([r.summary for r in mine]), max(r.seconds for r in mine)
        passed, skipped = sum(r.passed for r in mine), sum(r.skipped for r in mine)
        sanitizer[tool] = {"rc": rc, "summary": summary, "seconds": sec, "passed": passed, "skipped": skipped}
        failed |= rc != 0
        skips = f", {skipped} case(s) skipped (see log)" if skipped else ""
        rows.append((f"sanitizer {tool}", f"{summary}, {passed} cases passed, rc={rc}{skips}", sec))

    benches = {}
    for name in [b for b in args.bench.split(",") if b]:
        if name not in BENCHES:
            raise SystemExit(f"unknown benchmark {name!r}; known: {sorted(BENCHES)}")
        path = out / f"bench-{name}.json"
        cmd = [a.replace("{out}", str(out)) for a in BENCHES[name]]
        rc, sec = run([py, *cmd, "--json", str(path)], out / f"bench-{name}.log", 1200)
        benches[name] = {"rc": rc, "seconds": sec, "json": path.name if path.exists() else None}
        failed |= rc != 0
        rows.append((f"bench {name}", "ok" if rc == 0 else f"rc={rc}", sec))

    (out / "summary.json").write_text(json.dumps(
        {"commit": git_commit(), "pytest": c, "sanitizer": sanitizer, "benches": benches, "steps": rows,
         "ok": not failed}, indent=1))
    lines = step_table(rows)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    for name in benches:  # the tail of each benchmark's own table, for the reader of this output
        log = (out / f"bench-{name}.log").read_text(errors="replace").splitlines()
        print(f"\n--- bench {name} (last lines) ---\n" + "\n".join(log[-25:]))
    print("\n" + "\n".join(lines))
    print("\nGPU CHECK " + ("FAILED" if failed else "PASSED") + f" (report in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
