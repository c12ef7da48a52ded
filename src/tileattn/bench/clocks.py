"""The GPU's clocks, power and temperature while a benchmark runs, sampled by `nvidia-smi`.

A memory-bound loop that runs for a second or more (a batch-1 decode streams 15 GB per Llama-3-8B
token) can lower the SM clock as the GPU reaches its power or thermal limit; a figure measured then
is the throttled machine's, and runs on one machine kind differ by a few percent for this reason
alone. So the engine's decode records carry what the GPU ran at:

    with ClockSampler(device_index) as sampler:
        ...                                   # the measured work
    summary = sampler.summary()               # None where nvidia-smi is missing or failed

`nvidia-smi -lms` prints a line every `interval_ms` from its own process, so the sampling costs
the measured process nothing. The summary: sample count; min / median / max of the SM and memory
clocks (MHz), power draw (W) and temperature (C); and every clock-event reason that was active
(nvidia-smi's bit mask, e.g. 0x...04 = software power cap, 0x...20 = software thermal slowdown).
"""

from __future__ import annotations

import re
import statistics
import subprocess

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
_NUMERIC = ("sm_mhz", "mem_mhz", "power_w", "temp_c")


def parse_samples(text: str) -> list[dict]:
    """Lines of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` -> one dict per line
    with sm_mhz, mem_mhz, power_w, temp_c (floats) and reasons (the hex mask as printed). Lines
    that do not parse (a header, "[N/A]", a cut last line) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            values = [float(p) for p in parts[:4]]
        except ValueError:
            continue
        samples.append({**dict(zip(_NUMERIC, values)), "reasons": parts[4]})
    return samples


def summarize(samples: list[dict]) -> dict | None:
    """min / median / max per numeric field and the set of active clock-event reasons; None
    without samples."""
    if not samples:
        return None
    out: dict = {"samples": len(samples)}
    for key in _NUMERIC:
        values = [s[key] for s in samples]
        out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    out["reasons"] = sorted({s["reasons"] for s in samples})
    return out


class ClockSampler:
    """Samples the GPU `device` (a CUDA ordinal, mapped to nvidia-smi by UUID when torch knows it)
    every `interval_ms` while the `with` block runs. Never raises for a missing or failing
    nvidia-smi (summary() is None then), nor on a machine without a GPU."""

    def __init__(self, device: int, interval_ms: int = 100):
        if interval_ms < 1:
            raise ValueError(f"interval_ms must be >= 1, got {interval_ms}")
        self.device, self.interval_ms = device, interval_ms
        self._process = None
        self._text = ""

    def _target(self) -> str:
        try:
            import torch

            uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
            if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuid):
                return f"GPU-{uuid}"  # nvidia-smi's own name for it: CUDA's ordinal may be remapped
        except (RuntimeError, AssertionError, AttributeError):
            pass
        return str(self.device)

    def __enter__(self) -> ClockSampler:
        cmd = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
               "-i", self._target(), "-lms", str(self.interval_ms)]
        try:
            self._process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._text, _ = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._text, _ = self._process.communicate()

    def summary(self) -> dict | None:
        return summarize(parse_samples(self._text))


def format_summary(summary: dict | None) -> str:
    """One line for a table's footer."""
    if summary is None:
        return "GPU clocks: not sampled (nvidia-smi missing, or it refused the query)"
    sm, mem, power, temp = (summary[k] for k in _NUMERIC)
    return (f"GPU clocks over {summary['samples']} samples: SM {sm['min']:.0f}-{sm['max']:.0f} MHz "
            f"(median {sm['median']:.0f}), memory {mem['min']:.0f}-{mem['max']:.0f} MHz, power up to "
            f"{power['max']:.0f} W, temperature up to {temp['max']:.0f} C, clock-event reasons "
            f"{', '.join(summary['reasons'])}")
