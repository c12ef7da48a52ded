"""scripts/fixed_max_dq_error.py on the CPU: its emulated dq errors are small for every mode on a
plain shape (so a broken emulation, not the fixed max, would show), and it prints its table."""

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fixed_max_dq_error.py"


def _module():
    spec = importlib.util.spec_from_file_location("fixed_max_dq_error_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mode_is_close_to_float64_on_a_plain_shape():
    errors = _module().dq_errors(64, 300, None, seeds=2)
    assert set(errors) == {"online", "fixed", "fixed_rsum"}
    for mode, values in errors.items():
        assert len(values) == 2 and all(math.isfinite(e) and 0 < e < 1e-2 for e in values), (mode, values)


def test_main_prints_a_row_per_shape(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["fixed_max_dq_error.py", "--seeds", "1"])
    _module().main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "e-" in line]
    assert len(rows) == 4, rows
