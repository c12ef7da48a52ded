"""The Triton lab's kernels (labs/triton_lab.py) under TRITON_INTERPRET=1 on the CPU, fp32 and fp16.

The interpreter is chosen when a kernel is decorated, from the environment, so the kernels run in a
child process with TRITON_INTERPRET=1 set there: the variable never leaks into this process (where
a GPU run may collect real Triton kernels). One child runs every case; each case is its own test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install triton; see pyproject dev extras)")

ROOT = Path(__file__).resolve().parents[1]
CHILD = (
    "import json, labs.triton_lab as t; r = t.interpret_selfcheck(); "
    "print('RESULTS ' + json.dumps(r))"
)


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, f"interpreter child failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


CASES = [f"add {dt} n={n}" for dt in ("float32", "float16") for n in (1, 31, 1003)]
CASES += [f"sum {dt} n={n}" for dt in ("float32", "float16") for n in (1, 33, 5000)]
CASES += [f"matmul {dt} {s}" for dt in ("float32", "float16") for s in ("17x33x40", "64x32x16")]
CASES += [f"attention {dt} causal={c} {s}" for dt in ("float32", "float16") for c in (False, True)
          for s in ("5x5x16", "20x37x32", "37x20x32")]


@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel(results, case):
    assert case in results, f"{case} did not run; ran: {sorted(results)}"
    ok, err = results[case]
    assert ok, f"{case}: relative error {err}"


def test_every_case_is_listed(results):
    assert sorted(results) == sorted(CASES)
