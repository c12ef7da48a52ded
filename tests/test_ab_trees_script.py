"""scripts/ab_trees.py (CPU only): the process order, the argument checks, the summary's medians and
ratios, and one whole run with the benchmark processes replaced by a stub."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab_trees.py"
spec = importlib.util.spec_from_file_location("ab_trees", SCRIPT)
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def tree(tmp_path: Path, name: str) -> Path:
    (tmp_path / name / "tileattn").mkdir(parents=True)
    (tmp_path / name / "tileattn" / "__init__.py").write_text("")
    return tmp_path / name


def record(impl, n, causal, tflops, rnd):
    return {"suite": "attention", "impl": impl, "pass": "fwd", "b": 4, "h": 32, "n": n, "d": 128,
            "dtype": "bfloat16", "causal": causal, "status": "ok", "tflops": tflops, "round": rnd}


def write(path: Path, records) -> Path:
    path.write_text(json.dumps({"environment": {}, "records": records}))
    return path


def test_run_order_rotates_the_first_tree():
    assert ab.run_order(["a", "b"], 3) == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert ab.run_order(["a", "b", "c"], 2) == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]


def test_summary_medians_peer_ratio_and_tree_ratio(tmp_path):
    paths = []
    # main: ours 500 (rounds 490 / 500 / 510: median 500), cuDNN 480; trial: ours 520 / 530, cuDNN 500
    for label, ours, peer in (("main-1", (490, 500, 510), (480, 470, 490)), ("main-2", (500,), (500,)),
                              ("trial-1", (520,), (500,)), ("trial-2", (530,), (500,))):
        records = [record("tileattn", 2048, True, v, i) for i, v in enumerate(ours)]
        records += [record("sdpa_cudnn", 2048, True, v, i) for i, v in enumerate(peer)]
        records.append({**record("tileattn", 2048, True, None, 0), "status": "oom"})  # not timed: left out
        paths.append(write(tmp_path / f"{label}.json", records))
    rows = ab.summary(paths).splitlines()
    assert rows[0] == "| point | impl | main | trial | trial / main |"
    ours = [r for r in rows if "| tileattn |" in r]
    # one point only: no field varies, so the point has no name
    assert ours == ["| - | tileattn | 500 (1.042), 500 (1.000) | 520 (1.040), 530 (1.060) | 1.050 |"]
    assert [r for r in rows if "| sdpa_cudnn |" in r] == ["| - | sdpa_cudnn | 480, 500 | 500, 500 | 1.020 |"]


def test_summary_ratio_of_a_variant_to_plain(tmp_path):
    # `bench variants --suite overhead`: the implementations are the variant and `plain`
    paths = [write(tmp_path / f"{t}-1.json", [record("alibi", 2048, True, a, 0), record("plain", 2048, True, 500.0, 0)])
             for t, a in (("main", 450.0), ("trial", 470.0))]
    rows = ab.summary(paths, peer="plain").splitlines()
    assert "| - | alibi | 450 (0.900) | 470 (0.940) | 1.044 |" in rows
    assert "| - | plain | 500 | 500 | 1.000 |" in rows


def test_summary_names_points_by_the_fields_that_vary(tmp_path):
    paths = [write(tmp_path / f"{t}-1.json", [record("tileattn", n, c, 100.0 * (2 if t == "b" else 1), 0)
                                               for n in (2048, 4096) for c in (False, True)]) for t in ("a", "b")]
    rows = [r for r in ab.summary(paths).splitlines() if "tileattn" in r]
    assert len(rows) == 4 and all(r.endswith("| 2.000 |") for r in rows)
    assert rows[0].startswith("| causal=False n=2048 | tileattn |")


def test_argument_errors(tmp_path, capsys):
    a, b = tree(tmp_path, "a"), tree(tmp_path, "b")
    with pytest.raises(SystemExit):
        ab.main(["--tree", f"a={tmp_path}", "--tree", f"b={b}", "--out", str(tmp_path / "o"), "--", "bench", "x"])
    assert "holds no tileattn package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--tree", f"a={a}", "--out", str(tmp_path / "o"), "--", "bench", "x"])
    assert "at least two --tree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--tree", f"a={a}", "--tree", f"b={b}", "--out", str(tmp_path / "o"), "--", "check"])
    assert "tileattn bench" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--tree", f"a={a}", "--tree", f"b={b}", "--out", str(tmp_path / "o"), "--", "bench", "--json", "x"])
    assert "without --json" in capsys.readouterr().err


def test_a_whole_run_alternates_trees_on_pythonpath(tmp_path, monkeypatch, capsys):
    a, b = tree(tmp_path, "a"), tree(tmp_path, "b")
    calls = []

    def fake_run(argv, env, timeout, capture_output, text):
        first = env["PYTHONPATH"].split(":")[0]
        calls.append((Path(first).name, argv[3:]))
        write(Path(argv[argv.index("--json") + 1]), [record("tileattn", 2048, False, 300.0 if first.endswith("b") else 200.0, 0)])
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    assert ab.main(["--tree", f"a={a}", "--tree", f"b={b}", "--repeat", "2", "--out", str(tmp_path / "o"),
                    "--", "bench", "attention", "--seq", "2048"]) == 0
    assert [name for name, _ in calls] == ["a", "b", "b", "a"]
    assert calls[0][1][:3] == ["bench", "attention", "--seq"]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a-1.json", "a-2.json", "b-1.json", "b-2.json"]
    assert "| - | tileattn | 200, 200 | 300, 300 | 1.500 |" in capsys.readouterr().out


def test_a_failing_or_hanging_process_stops_the_run(tmp_path, monkeypatch, capsys):
    a, b = tree(tmp_path, "a"), tree(tmp_path, "b")
    argv = ["--tree", f"a={a}", "--tree", f"b={b}", "--out", str(tmp_path / "o"), "--timeout", "5", "--", "bench", "x"]
    monkeypatch.setattr(ab.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 3, "", "boom"))
    assert ab.main(argv) == 1
    assert "a, process 1: exit status 3" in capsys.readouterr().err

    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(ab.subprocess, "run", hang)
    assert ab.main(argv) == 1
    assert "still running after --timeout 5 s" in capsys.readouterr().err

