"""Lab 1c: compute-sanitizer over every correct and broken lab kernel; who catches which bug.

    python -m labs.sanitize [--quick] [--tools memcheck,racecheck,synccheck,initcheck] [--json out.json]

For each tool, one python3 process runs all selected cases (correct versions first, broken ones
last) under `compute-sanitizer --tool TOOL --report-api-errors no --error-exitcode 1 --log-file F`;
each report is attributed to a case by the kernel it names (every version launches kernels of its
own). A case that crashes the process (memcheck stops a kernel at its first bad access and the
CUDA context is lost) or hangs (a barrier that never completes) is recorded as such, and the
remaining cases rerun in a fresh process. The tools run in parallel processes (--jobs); a plain
run without any tool (column `none`) shows whether the bug is visible in the result at all.

Children run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own cudaMalloc: memcheck
then sees a store one element past a small tensor as out of bounds (inside a cached segment it
would land in memory torch owns and go unseen), and initcheck sees fresh, never-written memory.
initcheck always instruments every kernel: a `--kernel-name` filter would hide torch's own writes
and report every read as uninitialized.

Output: a matrix case x tool -> clean / CAUGHT / hung / crashed, the first report line of each
caught cell, and a verdict per case. Correct versions must be clean under all four tools; each
broken version should be caught by the tool aimed at it, or the verdict says plainly that none
caught it and why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
ROOT = Path(__file__).resolve().parents[1]

# Broken reduction versions -> the tool aimed at the bug, and why the others (should) stay silent.
EXPECTED = {
    "bug_barrier_in_branch": ("synccheck", "a barrier reached by only part of the block is what synccheck checks; "
                              "no memory access is out of bounds, uninitialized or racing."),
    "bug_missing_barrier": ("racecheck", "a shared-memory read and a write from different warps with no barrier "
                            "between them is a hazard racecheck reports; the accesses are in bounds."),
    "bug_oob_store": ("memcheck", "a global store past the end of an allocation; the slot it skipped (out[0]) is "
                      "then read by the next pass, which initcheck may also report."),
    "bug_uninit_shared": (None, "no tool tracks the initialization of shared memory: initcheck covers global memory "
                          "only, racecheck reports ordering hazards between two accesses (a read of a word nobody "
                          "wrote is not one), memcheck checks bounds. Only a result check can see this bug, and "
                          "only when the stale words are not the operation's identity."),
    "bug_final_reads_all": ("initcheck", "the final pass reads partials[count:B], global memory nothing wrote."),
}
# Why a broken version may escape its own tool (printed when it does).
ESCAPE_WHY = {
    "bug_barrier_in_branch": "on sm_70+ a barrier counts arrivals per barrier id, whichever __syncthreads() call "
                             "they come from, and counts exited warps as arrived, so each generation completes "
                             "and the result is right; synccheck reports only the misuse it can observe, and some "
                             "builds have been seen to report none for divergent block barriers.",
    "bug_missing_barrier": "racecheck only sees accesses this run made; with a block that fits in one warp's "
                           "worth of active data there is no cross-warp hazard.",
    "bug_oob_store": "the store landed inside another live allocation (e.g. torch's caching allocator was on).",
    "bug_final_reads_all": "the padded slots had been written earlier in this process (memory reuse).",
}


@dataclass
class Case:
    key: str                       # "reduction:v2_sequential"
    family: str
    version: str
    broken: str | None = None
    expressions: tuple[str, ...] = ()  # kernels this case owns (for attributing reports)


# ---- cases --------------------------------------------------------------------------------------------
def all_cases() -> list[Case]:
    from labs import reduction, transpose
    from labs.kernels.transpose import expression as texpr

    cases = []
    for k, v in reduction.VERSIONS.items():
        cases.append(Case(f"reduction:{k}", "reduction", k, v.broken, (v.expr("sum"), v.expr("max"))))
    for v in transpose.VERSIONS:
        cases.append(Case(f"transpose:{v}", "transpose", v, None, tuple(texpr(v, d) for d in transpose.DTYPES)))
    try:
        from labs import vector_add

        for v in vector_add.VERSIONS:
            cases.append(Case(f"vector_add:{v}", "vector_add", v, None, (v,)))
    except ImportError:
        pass
    # correct first, broken last; among broken, the ones that may kill the process go last
    last = ("bug_barrier_in_branch", "bug_oob_store")
    return sorted(cases, key=lambda c: (c.broken is not None, c.version in last, last.index(c.version) if c.version in last else 0))


def select_cases(quick: bool, only: list[str] | None = None) -> list[Case]:
    cases = all_cases()
    if only:
        unknown = [k for k in only if not any(c.key == k or c.version == k for c in cases)]
        if unknown:
            raise ValueError(f"unknown cases {unknown}; known: {', '.join(c.key for c in cases)}")
        return [c for c in cases if c.key in only or c.version in only]
    if quick:  # the reduction ladder's ends and every broken version
        keep = {"v2_sequential", "v4_warp_shuffle", "v5_vec4_b256_u4", "v6_onepass_b256_u4"}
        return [c for c in cases if c.family == "reduction" and (c.broken or c.version in keep)]
    return cases


# ---- the child: run cases, write progress -----------------------------------------------------------------
def _sizes(quick: bool):
    red = (1003,) if quick else (1, 33, 1003, 5000)
    tr = ((33, 65), (64, 128)) if quick else ((1, 37), (33, 65), (64, 128), (130, 260))
    va = (1003,) if quick else (1, 1003, 4099)
    return red, tr, va


def run_case(case: Case, quick: bool) -> tuple[bool, str]:
    """Run one case on small sizes; (all results correct, short detail)."""
    import torch

    red, tr, va = _sizes(quick)
    wrong = []
    if case.family == "reduction":
        from labs import reduction

        for op in ("sum", "max"):
            for n in red:
                rec = reduction.self_check(case.version, n, op, allow_broken=True)
                if not rec["correct"]:
                    wrong.append(f"{op} n={n}: {rec['got']:.6g} vs {rec['ref']:.6g}")
    elif case.family == "transpose":
        from labs import transpose

        for d in transpose.DTYPES:
            for r, c in tr:
                if not transpose.check_version(case.version, r, c, d):
                    wrong.append(f"{d} {r}x{c}")
    elif case.family == "vector_add":
        from labs import vector_add

        for n in va:
            a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            if not torch.equal(vector_add.vector_add(a, b, version=case.version), a + b):
                wrong.append(f"n={n}")
    else:
        raise ValueError(case.family)
    torch.cuda.synchronize()
    return not wrong, "; ".join(wrong[:3])


def child_main(keys: list[str], progress: str, quick: bool) -> int:
    import torch

    by_key = {c.key: c for c in all_cases()}
    with open(progress, "a") as log:
        def note(**event):
            log.write(json.dumps(event) + "\n")
            log.flush()
            os.fsync(log.fileno())

        for key in keys:
            note(case=key, event="start")
            try:
                ok, detail = run_case(by_key[key], quick)
                note(case=key, event="done", ok=ok, detail=detail)
            except Exception as exc:  # a sanitizer-stopped kernel surfaces here as a CUDA error
                note(case=key, event="error", error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
                try:
                    torch.cuda.synchronize()
                    torch.ones(1, device="cuda").add_(1).item()
                except Exception:
                    return 3  # the CUDA context is gone: the parent reruns the remaining cases
    return 0


# ---- parsing compute-sanitizer reports -------------------------------------------------------------------
PREFIX = "========="
_NOT_ERRORS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application returned",
               "Error: process didn't terminate", "This can happen", "Program hit")


def _read_kernel_name(text: str, start: int) -> str | None:
    """The kernel name (with template arguments) starting at text[start:], demangled or mangled."""
    s = text[start:]
    if s.startswith("void "):
        s = s[5:]
    if s.startswith("_Z"):
        m = re.match(r"_Z(?:N\d*)?(\d+)", s)
        if m:
            n, pos = int(m.group(1)), m.end()
            return s[pos:pos + n] + "<?>"
        return None
    m = re.match(r"[A-Za-z_][\w:]*", s)
    if not m:
        return None
    name, pos = m.group(0), m.end()
    if pos < len(s) and s[pos] == "<":
        depth, j = 0, pos
        while j < len(s):
            depth += s[j] == "<"
            depth -= s[j] == ">"
            j += 1
            if depth == 0:
                break
        name += s[pos:j]
    return name


def normalize_kernel(name: str) -> str:
    """'reduce_vec4<SumOp, (int)256, (int)4>' and 'reduce_vec4<SumOp, 256, 4>' -> 'reduce_vec4<SumOp,256,4>'."""
    name = re.sub(r"\((?:unsigned )?(?:int|long|short|char|long long|bool)\)", "", name)
    name = re.sub(r"(?<=\d)[uUlL]+\b", "", name)
    return re.sub(r"\s+", "", name)


@dataclass
class Report:
    message: str                 # the report's first line, e.g. "Invalid __global__ write of size 4 bytes"
    lines: list[str] = field(default_factory=list)
    kernel: str | None = None    # normalized, e.g. "reduce_bug_oob_store<SumOp,256>"
    where: str | None = None     # "reduction.cu:251" when -lineinfo was on

    @property
    def first_line(self) -> str:
        """One line: what (kernel names cut out), in which kernel, where."""
        what = self.message.split(" at ", 1)[0]
        if len(self.lines) > 1 and self.lines[1].startswith("and "):  # racecheck: the other access
            what += " " + self.lines[1].split(" at ", 1)[0]
            hazards = re.search(r"\[(\d+) hazards?\]", self.lines[1])
            if hazards:
                what += f" ({hazards.group(1)} hazards)"
        loc = f" in {self.kernel}" if self.kernel else ""
        return what + loc + (f" at {self.where}" if self.where else "")


def parse_sanitizer_log(text: str) -> tuple[list[Report], dict]:
    """compute-sanitizer's log -> (reports, {'errors': N from the ERROR SUMMARY, 'notes': [...]})."""
    reports: list[Report] = []
    summary: dict = {"errors": None, "notes": []}
    cur: Report | None = None
    for raw in text.splitlines():
        if not raw.startswith(PREFIX):
            continue
        body = raw[len(PREFIX):]
        if not body.strip():
            cur = None
            continue
        indented = body.startswith("  ")
        line = body.strip()
        if not indented:
            m = re.match(r"ERROR SUMMARY: (\d+) error", line)
            if m:
                summary["errors"] = int(m.group(1))
            if line.startswith(_NOT_ERRORS):
                summary["notes"].append(line)
                cur = None
                continue
            cur = Report(line, [line])
            reports.append(cur)
        elif cur is not None:
            cur.lines.append(line)
    for r in reports:
        block = "\n".join(r.lines)
        for m in re.finditer(r"\bat (?:0x[0-9a-fA-F]+ in (?:\S+?:\d+:)?)?", block):
            # "at kernel(args)+0x1f0 in file.cu:12" (current) or "at 0x1f0 in file.cu:12:kernel(args)" (older)
            name = _read_kernel_name(block, m.end())
            if name:
                r.kernel = normalize_kernel(name)
                break
        loc = re.search(r" in (\S+?\.(?:cu|cuh|h|cpp):\d+)", block)
        if loc:
            r.where = os.path.basename(loc.group(1))
    return reports, summary


def attribute(reports: list[Report], cases: list[Case]) -> tuple[dict[str, list[Report]], list[Report]]:
    """Reports -> {case key: its reports}, plus reports in kernels no case owns (torch's, or unnamed)."""
    by_expr: dict[str, str] = {}
    by_base: dict[str, set[str]] = {}
    for c in cases:
        for e in c.expressions:
            by_expr[normalize_kernel(e)] = c.key
            by_base.setdefault(e.split("<")[0], set()).add(c.key)
    mine: dict[str, list[Report]] = {}
    other: list[Report] = []
    for r in reports:
        keys: set[str] = set()
        if r.kernel:
            if r.kernel in by_expr:
                keys = {by_expr[r.kernel]}
            else:
                keys = by_base.get(r.kernel.split("<")[0], set())
        if keys:
            for k in keys:
                mine.setdefault(k, []).append(r)
        else:
            other.append(r)
    return mine, other


# ---- the parent: one tool ---------------------------------------------------------------------------------
def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    for p in (home / "bin" / "compute-sanitizer", home / "compute-sanitizer" / "compute-sanitizer"):
        if p.exists():
            return str(p)
    return None


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["TILEATTN_LINEINFO"] = "1"
    paths = [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _read_progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a kill
    return events


def run_tool(tool: str, cases: list[Case], *, quick: bool, timeout: float, workdir: Path, sanitizer: str | None) -> dict:
    """Run every case under one tool ('none' = no sanitizer). Returns {case key: cell dict} and
    '_other': reports outside our kernels, '_attempts': the processes it took."""
    cells: dict[str, dict] = {c.key: {"outcome": "not run", "reports": 0} for c in cases}
    other: list[str] = []
    attempts = []
    remaining = list(cases)
    attempt = 0
    while remaining:
        log = workdir / f"{tool}.{attempt}.log"
        progress = workdir / f"{tool}.{attempt}.progress"
        child = [sys.executable, "-m", "labs.sanitize", "--child", "--cases", ",".join(c.key for c in remaining),
                 "--progress", str(progress)] + (["--quick"] if quick else [])
        # --print-limit: the default (100 reports per process) would hide every version that errs
        # after the first one to reach the limit; attribution needs all of them.
        cmd = child if tool == "none" else [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "1",
                                             "--print-limit", "1000000", "--log-file", str(log)] + child
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        hung = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)  # the sanitizer and its python3 child: one process group
            out, _ = proc.communicate()
        seconds = time.perf_counter() - start
        events = _read_progress(progress)
        log_text = log.read_text(errors="replace") if log.exists() else ""
        reports, summary = parse_sanitizer_log(log_text)
        mine, others = attribute(reports, cases)
        other += [r.first_line for r in others]
        attempts.append({"cases": [c.key for c in remaining], "returncode": proc.returncode, "hung": hung,
                         "seconds": round(seconds, 1), "errors": summary["errors"], "output_tail": (out or "")[-1500:]})
        started = [e["case"] for e in events if e.get("event") == "start"]
        finished = {e["case"]: e for e in events if e.get("event") in ("done", "error")}
        for key in started:
            cell = cells[key]
            rs = mine.get(key, [])
            cell["reports"] = len(rs)
            cell["first"] = rs[0].first_line if rs else None
            cell["kinds"] = sorted({r.message for r in rs})
            end = finished.get(key)
            if end is None:
                cell["outcome"] = "hung" if hung else "crashed"
                cell["detail"] = f"timed out after {timeout:.0f} s" if hung else f"process exited {proc.returncode}: {(out or '').strip()[-300:]}"
            else:
                if end["event"] == "error":
                    cell["error"] = end["error"]
                cell["result_ok"] = end.get("ok")
                cell["result_detail"] = end.get("detail") or end.get("error")
                cell["outcome"] = "CAUGHT" if rs else ("error" if end["event"] == "error" else "clean")
            if rs and cell["outcome"] in ("hung", "crashed", "error"):
                cell["outcome"] = "CAUGHT"  # the report is the finding; the crash is its consequence
                cell.setdefault("detail", "")
        if not started:  # the child never got going (import error, sanitizer refused, ...)
            for c in remaining:
                cells[c.key]["outcome"] = "not run"
                cells[c.key]["detail"] = f"process exited {proc.returncode} before the first case: {(out or '').strip()[-500:]}"
            break
        remaining = [c for c in remaining if c.key not in started]
        attempt += 1
    cells["_other"] = other[:20]  # type: ignore[assignment]
    cells["_attempts"] = attempts  # type: ignore[assignment]
    return cells


# ---- report ----------------------------------------------------------------------------------------------
def verdict(case: Case, row: dict[str, dict], tools: list[str]) -> str:
    caught = [t for t in tools if t != "none" and row.get(t, {}).get("outcome") == "CAUGHT"]
    trouble = [t for t in tools if row.get(t, {}).get("outcome") in ("hung", "crashed", "error", "not run")]
    if case.broken is None:
        if caught or trouble:
            return "PROBLEM: a correct version was flagged (" + ", ".join(f"{t}: {row[t]['outcome']}" for t in caught + trouble) + ")"
        plain = row.get("none", {})
        if plain and plain.get("result_ok") is False:
            return "PROBLEM: wrong result without any tool"
        return "clean under " + ", ".join(t for t in tools if t != "none")
    text = _broken_verdict(case, caught, tools)
    hung = [t for t in tools if row.get(t, {}).get("outcome") == "hung"]
    if hung:
        text += f" It hung (killed after the timeout) under: {', '.join(hung)}."
    wrong = row.get("none", {}).get("result_ok")
    if wrong is not None:
        text += " Without a tool the result was " + ("right: the bug is invisible to a result test." if wrong else "wrong.")
    return text


def _broken_verdict(case: Case, caught: list[str], tools: list[str]) -> str:
    aimed, why = EXPECTED.get(case.version, (None, ""))
    if aimed and aimed in caught:
        others = [t for t in caught if t != aimed]
        return f"caught by {aimed}, as aimed" + (f"; also {', '.join(others)}" if others else "") + f". {why}"
    if caught:
        return f"caught by {', '.join(caught)}" + (f" but not by {aimed}: {ESCAPE_WHY.get(case.version, '')}" if aimed and aimed in tools else "") + f" {why}"
    if aimed is None:
        return f"none caught it, as expected: {why}"
    if aimed not in tools:
        return f"not caught by the tools run ({aimed} was not run)"
    return f"NONE caught it. {ESCAPE_WHY.get(case.version, '')} ({aimed} was expected: {why})"


def print_matrix(cases: list[Case], cells: dict[str, dict[str, dict]], tools: list[str]) -> None:
    w = max(len(c.key) for c in cases) + 2
    print(f"{'case':<{w}}" + "".join(f"{t:>11}" for t in tools))
    for c in cases:
        row = cells[c.key]

        def cell(t):
            d = row.get(t, {})
            o = d.get("outcome", "-")
            if t == "none" and o == "clean":
                return "right" if d.get("result_ok") else "WRONG"
            return o
        print(f"{c.key:<{w}}" + "".join(f"{cell(t):>11}" for t in tools))
    print("\nfirst report of each caught cell:")
    for c in cases:
        for t in tools:
            d = cells[c.key].get(t, {})
            if d.get("outcome") == "CAUGHT":
                print(f"  {c.key} / {t} ({d['reports']} reports): {d.get('first')}")
            elif d.get("outcome") in ("hung", "crashed", "error"):
                print(f"  {c.key} / {t}: {d['outcome']}: {d.get('detail') or d.get('error')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduction only (4 correct versions + every broken one), one size")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    ap.add_argument("--no-plain", action="store_true", help="skip the plain run without a sanitizer")
    ap.add_argument("--cases", help="comma-separated case keys or version names (default: all)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per sanitizer process before it counts as hung")
    ap.add_argument("--jobs", type=int, default=5, help="tools run in parallel processes")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.cases.split(","), args.progress, args.quick)

    tools = [t for t in args.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        ap.error(f"unknown tools {bad}; known: {', '.join(TOOLS)}")
    try:
        cases = select_cases(args.quick, args.cases.split(",") if args.cases else None)
    except ValueError as exc:
        ap.error(str(exc))
    sanitizer = sanitizer_path()
    if tools and sanitizer is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, $CUDA_HOME/compute-sanitizer): nothing to run")
        return 2
    columns = tools + ([] if args.no_plain else ["none"])
    t0 = time.perf_counter()
    _precompile(cases)
    print(f"{len(cases)} cases x {len(columns)} runs ({', '.join(columns)}), {args.jobs} in parallel; compile {time.perf_counter() - t0:.1f} s", flush=True)
    cells: dict[str, dict[str, dict]] = {c.key: {} for c in cases}
    extra: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tileattn-sanitize-") as tmp, ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {t: pool.submit(run_tool, t, cases, quick=args.quick, timeout=args.timeout, workdir=Path(tmp), sanitizer=sanitizer)
                   for t in columns}
        for t, fut in futures.items():
            res = fut.result()
            extra[t] = {"other_reports": res.pop("_other"), "attempts": res.pop("_attempts")}
            for key, cell in res.items():
                cells[key][t] = cell
    wall = time.perf_counter() - t0

    records = []
    for c in cases:
        for t in columns:
            records.append({"suite": "sanitize", "kind": "cell", "impl": c.key, "family": c.family, "version": c.version,
                            "broken": c.broken, "tool": t, **cells[c.key][t]})
        records.append({"suite": "sanitize", "kind": "verdict", "impl": c.key, "family": c.family, "version": c.version,
                        "broken": c.broken, "expected_tool": EXPECTED.get(c.version, (None,))[0] if c.broken else None,
                        "verdict": verdict(c, cells[c.key], columns)})
    if args.json:
        from tileattn.bench import environment, write_run

        env = environment()
        env["compute_sanitizer"] = _sanitizer_version(sanitizer)
        env["sanitize"] = {"tools": extra, "wall_seconds": round(wall, 1), "quick": args.quick}
        write_run(args.json, records, env)

    print()
    print_matrix(cases, cells, columns)
    for t, e in extra.items():
        if e["other_reports"]:
            print(f"\n{t}: {len(e['other_reports'])} reports in kernels that are not ours, e.g. {e['other_reports'][0]}")
    print("\nverdicts:")
    problems = 0
    for r in records:
        if r["kind"] == "verdict":
            print(f"  {r['impl']}: {r['verdict']}")
            problems += r["verdict"].startswith("PROBLEM")
    print(f"\n{wall:.0f} s; processes per tool: " + ", ".join(f"{t} {len(e['attempts'])}" for t, e in extra.items()))
    return 1 if problems else 0


def _precompile(cases: list[Case]) -> None:
    """Fill the compile cache once (with -lineinfo, as the children compile) so that four sanitizer
    processes do not all compile the same kernels."""
    try:
        import torch

        import labs.kernels  # noqa: F401  (registers the lab families)
        from tileattn import kernels
        from tileattn.runtime import device_arch

        if not torch.cuda.is_available():
            return
        arch = device_arch()
        jobs = []
        for c in cases:
            if c.family in ("reduction", "transpose"):
                fam = kernels.family(c.family)
                exprs = list(c.expressions)
                if c.family == "reduction" and c.version == "bug_final_reads_all":
                    exprs += [e.replace("reduce_bug_final_reads_all", "reduce_sequential") for e in exprs]
                jobs += [(fam.path, e, {"lineinfo": True}) for e in exprs]
            elif c.family == "vector_add":
                jobs.append((kernels.family("vector_add").path, c.version, None))
        # Serially (~0.4 s per instantiation): one NVRTC program at a time, no threads or forks.
        for job in dict.fromkeys((str(path), expr, bool(opts), arch) for path, expr, opts in jobs):
            _compile_one(job)
    except Exception as exc:  # the children compile for themselves if this fails
        print(f"precompile skipped: {type(exc).__name__}: {exc}")


def _compile_one(job: tuple) -> None:
    from tileattn.runtime import compile_cuda

    path, expr, lineinfo, arch = job
    compile_cuda(Path(path), [expr], arch, extra_options={"lineinfo": True} if lineinfo else None)


def _sanitizer_version(path: str | None) -> str | None:
    if not path:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        return " ".join(out.split())[-120:]
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
