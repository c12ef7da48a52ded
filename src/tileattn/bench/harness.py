"""The one timing harness: warm-up, CUDA events, many repetitions, median and spread, L2 flushed.

Every benchmark in tileattn and the labs times through `measure`, so their numbers are comparable:
- warm-up calls first (module load, compilation, allocator growth stay out of the numbers), and
  then more of them until the device has run the call for WARM_SECONDS: on the H200 a burst of
  tensor-core work that starts after a pause trips the software power cap (nvidia-smi clock-event
  reason 0x4) and the SM clock drops to 1.71-1.80 GHz for its first ~0.3-0.4 s before returning to
  1.97-1.98 GHz under the same load (sampled every 20 ms on 2026-12-02, docs/BENCHMARKS.md). A
  measurement of ~0.1 s that starts right after a pause reads that transient, and whichever
  implementation happened to start after one read ~10 % slower: cuDNN's and tileattn's backward at
  N = 4096 both read 4.66 or 5.1 ms depending on it. Another machine start (2026-12-04, session 28)
  showed the opposite transient: 1965-1980 MHz for the whole first measurement after light work
  (warm-up included), 1470-1680 MHz at the cap for every later one, so a single round can still
  favour whichever implementation comes first after a pause; `--rounds` with rotation and the
  median is the remedy there. The steady state is what a workload sees;
- each repetition is bracketed by its own pair of CUDA events on torch's current stream, and all
  repetitions are enqueued before one synchronization (the host runs ahead as in real use). The
  warm-up ends with a synchronization, so without help the first repetitions start on an idle
  device and their events time the host's launches too. In the H200 runs of 2026-12-02 the
  slowest repetition of nearly every point read 1.5-3x its median (max_ms in the records), and a
  few whole rounds of a 0.5 ms backward (three Python launches) read 1.3-1.8x slow, which
  host-bound repetitions would explain (docs/BENCHMARKS.md, session 12). With the L2 flush on,
  `measure` therefore first enqueues a lead of extra flushes, about twice the host time of all the
  repetitions, so the device is still busy with them when the host has enqueued the last one
  (written after the session's device time was spent: tests/gpu/test_bench_harness.py has not run yet);
- before each repetition the L2 is flushed (outside the events), so a small input cannot be served
  from cache across repetitions: a pass that writes a buffer twice the L2 size, then a pass that
  reads another one, so the L2 is left holding clean lines. With the write pass alone (the harness
  until 2026-12-01 evening; TILEATTN_BENCH_FLUSH=write brings it back) the L2 is left full of dirty
  lines, and the timed call pays for writing them back as it evicts them: up to ~60 MB of write
  traffic, ~12 us on an H200 by docs/attention_paged.md's model, which only short calls notice;
- kernels launch without programmatic dependent launch inside `measure` (TILEATTN_PDL=0 for its
  duration): PDL lets a kernel start during the tail of the kernel before it, an effect between
  kernels that a one-call timing bracketed by events cannot attribute (scripts/pdl_timing_probe.py
  on the H200 timed the same B=1 decode at 26.0 us without and 51.6 us with it, host-bound in
  both; docs/BENCHMARKS.md), and the peers (SDPA,
  cuDNN) do not use it; its effect is measured where it acts, in the engine's CUDA graphs;
- peak extra memory is read from torch's allocator in a separate call: max_memory_allocated during
  the call minus memory_allocated before it (the call's temporaries and outputs);
- with TILEATTN_BENCH_CLOCKS=MS set, nvidia-smi samples the GPU's clocks, power and clock-event
  reasons every MS milliseconds while `measure` runs (warm-up included: a short measurement would
  otherwise end before the first sample), and the Timing carries the summary (bench/clocks.py) as
  `gpu_clocks`. Under sustained tensor-core work the H200 sits at its software power cap, and two
  kernels' ratio then depends on the clock each ran at (docs/BENCHMARKS.md, session 12, E4).
Cold start (first call, compile included) is measured separately by `cold_start`, and the host
time of one call by `host_overhead_us`.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable


WARM_SECONDS = 0.5  # device seconds of warm-up before timing (the power-cap transient, above)


@dataclass
class Timing:
    """Times in milliseconds over `reps` repetitions; peak extra memory in bytes."""

    median_ms: float
    min_ms: float
    max_ms: float
    q1_ms: float
    q3_ms: float
    reps: int
    peak_extra_bytes: int | None = None
    gpu_clocks: dict | None = None  # with TILEATTN_BENCH_CLOCKS (module docstring)

    def as_dict(self) -> dict:
        out = asdict(self)
        if out["gpu_clocks"] is None:
            del out["gpu_clocks"]
        return out


_flush_buffers = None  # (written, read), each twice the L2 size
_flush_costs = None  # (device seconds, host seconds) of one flush, timed once per process
LEAD_MAX_SECONDS = 0.25  # the host lead's cap (a slow host then times some of its launches again)
FLUSH_MODES = ("clean", "write")


def positive_int(text: str) -> int:
    """argparse type of the benchmarks' counts and sizes: an int >= 1, refused as an option error (before
    any GPU work) otherwise."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def clock_interval_ms() -> int | None:
    """nvidia-smi's sampling interval while `measure` runs (TILEATTN_BENCH_CLOCKS, in ms), or None
    when unset or 0."""
    text = os.environ.get("TILEATTN_BENCH_CLOCKS", "0")
    if not text.isdigit():
        raise ValueError(f"TILEATTN_BENCH_CLOCKS must be a whole number of milliseconds, got {text!r}")
    return int(text) or None


def flush_mode() -> str:
    """How `measure` flushes the L2: "clean" (default) or "write" (TILEATTN_BENCH_FLUSH)."""
    mode = os.environ.get("TILEATTN_BENCH_FLUSH", "clean")
    if mode not in FLUSH_MODES:
        raise ValueError(f"TILEATTN_BENCH_FLUSH must be one of {FLUSH_MODES}, got {mode!r}")
    return mode


def _flush_l2() -> None:
    import torch

    global _flush_buffers
    if _flush_buffers is None:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        size = max(2 * l2, 1 << 20)
        _flush_buffers = (torch.empty(size, dtype=torch.uint8, device="cuda"),
                          torch.zeros(size // 4, dtype=torch.float32, device="cuda"))
    written, read = _flush_buffers
    written.fill_(1)  # a write pass evicts every line the timed call could reuse
    if flush_mode() == "clean":
        read.sum()  # reads evict the written lines, so their write-back happens here, not in the call


def flush_costs() -> tuple[float, float]:
    """(device seconds, host seconds) of one `_flush_l2`: medians of 5, timed once per process."""
    import torch

    global _flush_costs
    if _flush_costs is None:
        _flush_l2()
        pairs, host = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)], []
        for start, end in pairs:
            start.record()
            begin = time.perf_counter()
            _flush_l2()
            host.append(time.perf_counter() - begin)
            end.record()
        torch.cuda.synchronize()
        device = statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3
        _flush_costs = (max(device, 1e-6), statistics.median(host))
    return _flush_costs


def host_lead(seconds: float) -> int:
    """Enqueue L2 flushes worth about `seconds` of device time (at most LEAD_MAX_SECONDS), so that
    the host can enqueue what follows before the device gets to it; returns the flush count."""
    count = math.ceil(min(seconds, LEAD_MAX_SECONDS) / flush_costs()[0])
    for _ in range(count):
        _flush_l2()
    return count


def peak_extra_memory(fn: Callable[[], object]) -> int:
    """Bytes allocated at the peak of one call of `fn`, above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return int(peak)


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    reps: int = 20,
    flush_l2: bool = True,
    memory: bool = True,
    max_seconds: float | None = 10.0,
) -> Timing:
    """Time `fn` (device work enqueued on torch's current stream) with CUDA events.

    `reps` repetitions (fewer if they would take more than `max_seconds` of device time, at
    least 3); returns median, min/max and the interquartile range, plus the peak extra memory of
    one call. All repetitions are enqueued before the one synchronization at the end, so the host
    runs ahead of the device as it does in a real workload: a call's Python/launch overhead is
    hidden behind the previous repetition's device work unless it is longer than that work.
    Launches inside are plain (TILEATTN_PDL=0; the module docstring says why).
    """
    interval = clock_interval_ms()
    saved_pdl = os.environ.get("TILEATTN_PDL")
    os.environ["TILEATTN_PDL"] = "0"  # plain launches (module docstring)
    try:
        if interval is None:
            return _measure(fn, warmup, reps, flush_l2, memory, max_seconds)
        import torch

        from .clocks import ClockSampler

        with ClockSampler(torch.cuda.current_device(), interval_ms=interval) as sampler:
            timing = _measure(fn, warmup, reps, flush_l2, memory, max_seconds)
        timing.gpu_clocks = sampler.summary()
        return timing
    finally:
        if saved_pdl is None:
            os.environ.pop("TILEATTN_PDL", None)
        else:
            os.environ["TILEATTN_PDL"] = saved_pdl


def _measure(fn, warmup: int, reps: int, flush_l2: bool, memory: bool, max_seconds: float | None) -> Timing:
    import torch

    # Each warm-up call timed on its own: the first may include a compile or a library's plan
    # search, so the estimate of one call is the fastest of them (an average would inflate it,
    # cutting the repetitions to 3 and skipping the warm-up below).
    warm_events, host_times_s = [], []
    for _ in range(max(warmup, 1)):
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        begin = time.perf_counter()
        fn()
        host_times_s.append(time.perf_counter() - begin)
        pair[1].record()
        warm_events.append(pair)
    torch.cuda.synchronize()
    warm_times_s = [s.elapsed_time(e) / 1e3 for s, e in warm_events]
    estimate_s = min(warm_times_s)
    remaining_s = WARM_SECONDS - sum(warm_times_s)
    if estimate_s > 0 and remaining_s > 0:  # keep the device busy past the power-cap transient (module docstring)
        for _ in range(min(math.ceil(remaining_s / estimate_s), 10_000)):
            fn()
        torch.cuda.synchronize()
    if max_seconds is not None and estimate_s > 0:
        reps = max(3, min(reps, int(max_seconds / estimate_s)))
    if flush_l2:  # the host lead (module docstring): twice the host time of the repetitions and their flushes
        host_lead(2 * reps * (min(host_times_s) + flush_costs()[1]))
    events = []
    for _ in range(reps):
        if flush_l2:
            _flush_l2()
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        fn()
        pair[1].record()
        events.append(pair)
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return summarize(times, peak_extra_memory(fn) if memory else None)


def host_overhead_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host (CPU) microseconds per call of `fn`, measured on a problem small enough that the
    device keeps up: wall time of `calls` back-to-back calls, no synchronization inside."""
    import torch

    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def summarize(times_ms: list[float], peak_extra_bytes: int | None = None) -> Timing:
    if not times_ms:
        raise ValueError("no timings to summarize")
    ordered = sorted(times_ms)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1, q3 = ordered[0], ordered[-1]
    return Timing(
        median_ms=statistics.median(ordered),
        min_ms=ordered[0],
        max_ms=ordered[-1],
        q1_ms=q1,
        q3_ms=q3,
        reps=len(ordered),
        peak_extra_bytes=peak_extra_bytes,
    )


def cold_start(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of the first call of `fn`, compilation and module load included."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start
