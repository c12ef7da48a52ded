"""`tileattn bench engine --quick` run end to end on the CPU with tiny shapes, its transformers peers
included (the torch.compile one is not part of --quick): the GPU run exercises the
same code, so a mistake in the harness shows up here and not after a GPU machine was booked."""

import json

import pytest

from tileattn.engine import bench_engine

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)


@pytest.fixture
def tiny_quick_plan(monkeypatch):
    for shape in ("llama3.2-1b", "qwen3-0.6b"):
        monkeypatch.setitem(bench_engine.SHAPES, shape, {**bench_engine.SHAPES[shape], **TINY,
                                                         **({"head_dim": 16} if shape == "qwen3-0.6b" else {})})
    # The reference attention on the CPU is slow: a small workload (the code path is what is tested)
    for key, value in dict(requests=4, max_len=120, new_tokens=16, prompt_len=256).items():
        monkeypatch.setitem(bench_engine.QUICK, key, value)


def test_quick_bench_runs_on_cpu(tmp_path, tiny_quick_plan, capsys):
    out = tmp_path / "bench.json"
    rc = bench_engine.bench_engine_main(["--quick", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
                                         "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())
    assert "gemv_max_rows" in results and results["gemv_max_rows"] is None, results  # no GEMV off CUDA
    rows = results["rows"]
    engine = {row["bench"]: row for row in rows if row["system"] == "tileattn.engine"}
    assert set(engine) == {"decode", "throughput", "ttft"}, rows
    assert engine["decode"]["tok_s"] > 0 and engine["decode"]["bandwidth_TBs"] > 0
    runs = engine["decode"]["tok_s_runs"]  # --decode-runs' default, their median reported
    assert len(runs) == 5 and engine["decode"]["tok_s"] == sorted(runs)[2], engine["decode"]
    assert {"git_commit", "torch", "command"} <= set(results["environment"]), results["environment"]
    assert engine["throughput"]["output_tokens"] == sum(bench_engine.workload(4, 120)[1])
    assert engine["ttft"]["ttft_ms"] > 0
    peers = {(row["bench"], row["system"]): row for row in rows if row["system"] != "tileattn.engine"}
    assert set(peers) == {("decode", "transformers eager"), ("throughput", "transformers generate_batch")}
    assert all(row.get("tok_s", 0) > 0 for row in peers.values()), peers
    assert "tileattn.engine" in capsys.readouterr().out


def test_tensor_parallel_sizes_each_get_rows(tmp_path, tiny_quick_plan):
    """--tensor-parallel-size 1 2: decode and throughput run at both sizes (2 gloo ranks here),
    the same greedy workload producing the same number of tokens."""
    out = tmp_path / "bench.json"
    rc = bench_engine.bench_engine_main(["--quick", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
                                         "--no-peers", "--only", "decode", "--only", "throughput",
                                         "--tensor-parallel-size", "1", "2", "--json", str(out)])
    assert rc == 0
    rows = {(r["bench"], r["system"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(bench, system) for bench in ("decode", "throughput")
                         for system in ("tileattn.engine", "tileattn.engine TP=2")}, rows
    assert rows["decode", "tileattn.engine TP=2"]["tok_s"] > 0
    assert (rows["throughput", "tileattn.engine TP=2"]["output_tokens"]
            == rows["throughput", "tileattn.engine"]["output_tokens"])


def test_records_say_which_projection_path_ran(monkeypatch):
    """gemv_max_rows, kept in the JSON header: TILEATTN_GEMV_MAX_ROWS (read at import) on CUDA, so
    the A/B pair of decode runs says which ran the GEMV kernel; None on the CPU; a bad setting
    stops the benchmark before anything is measured."""
    from tileattn.api_layers import gemv_max_rows
    from tileattn.kernels import dispatch

    for rows in (0, 8):
        monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", rows)
        assert gemv_max_rows("cuda:0") == rows
    assert gemv_max_rows("cpu") is None
    monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 9)
    with pytest.raises(ValueError, match="TILEATTN_GEMV_MAX_ROWS"):
        gemv_max_rows("cuda:0")


def test_decode_runs_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench_engine.bench_engine_main(["--decode-runs", "0", "--device", "cpu"])
    assert "--decode-runs must be at least 1, got 0" in capsys.readouterr().err


def test_help_works_without_a_gpu(capsys):
    try:
        bench_engine.parse_args(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "--quick" in capsys.readouterr().out


def test_kernel_steps_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--kernels", "--kernel-steps", "0"])
    assert "--kernel-steps must be at least 1, got 0" in capsys.readouterr().err


def test_idle_gaps_counts_uncovered_time_once():
    # a covers [0, 10] with b nested inside, c after a 2-unit gap, d after 5 more, e overlapping d
    events = [(0, 10, "a"), (2, 5, "b"), (12, 20, "c"), (25, 30, "d"), (26, 33, "e"), (33, 34, "d")]
    wall, idle, gaps = bench_engine.idle_gaps(events)
    assert (wall, idle) == (34, 7)
    assert gaps == {("a", "c"): [1, 2], ("c", "d"): [1, 5]}
    assert bench_engine.idle_gaps([]) == (0.0, 0.0, {})


def test_kernel_profile_splits_a_decode_step(tmp_path, tiny_quick_plan, capsys):
    """--kernels: the decode steps' time by op (CPU ops here, kernels on a GPU), every step counted
    once, shares summing to 1, the table printed and kept in the JSON row."""
    out = tmp_path / "bench.json"
    rc = bench_engine.bench_engine_main(["--quick", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
                                         "--no-peers", "--only", "decode", "--kernels", "--kernel-steps", "12",
                                         "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    report = row["kernels"]
    assert report["device"] == "cpu" and 11 <= report["steps"] <= 13, report["steps"]  # --kernel-steps 12
    kernels = report["kernels"]
    assert kernels and abs(sum(k["share"] for k in kernels) - 1) < 1e-6
    assert [k["us_per_step"] for k in kernels] == sorted((k["us_per_step"] for k in kernels), reverse=True)
    # every decode step runs each of the 2 layers' q/k/v/o/gate_up/down projections: aten::linear or mm
    matmuls = sum(k["calls_per_step"] for k in kernels if k["name"] in ("aten::mm", "aten::addmm", "aten::linear"))
    assert matmuls >= 2 * 4, kernels[:10]
    # the window: idle stretches are inside it, and the gaps add up to the idle time
    assert 0 <= report["idle_us"] < report["wall_us"], (report["idle_us"], report["wall_us"])
    gaps = report["gaps"]
    assert abs(sum(g["us_per_step"] for g in gaps) - report["idle_us"]) < 1e-6 * max(1.0, report["idle_us"])
    assert [g["us_per_step"] for g in gaps] == sorted((g["us_per_step"] for g in gaps), reverse=True)
    assert all(g["us_per_step"] > 0 and g["before"] and g["after"] for g in gaps)
    printed = capsys.readouterr().out
    assert "us of CPU op time per decode step" in printed and "of it idle" in printed


@pytest.mark.parametrize("shape", ["llama3.2-1b", "qwen1.5-moe-a2.7b"])
def test_decode_bytes_count_the_weights_a_token_reads(shape):
    """decode_bytes_per_token against the transformers model's own parameter count (on the meta
    device): every matrix but the input embedding (the output head read in full), of an MoE's
    experts the top-k fraction a token picks (the norms' and biases' vectors are not counted)."""
    import torch
    import transformers

    from tileattn.engine.loader import model_config_from_hf

    spec = bench_engine.SHAPES[shape]
    config = transformers.AutoConfig.for_model(**spec)
    config.architectures = spec["architectures"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    read = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or ("embed_tokens" in name and not config.tie_word_embeddings):
            continue
        experts = ".mlp.experts." in name  # stacked [E, ...] in transformers 5
        read += p.numel() * (config.num_experts_per_tok / config.num_experts if experts else 1)
    ours = bench_engine.decode_bytes_per_token(model_config_from_hf(config.to_dict()), 2, 0)
    assert ours == pytest.approx(2 * read, rel=1e-9)


def test_transformers_batch_peer_gets_an_untimed_warm_up():
    """The generate_batch peer, like the engine, runs once untimed first (before 2026-12-05 it was timed
    cold: its one-off set-up counted against it); the timed call is the whole workload."""
    from types import SimpleNamespace

    calls = []

    class Model:
        device = "cpu"

        def generate_batch(self, inputs, generation_config):
            calls.append((len(inputs), generation_config.max_new_tokens))
            n = generation_config.max_new_tokens
            return {i: SimpleNamespace(generated_tokens=[0] * n) for i in range(len(inputs))}

    row = bench_engine._hf_batch(Model(), [[1, 2]] * 5, 40)
    assert calls == [(2, 16), (5, 40)]
    assert row["requests"] == 5 and row["output_tokens"] == 200
