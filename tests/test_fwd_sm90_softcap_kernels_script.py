"""scripts/fwd_sm90_softcap_kernels.py's summary (CPU only): medians per (tree, d, mask, N, kernel) and
each kernel's ratio to the plain kernel timed by the same tree, the figures docs/attention_variants.md
quotes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fwd_sm90_softcap_kernels.py"
spec = importlib.util.spec_from_file_location("fwd_sm90_softcap_kernels", SCRIPT)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_summary_medians_and_ratios_per_tree(tmp_path, capsys):
    rows = []
    for tree, plain, fixed in (("a", (400.0, 500.0, 450.0), (300.0, 360.0, 330.0)), ("b", (100.0, 100.0, 100.0),
                                                                                     (90.0, 80.0, 85.0))):
        for rnd, (p, f) in enumerate(zip(plain, fixed)):
            rows.append({"tree": tree, "d": 64, "causal": False, "n": 2048, "round": rnd, "impl": "plain", "tflops": p})
            rows.append({"tree": tree, "d": 64, "causal": False, "n": 2048, "round": rnd, "impl": "softcap_fixed",
                         "tflops": f})
    rows.append({"tree": "a", "d": 64, "causal": True, "n": 2048, "round": 0, "impl": "plain", "tflops": 200.0})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script.summary([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| tree | d | causal | N | plain | softcap_fixed (ratio) |"
    body = lines[2:]
    assert body == ["| a | 64 | no | 2048 | 450 | 330 (0.733) |",   # medians 450 and 330: 330 / 450
                    "| a | 64 | yes | 2048 | 200 | - |",
                    "| b | 64 | no | 2048 | 100 | 85 (0.850) |"]
