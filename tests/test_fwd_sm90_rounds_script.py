"""scripts/fwd_sm90_rounds.py's summary (CPU only): F = 2 T(1) - T(2) and the one-round
differences from the fastest timing round of each point."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fwd_sm90_rounds.py"
spec = importlib.util.spec_from_file_location("fwd_sm90_rounds", SCRIPT)
rounds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rounds)


def test_summary_separates_fixed_cost_from_rounds(tmp_path, capsys):
    # T(r) = 5 + 30 r us, with a slower second timing round that the summary must ignore
    lines = [json.dumps({"d": 128, "nk": 2048, "rounds": r, "round": rnd, "impl": "x",
                         "ms": (5 + 30 * r) * 1e-3 * (1.2 if rnd else 1.0)}) for r in (1, 2, 3) for rnd in (0, 1)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rounds.summary([path])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 |")]
    assert row == ["| 128 | x | 2048 | 35.0 | 65.0 | 95.0 | 5.0 | 30.0 | 30.0 |"]
