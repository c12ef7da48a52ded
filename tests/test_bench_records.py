"""The benchmarks' outputs: one JSON record (environment + records) and Markdown headed by the environment line."""

from tileattn.bench.records import read_run, save_run


def test_save_run_writes_json_and_markdown(tmp_path):
    env = {"gpu": "NVIDIA H200", "date_utc": "2026-12-01T17:00:00+00:00", "git_commit": "0123456789abcdef",
           "git_dirty": False, "command": "tileattn bench x"}
    records = [{"suite": "x", "impl": "tileattn", "us": 1.5}]
    save_run(records, env, "| a |\n|---|", tmp_path / "r.json", tmp_path / "r.md")
    assert read_run(tmp_path / "r.json") == (env, records)
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("gpu: NVIDIA H200") and "commit: 0123456789" in md and md.endswith("| a |\n|---|\n")
    save_run(records, env, "t", None, None)  # neither path: writes nothing, raises nothing


def test_measure_times_plain_launches_and_restores_the_pdl_setting(monkeypatch):
    """measure() runs the timed calls with TILEATTN_PDL=0 (one-call timings cannot attribute PDL's
    overlap between kernels) and leaves the caller's setting as it was, set or unset."""
    import os

    from tileattn.bench import harness

    seen = []
    monkeypatch.setattr(harness, "_measure", lambda fn, *args: (fn(), "timing")[1])
    for before in (None, "1"):
        if before is None:
            monkeypatch.delenv("TILEATTN_PDL", raising=False)
        else:
            monkeypatch.setenv("TILEATTN_PDL", before)
        assert harness.measure(lambda: seen.append(os.environ.get("TILEATTN_PDL"))) == "timing"
        assert os.environ.get("TILEATTN_PDL") == before
    assert seen == ["0", "0"]


def test_measure_enqueues_a_host_lead_before_the_repetitions(monkeypatch):
    """The harness's control flow on the CPU with fake CUDA events: the lead of flushes is
    enqueued after the warm-up's synchronization and before the first timed repetition, sized
    from the host time of the warm-up calls (twice reps x (call + flush) host seconds), and only
    when the L2 is flushed. The GPU test tests/gpu/test_bench_harness.py checks the timing itself."""
    import time

    import pytest
    import torch

    from tileattn.bench import harness

    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return 0.1  # ms: the device time of one call and of one flush

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(harness, "_flush_l2", lambda: log.append("flush"))
    monkeypatch.setattr(harness, "_flush_costs", None)
    monkeypatch.setattr(harness, "WARM_SECONDS", 0.0)

    durations = []  # each call's own host time (a loaded host sleeps longer than the 1 ms asked)

    def call():
        begin = time.perf_counter()
        time.sleep(0.001)
        log.append("call")
        durations.append(time.perf_counter() - begin)

    harness.measure(call, warmup=2, reps=4, memory=False)
    device_s, host_s = harness.flush_costs()
    assert device_s == pytest.approx(1e-4)
    assert log[:3] == ["call", "call", "sync"]  # the warm-up, then its synchronization
    rest = log[3:]
    assert rest[:7] == ["flush"] * 6 + ["sync"]  # flush_costs: one untimed and five timed flushes
    first_timed_call = rest.index("call")
    lead = rest[7:first_timed_call].count("flush") - 1  # minus repetition 0's own flush
    # From the faster warm-up call as the harness timed it around the call (the same call plus a few
    # microseconds): >= 80 flushes.
    expected = 2 * 4 * (min(durations[:2]) + host_s) / 1e-4
    assert expected * 0.9 <= lead <= min(expected * 1.5 + 2, harness.LEAD_MAX_SECONDS / 1e-4 + 1)
    assert rest[first_timed_call:].count("call") == 4

    log.clear()
    harness.measure(call, warmup=2, reps=4, memory=False, flush_l2=False)
    assert "flush" not in log


def test_measure_samples_clocks_only_when_asked(monkeypatch):
    """TILEATTN_BENCH_CLOCKS=MS wraps the measurement in a ClockSampler of that interval and puts
    its summary on the Timing; unset, no sampler runs and the record has no gpu_clocks field."""
    import pytest
    import torch

    from tileattn.bench import clocks, harness

    started = []

    class FakeSampler:
        def __init__(self, device, interval_ms):
            started.append(interval_ms)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def summary(self):
            return {"samples": 3}

    monkeypatch.setattr(clocks, "ClockSampler", FakeSampler)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(harness, "_measure", lambda *a: harness.summarize([1.0, 2.0, 3.0]))
    monkeypatch.delenv("TILEATTN_BENCH_CLOCKS", raising=False)
    assert "gpu_clocks" not in harness.measure(lambda: None).as_dict() and started == []
    monkeypatch.setenv("TILEATTN_BENCH_CLOCKS", "20")
    assert harness.measure(lambda: None).as_dict()["gpu_clocks"] == {"samples": 3} and started == [20]
    monkeypatch.setenv("TILEATTN_BENCH_CLOCKS", "fast")
    with pytest.raises(ValueError, match="TILEATTN_BENCH_CLOCKS"):
        harness.measure(lambda: None)


def test_git_state_ignores_a_checkout_that_merely_contains_an_installed_copy(tmp_path, monkeypatch):
    """A copy of the package installed under some other checkout (a wheel in a venv inside a
    repository) must not record that checkout's commit and dirty flag as the code's: (None, None)."""
    import importlib.util
    import shutil
    import subprocess
    from pathlib import Path

    from tileattn.bench import env

    monkeypatch.delenv("TILEATTN_GIT_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "another project"], check=True)
    installed = tmp_path / "venv" / "lib" / "python3" / "site-packages" / "tileattn" / "bench" / "env.py"
    installed.parent.mkdir(parents=True)
    shutil.copy(Path(env.__file__), installed)
    spec = importlib.util.spec_from_file_location("installed_env", installed)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._git_state() == (None, None)


def test_a_json_file_that_is_no_run_and_a_bad_flush_mode_are_refused(tmp_path, monkeypatch):
    import json

    import pytest

    from tileattn.bench.harness import flush_mode

    path = tmp_path / "other.json"
    path.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match=r"other.json is not a tileattn benchmark run \(needs 'environment' and 'records'\)"):
        read_run(path)
    monkeypatch.setenv("TILEATTN_BENCH_FLUSH", "write")
    assert flush_mode() == "write"
    monkeypatch.setenv("TILEATTN_BENCH_FLUSH", "dirty")
    with pytest.raises(ValueError, match="^TILEATTN_BENCH_FLUSH must be one of"):
        flush_mode()
