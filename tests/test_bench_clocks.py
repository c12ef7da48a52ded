"""tileattn.bench.clocks: nvidia-smi's samples parsed and summarised; no GPU or nvidia-smi needed."""

import subprocess

import pytest

from tileattn.bench import clocks

SAMPLE = """1980, 3201, 512.34, 54, 0x0000000000000000
1755, 3201, 699.80, 61, 0x0000000000000004
[N/A], 3201, 700.00, 62, 0x0000000000000004
1830, 3201, 655.10, 60, 0x0000000000000000
1845, 32"""


def test_parse_samples_skips_lines_that_do_not_parse():
    samples = clocks.parse_samples(SAMPLE)
    assert [s["sm_mhz"] for s in samples] == [1980.0, 1755.0, 1830.0]
    assert samples[1] == {"sm_mhz": 1755.0, "mem_mhz": 3201.0, "power_w": 699.8, "temp_c": 61.0,
                          "reasons": "0x0000000000000004"}


def test_summarize_min_median_max_and_reasons():
    summary = clocks.summarize(clocks.parse_samples(SAMPLE))
    assert summary["samples"] == 3
    assert summary["sm_mhz"] == {"min": 1755.0, "median": 1830.0, "max": 1980.0}
    assert summary["power_w"]["max"] == 699.8 and summary["temp_c"]["min"] == 54.0
    assert summary["reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    line = clocks.format_summary(summary)
    assert "SM 1755-1980 MHz (median 1830)" in line and "power up to 700 W" in line
    assert clocks.summarize([]) is None
    assert "not sampled" in clocks.format_summary(None)


def test_sampler_without_nvidia_smi_gives_none(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "Popen", missing)
    with clocks.ClockSampler(0) as sampler:
        pass
    assert sampler.summary() is None


def test_sampler_reads_the_process_output(monkeypatch):
    """The sampler asks nvidia-smi for FIELDS at the interval, stops it on exit, parses what it printed."""
    seen = {}

    class FakeProcess:
        def __init__(self, cmd, **kwargs):
            seen["cmd"] = cmd

        def terminate(self):
            seen["terminated"] = True

        def communicate(self, timeout=None):
            return SAMPLE, None

    monkeypatch.setattr(subprocess, "Popen", FakeProcess)
    with clocks.ClockSampler(0, interval_ms=50) as sampler:
        pass
    assert seen["terminated"]
    assert f"--query-gpu={','.join(clocks.FIELDS)}" in seen["cmd"] and seen["cmd"][-2:] == ["-lms", "50"]
    assert sampler.summary()["samples"] == 3


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_ms must be >= 1, got 0"):
        clocks.ClockSampler(0, interval_ms=0)


def test_target_is_the_uuid_when_torch_knows_it_else_the_ordinal(monkeypatch):
    import torch

    class Props:
        uuid = "4a0f6c2e-1b2d-4c3e-9f10-0123456789ab"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert clocks.ClockSampler(3)._target() == "GPU-4a0f6c2e-1b2d-4c3e-9f10-0123456789ab"
    Props.uuid = "not-a-uuid"
    assert clocks.ClockSampler(3)._target() == "3"

    def no_gpu(device):
        raise RuntimeError("no CUDA GPU")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    assert clocks.ClockSampler(1)._target() == "1"
