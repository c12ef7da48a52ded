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
