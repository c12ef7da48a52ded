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


def _part(gpu_check, path, *args, commit="abc1234", monkeypatch):
    monkeypatch.setenv("TILEATTN_GIT_COMMIT", commit)
    return gpu_check.main(["--report-dir", str(path), "--bench", "", "--no-audit", *args])


def test_no_tests_runs_only_the_sanitizers(gpu_check, tmp_path, monkeypatch):
    assert _part(gpu_check, tmp_path, "--no-tests", "--sanitizer-tools", "memcheck", monkeypatch=monkeypatch) == 0
    assert not [c for c in gpu_check.commands if "pytest" in c and "compute-sanitizer" not in c]
    assert len(_ran(gpu_check.commands, "compute-sanitizer")) == 1


def test_merge_of_parts_is_whole_only_with_tests_and_all_four_tools_at_one_commit(gpu_check, tmp_path, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert _part(gpu_check, a, "--no-sanitizer", monkeypatch=monkeypatch) == 0
    assert _part(gpu_check, b, "--no-tests", "--sanitizer-tools", "memcheck,synccheck", monkeypatch=monkeypatch) == 0
    assert _part(gpu_check, c, "--no-tests", "--sanitizer-tools", "racecheck,initcheck", monkeypatch=monkeypatch) == 0
    import json

    out = tmp_path / "merged"
    assert gpu_check.main(["--report-dir", str(out), "--merge", str(a), "--merge", str(b), "--merge", str(c)]) == 0
    merged = json.loads((out / "summary.json").read_text())
    assert merged["whole"] and merged["ok"] and merged["commit"] == "abc1234"
    assert merged["pytest"]["tests"] == 3 and set(merged["sanitizer"]) == set(gpu_check.SANITIZER_TOOLS)

    # without the racecheck / initcheck part: not whole, exit 1
    assert gpu_check.main(["--report-dir", str(tmp_path / "m2"), "--merge", str(a), "--merge", str(b)]) == 1
    assert not json.loads((tmp_path / "m2" / "summary.json").read_text())["whole"]
    # a part at another commit: not whole
    d = tmp_path / "d"
    assert _part(gpu_check, d, "--no-tests", "--sanitizer-tools", "racecheck,initcheck", commit="def5678",
                 monkeypatch=monkeypatch) == 0
    assert gpu_check.main(["--report-dir", str(tmp_path / "m3"), "--merge", str(a), "--merge", str(b),
                           "--merge", str(d)]) == 1
    # one tool in two parts, or a part without a summary: refused
    with pytest.raises(SystemExit, match="memcheck ran in two parts"):
        gpu_check.main(["--report-dir", str(tmp_path / "m4"), "--merge", str(b), "--merge", str(b)])
    with pytest.raises(SystemExit, match="no summary.json"):
        gpu_check.main(["--report-dir", str(tmp_path / "m5"), "--merge", str(tmp_path / "nowhere")])


def test_sanitizer_jobs_shard_the_files_per_tool_and_sum_the_shards(gpu_check, tmp_path, monkeypatch):
    files = {"tests/gpu/a.py": 10, "tests/gpu/b.py": 5, "tests/gpu/c.py": 5, "tests/gpu/d.py": 1}
    assert gpu_check.shards(files, 2) == [["tests/gpu/a.py", "tests/gpu/d.py"], ["tests/gpu/b.py", "tests/gpu/c.py"]]
    assert gpu_check.shards(files, 9) == [[f] for f in sorted(files, key=lambda f: (-files[f], f))]
    assert gpu_check.combined_summary(["0 errors", "2 errors"]) == "2 errors (2 shards)"
    assert gpu_check.combined_summary(["0 errors"]) == "0 errors"
    assert gpu_check.combined_summary(["0 errors", "no summary (see log)"]) == "no summary (see logs)"
    monkeypatch.setattr(gpu_check, "sanitize_files", lambda py, targets, kw: files)
    fake = gpu_check.run

    def run(cmd, log, timeout, **env):  # racecheck's shard holding b.py reports an error
        rc, sec = fake(cmd, log, timeout, **env)
        if "compute-sanitizer" in cmd:
            bad = cmd[cmd.index("--tool") + 1] == "racecheck" and "tests/gpu/b.py" in cmd
            skip = cmd[cmd.index("--tool") + 1] == "memcheck" and "tests/gpu/a.py" in cmd  # a case skips itself
            log.write_text(f"{'3 passed, 1 skipped' if skip else '4 passed'} in 1.00s\n"
                           f"========= ERROR SUMMARY: {1 if bad else 0} errors\n")
            return (1 if bad else 0), sec
        return rc, sec

    monkeypatch.setattr(gpu_check, "run", run)
    assert gpu_check.main(["--report-dir", str(tmp_path), "--bench", "", "--no-audit", "--no-tests",
                           "--sanitizer-tools", "memcheck,racecheck", "--sanitizer-jobs", "4"]) == 1
    runs = [c for c in gpu_check.commands if "compute-sanitizer" in c]
    assert len(runs) == 4
    for tool in ("memcheck", "racecheck"):
        mine = [c for c in runs if c[c.index("--tool") + 1] == tool]
        covered = sorted(f for c in mine for f in c if f.startswith("tests/gpu/"))
        assert covered == sorted(files), (tool, covered)
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())["sanitizer"]
    assert summary["memcheck"]["summary"] == "0 errors (2 shards)" and summary["memcheck"]["rc"] == 0
    assert summary["racecheck"]["summary"] == "1 errors (2 shards)" and summary["racecheck"]["rc"] == 1
    assert (summary["memcheck"]["skipped"], summary["racecheck"]["skipped"]) == (1, 0)
    assert (summary["memcheck"]["passed"], summary["racecheck"]["passed"]) == (7, 8)  # shards' counts summed
    table = (tmp_path / "summary.md").read_text()
    assert "1 case(s) skipped" in table and "8 cases passed" in table
