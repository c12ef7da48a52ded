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
