"""scripts/gpu_check.py's control flow on the CPU: the steps it runs, with the subprocesses faked."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    commands = []

    def fake_run(cmd, log, timeout, **env):
        commands.append(cmd)
        log.write_text("ok\n")
        if "--junitxml" in " ".join(cmd):
            junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
            Path(junit).write_text('<testsuite tests="3" failures="0" errors="0" skipped="0"/>')
        return 0, 0.1

    monkeypatch.setattr(module, "run", fake_run)
    module.commands = commands
    return module


def _ran(commands, word):
    return [c for c in commands if word in c]


def test_audit_runs_by_default_and_no_audit_skips_it(gpu_check, tmp_path):
    assert gpu_check.main(["--report-dir", str(tmp_path / "a"), "--bench", "", "--no-sanitizer"]) == 0
    assert len(_ran(gpu_check.commands, "check")) == 1
    gpu_check.commands.clear()
    assert gpu_check.main(["--report-dir", str(tmp_path / "b"), "--bench", "", "--no-sanitizer", "--no-audit"]) == 0
    assert _ran(gpu_check.commands, "check") == []
    assert len(_ran(gpu_check.commands, "pytest")) == 1
    assert "tileattn check" not in (tmp_path / "b" / "summary.md").read_text()


def test_sanitizer_tools_each_run_once(gpu_check, tmp_path):
    gpu_check.main(["--report-dir", str(tmp_path), "--bench", "", "--no-audit", "--sanitizer-tools", "memcheck,racecheck"])
    tools = [c[c.index("--tool") + 1] for c in gpu_check.commands if "compute-sanitizer" in c]
    assert tools == ["memcheck", "racecheck"]
    assert sys.executable in gpu_check.commands[0]
