"""tileattn.bench.report --compare: a run against a baseline run, point by point (CPU only)."""

import json

import pytest

from tileattn.bench import report
from tileattn.bench.records import write_run


def _point(impl, n, tflops, causal=False, **extra):
    return {"suite": "attention", "impl": impl, "pass": "fwd", "b": 4, "h": 32, "n": n, "d": 128,
            "dtype": "bfloat16", "causal": causal, "tflops": tflops, **extra}


BASE = [_point("tileattn", 4096, 500.0), _point("tileattn", 16384, 600.0), _point("tileattn", 4096, 480.0, True),
        _point("sdpa_cudnn", 4096, 900.0)]


def test_compare_within_and_outside_tolerance():
    run = [_point("tileattn", 4096, 510.0, median_ms=1.0), _point("tileattn", 16384, 570.0),
           _point("tileattn", 4096, 480.0, True), _point("sdpa_cudnn", 4096, 100.0)]
    rows, ok = report.compare(BASE, run, tolerance=0.03)
    assert not ok
    by_n = {(r["point"]["n"], r["point"]["causal"]): r for r in rows}
    assert len(rows) == 3  # the peer is not checked by default
    assert by_n[(4096, False)]["ok"] and by_n[(4096, False)]["ratio"] == pytest.approx(1.02)
    assert not by_n[(16384, False)]["ok"] and by_n[(16384, False)]["ratio"] == pytest.approx(0.95)
    assert by_n[(4096, True)]["ok"]
    rows, ok = report.compare(BASE, run, tolerance=0.06)
    assert ok
    rows, ok = report.compare(BASE, run, impl=None, tolerance=0.06)  # every implementation: the peer moved
    assert not ok and len(rows) == 4


def test_a_point_on_one_side_fails():
    rows, ok = report.compare(BASE[:2], BASE[:1], tolerance=0.5)
    assert not ok
    missing = [r for r in rows if r["ratio"] is None]
    assert len(missing) == 1 and missing[0]["baseline"] == 600.0 and missing[0]["run"] is None
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        report.compare(BASE, BASE, tolerance=-0.1)


def test_cli_exit_status_and_table(tmp_path, capsys):
    env = {"gpu": "test GPU", "torch": "x", "date_utc": "2026-12-02T00:00:00+00:00", "git_commit": "abc"}
    base, same, slow = tmp_path / "base.json", tmp_path / "same.json", tmp_path / "slow.json"
    write_run(base, BASE, env)
    write_run(same, [dict(r, tflops=r["tflops"] * 1.01) for r in BASE], env)
    write_run(slow, [dict(r, tflops=r["tflops"] * 0.9) for r in BASE], env)
    assert report.main([str(same), "--compare", str(base)]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 points within 3%" in out and "| 1.010 | yes |" in out
    assert report.main([str(slow), "--compare", str(base)]) == 1
    assert "| 0.900 | NO |" in capsys.readouterr().out
    assert json.loads(base.read_text())["records"] == BASE


def test_median_rounds_picks_the_median_round_per_point():
    rounds = [_point("tileattn", 4096, t, round=i) for i, t in enumerate((510.0, 470.0, 500.0))]
    rounds += [_point("sdpa_cudnn", 4096, t, round=i) for i, t in enumerate((480.0, 495.0))]
    plain = _point("tileattn", 8192, 600.0)  # no rounds: passes through
    failed = [_point("tileattn", 16384, 550.0, round=0), {**_point("tileattn", 16384, 0.0, round=1), "status": "out of memory"}]
    out = report.median_rounds(rounds + [plain] + failed)
    assert len(out) == 4
    by = {(r["impl"], r["n"]): r for r in out}
    assert by[("tileattn", 4096)]["tflops"] == 500.0 and by[("tileattn", 4096)]["rounds"] == 3
    assert sorted(by[("tileattn", 4096)]["tflops_rounds"]) == [470.0, 500.0, 510.0]
    assert by[("sdpa_cudnn", 4096)]["tflops"] == 480.0  # even count: the lower middle round
    assert by[("tileattn", 8192)] is plain
    assert by[("tileattn", 16384)]["status"] == "out of memory"


def test_relative_to_a_peer_cancels_what_moves_both():
    """--relative-to: tileattn / cuDNN of each run against each other. Both 10 % slower (the machine's
    clock): the absolute check fails, the relative one passes; tileattn alone 10 % slower: both fail;
    a point without the peer on either side fails; the peer's own points are not listed."""
    base = [_point("tileattn", 4096, 500.0), _point("sdpa_cudnn", 4096, 400.0),
            _point("tileattn", 16384, 600.0), _point("sdpa_cudnn", 16384, 550.0)]
    both_slow = [dict(r, tflops=r["tflops"] * 0.9) for r in base]
    assert not report.compare(base, both_slow)[1]
    rows, ok = report.compare(base, both_slow, relative_to="sdpa_cudnn")
    assert ok and len(rows) == 2
    assert rows[0]["baseline"] == pytest.approx(1.25) and rows[0]["ratio"] == pytest.approx(1.0)
    ours_slow = [dict(r, tflops=r["tflops"] * (0.9 if r["impl"] == "tileattn" else 1.0)) for r in base]
    rows, ok = report.compare(base, ours_slow, relative_to="sdpa_cudnn")
    assert not ok and all(r["ratio"] == pytest.approx(0.9) for r in rows)
    rows, ok = report.compare(base, both_slow[:3], relative_to="sdpa_cudnn")  # 16384 lost its peer
    assert not ok and [r["run"] for r in rows][1] is None
    rows, ok = report.compare(base, both_slow, impl=None, relative_to="sdpa_cudnn")
    assert ok and {r["point"]["impl"] for r in rows} == {"tileattn"}


def test_cli_relative_to(tmp_path, capsys):
    env = {"gpu": "test GPU", "torch": "x", "date_utc": "2026-12-04T00:00:00+00:00", "git_commit": "abc"}
    base, run = tmp_path / "base.json", tmp_path / "run.json"
    write_run(base, BASE, env)
    write_run(run, [dict(r, tflops=r["tflops"] * 0.8) for r in BASE], env)
    assert report.main([str(run), "--compare", str(base)]) == 1
    capsys.readouterr()
    # only the non-causal 4096 point has a cuDNN partner: the other two fail for want of one
    assert report.main([str(run), "--compare", str(base), "--relative-to", "sdpa_cudnn"]) == 1
    out = capsys.readouterr().out
    assert "tflops / sdpa_cudnn's" in out and "1 of 3 points within 3%" in out and "| 1.000 | yes |" in out
    with pytest.raises(SystemExit):
        report.main([str(run), "--compare", str(base), "--relative-to", "sdpa_flash"])
    assert "the run has no record of that implementation" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main([str(run), "--relative-to", "sdpa_cudnn"])
    assert "--relative-to needs --compare" in capsys.readouterr().err


def test_compare_uses_the_median_round():
    run = [_point("tileattn", 4096, t, round=i) for i, t in enumerate((100.0, 505.0, 900.0))]
    rows, ok = report.compare(BASE[:1], run, tolerance=0.03)
    assert ok and rows[0]["run"] == 505.0


def test_bench_attention_refuses_zero_rounds(capsys):
    from tileattn.bench import attention

    with pytest.raises(SystemExit):
        attention.main(["--rounds", "0"])
    assert "--rounds: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--forward-only", "--backward-only"], "--forward-only and --backward-only exclude each other"),
    (["--impl", "flash3"], "argument --impl: invalid choice: 'flash3'"),
])
def test_bench_attention_refuses_bad_options_before_any_gpu_work(argv, says, capsys, monkeypatch):
    """Both were refused only after the correctness check and the host-time rows had run on the GPU."""
    from tileattn.bench import attention

    import tileattn.runtime

    monkeypatch.setattr(tileattn.runtime, "require_gpu", lambda: pytest.fail("reached the GPU check"))
    with pytest.raises(SystemExit):
        attention.main(argv)
    assert says in capsys.readouterr().err


def test_rounds_rotate_which_implementation_is_timed_first():
    from tileattn.bench.attention import round_order

    impls = {"sdpa_cudnn": 1, "tileattn": 2, "sdpa_flash": 3}
    orders = [[name for name, _ in round_order(impls, rnd)] for rnd in range(4)]
    assert orders[0] == ["sdpa_cudnn", "tileattn", "sdpa_flash"]
    assert [o[0] for o in orders[:3]] == ["sdpa_cudnn", "tileattn", "sdpa_flash"]  # each first once
    assert all(sorted(o) == sorted(impls) for o in orders) and orders[3] == orders[0]
    assert round_order({}, 5) == []


def test_report_table_shows_the_median_round(tmp_path, capsys):
    path = tmp_path / "run.json"
    write_run(path, [_point("tileattn", 4096, t, round=i) for i, t in enumerate((100.0, 505.0, 900.0))],
              {"gpu": "test"})
    assert report.main([str(path)]) == 0
    table = capsys.readouterr().out
    assert "505" in table and "900" not in table and "| 100" not in table


def test_host_overhead_enters_sdpa_kernel_once_outside_the_timed_calls(monkeypatch):
    """bench attention's host-time rows: SDPA runs under the flash backend, chosen once around the
    timed burst (as in bench overhead), so the ~7.5 us of entering and leaving sdpa_kernel per call
    is not billed to SDPA. CPU: stubs for SDPA, tileattn.attention and the timer."""
    import contextlib

    import torch
    import torch.nn.attention as nn_attention

    import tileattn
    from tileattn.bench import attention

    entries, seen = [], []
    real = nn_attention.sdpa_kernel

    @contextlib.contextmanager
    def counting(*args, **kwargs):
        entries.append(args)
        with real(*args, **kwargs):
            yield

    def fake_sdpa(q, k, v, **kwargs):
        seen.append(("sdpa", torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))

    def fake_timer(fn, calls=200):
        before = len(entries)
        for _ in range(5):
            fn()
        assert len(entries) == before, "sdpa_kernel entered inside the timed calls"
        return 1.0

    monkeypatch.setattr(nn_attention, "sdpa_kernel", counting)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    monkeypatch.setattr(tileattn, "attention", lambda *a, **kw: seen.append(("tileattn",)))
    monkeypatch.setattr(attention, "host_overhead_us", fake_timer)
    q = torch.zeros(1, 1, 4, 8)
    records = attention.host_overhead_records(q, q, q)
    assert [r["impl"] for r in records] == ["sdpa_flash", "tileattn"]
    assert all(r["suite"] == "host_overhead" and r["host_us_per_call"] == 1.0 for r in records)
    assert len(entries) == 1
    assert seen == [("sdpa", True, False)] * 5 + [("tileattn",)] * 5


@pytest.mark.parametrize("n_q, n_k", [(16, 16), (8, 24), (24, 8), (1, 100), (512, 4608), (129, 1000), (7, 7)])
def test_attention_flops_count_the_bottom_right_causal_mask(n_q, n_k):
    """bench attention's FLOP count against the mask itself: 4 d per visible (query, key) pair of
    tileattn's bottom-right causal mask, the diagonal counted half (N^2 / 2 at Nq = Nk, the
    convention of the published tables); non-causal Nq * Nk; backward 2.5x."""
    import torch

    from tileattn.bench.attention import flops

    b, h, d = 2, 3, 8
    i = torch.arange(n_q)[:, None] + n_k - n_q  # query i sees key j iff j <= i + Nk - Nq
    visible = int((torch.arange(n_k)[None, :] <= i).sum())
    diagonal_half = min(n_q, n_k) / 2
    assert flops(b, h, n_q, n_k, d, True, False) == 4 * b * h * d * (visible - diagonal_half)
    assert flops(b, h, n_q, n_k, d, False, False) == 4 * b * h * d * n_q * n_k
    assert flops(b, h, n_q, n_k, d, True, True) == 2.5 * flops(b, h, n_q, n_k, d, True, False)
    if n_q == n_k:
        assert flops(b, h, n_q, n_k, d, True, False) == 0.5 * 4 * b * h * d * n_q * n_k
