"""CPU tests of `tileattn bench decode --sweep`'s harness code: argument parsing, the case list, record
building (split-count dedupe, comparison with the default's output, error records) and the tables,
with fake launches and timings (the GPU path differs only in `build` and `timer`)."""

from __future__ import annotations

import pytest
import torch

from tileattn.bench import decode
from tileattn.bench.harness import summarize
from tileattn.kernels import attention_paged_sm80 as paged

DEFAULT = paged.CONFIGS[128][0]
CANDIDATES = paged.DECODE_TUNING[128]
AUTO = {DEFAULT: 4, CANDIDATES[0]: 8, CANDIDATES[1]: 6, CANDIDATES[2]: 2}  # what choose_num_splits would say


class FakeLaunch:
    def __init__(self, config, requested):
        self.config = config
        self.num_splits = min(requested or AUTO[config], paged.MAX_SPLITS)
        self.groups = 64  # B * Hkv * M tiles of GQA 32/8 B=8


def fake_us(config, splits):
    """A time per (config, splits) with one clear minimum: candidate 0 at 8 splits."""
    return 50.0 + abs(splits - 8) + (0.0 if config == CANDIDATES[0] else 3.0)


def fake_sweep(broken=None):
    """sweep_point on a fake point: every config of the real table, outputs that differ by config."""
    base = {"suite": "decode_sweep", "b": 8, "h": 32, "hkv": 8, "kv_len": 4096, "d": 128, "dtype": "bf16",
            "block_size": 16, "default_config": str(DEFAULT)}
    reference = torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(0))  # [Tq, H, d]
    configs = [DEFAULT, *CANDIDATES]

    def build(config, requested):
        if config == broken:
            raise ValueError(f"{config}: does not fit")
        launch = FakeLaunch(config, requested)
        out = reference * (1 + 1e-3 * configs.index(config))  # rel. error 1e-3 per config index
        return launch, lambda: (out, None)

    def timer(run):
        launch = timer.last
        return summarize([fake_us(launch.config, launch.num_splits) / 1e3] * 3)

    def build_and_remember(config, requested):
        launch, run = build(config, requested)
        timer.last = launch
        return launch, run

    cases = decode.sweep_cases(configs, decode.SWEEP_SPLITS)
    records = decode.sweep_point(base, 134217728, cases, build_and_remember, timer)
    calib = [dict(base, impl=name, status="ok", us=us, **({"tbps": 4.0} if name != "calib_empty" else {}))
             for name, us in (("calib_empty", 9.5), ("calib_no_flush", 37.0), ("calib_write_flush", 36.0),
                              ("calib_read", 44.0), ("calib_read_no_flush", 33.0))]
    return records + calib


def test_parse_args_sweep_defaults_and_points():
    args = decode.parse_args(["--sweep"])
    assert args.points == decode.quick_points()
    assert (32, 8, 8, 4096) in args.points and len(args.points) == 6
    assert args.splits == decode.SWEEP_SPLITS and args.block_sizes == (16, 256)
    args = decode.parse_args(["--sweep", "--points", "32/8:8:4096", "32/32:1:32768", "--splits", "4", "8", "4",
                              "--block-sizes", "16", "--reps", "10"])
    assert args.points == [(32, 8, 8, 4096), (32, 32, 1, 32768)]
    assert args.splits == (4, 8) and args.block_sizes == (16,) and args.reps == 10
    prefill = decode.parse_args(["--prefill-only", "--block-sizes", "16", "32", "16"])
    assert prefill.block_sizes == (16, 32) and not prefill.sweep
    plain = decode.parse_args(["--quick", "--no-prefill"])  # without --sweep: the bench as before
    assert not plain.sweep and plain.points is None and plain.quick


@pytest.mark.parametrize(("argv", "named"), [
    (["--sweep", "--points", "32/8:8"], "--points"),  # missing KV
    (["--sweep", "--points", "32/5:8:4096"], "--points"),  # H not a multiple of Hkv
    (["--sweep", "--points", "32/8:0:4096"], "--points"),  # B = 0
    (["--sweep", "--splits", "0"], "--splits"),
    (["--sweep", "--block-sizes", "24"], "--block-sizes"),
    (["--sweep", "--block-sizes", "512"], "--block-sizes"),
    (["--points", "32/8:8:4096"], "--sweep"),  # sweep options without --sweep
    (["--block-sizes", "16"], "--prefill-only"),  # block sizes without --sweep or --prefill-only
    (["--prefill-only", "--block-sizes", "48"], "--block-sizes"),
    (["--sweep", "--reps", "0"], "--reps"),
    (["--sweep", "--points", "32/8:8:1000"], "--points"),  # KV not whole blocks of 16
    (["--rounds", "0"], "--rounds"),
    (["--prefill-only", "--no-prefill"], "--prefill-only"),
])  # fmt: skip
def test_parse_args_rejects(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        decode.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err, f"the error should name {named}: {err!r}"


def test_prefill_medians_and_table_take_each_implementations_median_over_rounds():
    base = {"suite": "prefill_chunk", "h": 32, "hkv": 32, "status": "ok"}
    dense_tf, paged_tf = (600.0, 520.0, 530.0), (500.0, 505.0, 495.0)  # dense's first round reads fast
    records = [dict(base, impl="tileattn_dense", round=i, tflops=t, us=1e6 / t) for i, t in enumerate(dense_tf)]
    records += [dict(base, impl="tileattn_paged", block_size=256, config="attention_fwd_sm90", round=i, tflops=t,
                     us=1e6 / t, rel_err_vs_dense=1e-3) for i, t in enumerate(paged_tf)]
    rows = decode.prefill_medians(records)
    assert [(r["impl"], r["tflops"], r["tflops_min"], r["tflops_max"], r["rounds"]) for r in rows] == [
        ("tileattn_dense", 530.0, 520.0, 600.0, 3), ("tileattn_paged", 500.0, 495.0, 505.0, 3)]
    table = decode.render(records)
    paged_row = next(line for line in table.splitlines() if "| tileattn_paged |" in line)
    assert "| 500 | 495-505 |" in paged_row and f"| {500 / 530:.3g} |" in paged_row, paged_row
    assert table.startswith("### chunked prefill"), "no decode records (--prefill-only): no decode table"


def test_parse_point_message_names_the_text():
    with pytest.raises(ValueError, match="'32x8:8:4096'"):
        decode.parse_point("32x8:8:4096")
    assert decode.parse_point("32/8:64:1024") == (32, 8, 64, 1024)


def test_sweep_cases_default_auto_first():
    cases = decode.sweep_cases([DEFAULT, *CANDIDATES], (1, 2))
    assert cases[0] == (DEFAULT, None)
    assert len(cases) == 4 * 3 and cases[3] == (CANDIDATES[0], None)


def test_sweep_point_records():
    records = [r for r in fake_sweep() if r["impl"] == "tileattn_paged_sweep"]
    # per config: auto + 1 2 4 8 16, less the forced count equal to the automatic one (8 of 2..16 with
    # auto 4, 8, 6, 2: DEFAULT drops 4, CANDIDATES[0] drops 8, [1] keeps all 6, [2] drops 2)
    per_config = {c: [r for r in records if r["config"] == str(c)] for c in (DEFAULT, *CANDIDATES)}
    assert [len(v) for v in per_config.values()] == [5, 5, 6, 5]
    first = records[0]
    assert first["config"] == str(DEFAULT) and first["splits_requested"] == "auto" and first["num_splits"] == 4
    assert first["rel_err_vs_default"] == 0.0
    for i, c in enumerate((DEFAULT, *CANDIDATES)):
        for r in per_config[c]:
            assert r["status"] == "ok" and r["ctas"] == 64 * r["num_splits"]
            assert r["rel_err_vs_default"] == pytest.approx(1e-3 * i, rel=1e-3, abs=1e-9)
            assert r["us"] == pytest.approx(fake_us(c, r["num_splits"]))
            assert r["tbps"] == pytest.approx(134217728 / (r["us"] * 1e-6) / 1e12)
            assert r["smem_kb"] == c.smem_bytes(128) / 1024
    assert len({(r["config"], r["num_splits"]) for r in records}) == len(records), "a (config, splits) timed twice"


def test_sweep_point_error_record_and_table():
    records = fake_sweep(broken=CANDIDATES[1])
    errors = [r for r in records if r.get("status", "").startswith("error")]
    assert len(errors) == 6 and all("does not fit" in r["status"] for r in errors)
    text = decode.render_sweep(records)
    row = next(line for line in text.splitlines() if line.startswith(f"| {CANDIDATES[1]} |"))
    assert "does not fit" in row


def test_render_sweep_default_best_top3_and_calibration():
    text = decode.render_sweep(fake_sweep())
    lines = text.splitlines()
    summary = next(line for line in lines if line.startswith("| 32/8 | 8 | 4096 | 16 |"))
    cells = [c.strip() for c in summary.strip("|").split("|")]
    assert cells[4] == f"{DEFAULT} s4"  # the default, automatic split count
    assert cells[5] == f"{fake_us(DEFAULT, 4):.1f} ({134217728 / (fake_us(DEFAULT, 4) * 1e-6) / 1e12:.2f})"
    assert cells[6] == f"{CANDIDATES[0]} s8"  # the fake times' minimum
    assert cells[8] == f"{fake_us(DEFAULT, 4) / fake_us(CANDIDATES[0], 8):.2f}x"
    top = cells[9].split("; ")
    # then the three 53.0 us cases (8 splits, +3) in timing order: the default's first
    assert top == [f"{CANDIDATES[0]} s8 50.0", f"{DEFAULT} s8 53.0", f"{CANDIDATES[1]} s8 53.0"]
    assert cells[10:] == ["9.5", "37.0 (4.00)", "36.0 (4.00)", "44.0 (4.00)", "33.0 (4.00)"]
    # the matrix: one row per config, a column per split count seen, the automatic one starred
    header = next(line for line in lines if line.startswith("| config |"))
    assert header.split("|")[2:-2] == [f" {s} " for s in (1, 2, 4, 6, 8, 16)]
    row = next(line for line in lines if line.startswith(f"| {DEFAULT} |"))
    assert f"{fake_us(DEFAULT, 4):.1f}*" in row and "| - |" in row  # no 6-split case for the default


class ReferenceLaunch:
    """Stands in for PagedLaunch on the CPU: the float reference on the same paged tensors."""

    def __init__(self, q, k_cache, v_cache, block_table, *, max_seqlen_q, causal, scale, return_lse, num_splits,
                 config):
        assert max_seqlen_q == 1 and causal and not return_lse and config is not None
        self.config, self.scale = config, scale
        self.num_splits = num_splits or AUTO[config]
        self.groups = block_table.shape[0] * k_cache.shape[2]  # B * Hkv (one M tile)

    def __call__(self, q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k):
        capacity = block_table.shape[1] * k_cache.shape[1]
        out = paged_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, 1, capacity,
                              causal=True, scale=self.scale)
        return out, None


def paged_reference(*args, **kwargs):
    from tileattn import reference

    return reference.attention_paged(*args, **kwargs)


def test_run_sweep_end_to_end_on_cpu(monkeypatch):
    """run_sweep's whole path (data, paging, launches, comparisons, calibrations, skipped points) on
    the CPU with the reference as the launch and a fake clock: every case and calibration is timed
    once, with the flush as documented, and the outputs agree (the paged cache holds the keys)."""
    import tileattn.runtime
    from tileattn.kernels import attention_paged_sm80

    timed = []

    def fake_measure(fn, *, warmup, reps, flush_l2=True, max_seconds=None, memory=True):
        fn()
        timed.append(flush_l2)
        return summarize([(40.0 + len(timed)) / 1e3] * reps)

    monkeypatch.setattr(tileattn.runtime, "device_arch", lambda *a: "sm_90a")
    monkeypatch.setattr(attention_paged_sm80, "PagedLaunch", ReferenceLaunch)
    monkeypatch.setattr(decode, "measure", fake_measure)
    points = [(32, 8, 2, 256), (32, 32, 1, 10**9)]  # the second one needs more memory than allowed
    records = decode.run_sweep(points, (16, 256), (1, 4), 3, 1.0, device="cpu")
    cases = [r for r in records if r["impl"] == "tileattn_paged_sweep"]
    # per block size: 4 configs x (auto, 1, 4) less the forced count equal to auto (DEFAULT's 4)
    assert len(cases) == 2 * (4 * 3 - 1)
    assert all(r["status"] == "ok" and r["rel_err_vs_default"] < 1e-6 for r in cases), "outputs differ"
    calib = [r for r in records if r["impl"].startswith("calib_")]
    assert [r["impl"] for r in calib] == 2 * ["calib_empty", "calib_no_flush", "calib_read", "calib_read_no_flush",
                                              "calib_write_flush"]
    # the harness's flush: on for the cases, per calibration as documented; the clean-flush pair off
    assert timed == 2 * ([True] * 11 + [True, False, True, False, False, False]), "flush per timing"
    clean = calib[4]  # fake clock: (flush + call) timed 16th, the flush alone 17th: 1 us apart
    assert clean["flush_and_call_us"] == pytest.approx(56.0) and clean["flush_us"] == pytest.approx(57.0)
    assert clean["us"] == pytest.approx(-1.0) and "tbps" not in clean
    skipped = [r for r in records if r["impl"] == "all"]
    assert len(skipped) == 1 and skipped[0]["status"].startswith("skipped") and skipped[0]["h"] == 32
    text = decode.render_sweep(records)
    assert "| 32/8 | 2 | 256 | 16 |" in text and "| 32/8 | 2 | 256 | 256 |" in text
    assert "32/32 B=1 KV=1000000000: skipped" in text


def test_decode_table_footer_names_the_copy_bandwidth_as_an_h200_reference():
    """The decode table's footer quotes a bandwidth measured once on an H200 (COPY_TBPS): it must
    say so, not read as this run's machine's copy bandwidth (a run on an H100 printed it bare)."""
    base = {"suite": "decode", "h": 32, "hkv": 8, "b": 8, "kv_len": 4096, "status": "ok", "us": 10.0, "tbps": 3.0}
    records = [dict(base, impl="sdpa_flash"), dict(base, impl="tileattn_paged", block_size=16, num_splits=1)]
    footer = next(line for line in decode.render(records).splitlines() if f"{decode.COPY_TBPS} TB/s" in line)
    assert "H200" in footer and "not measured in this run" in footer, footer
