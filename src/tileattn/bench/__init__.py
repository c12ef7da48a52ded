"""The benchmark harness (timing, environment, JSON records, Markdown/PNG reports) and workloads."""

from .env import environment
from .harness import Timing, cold_start, host_overhead_us, measure, peak_extra_memory, summarize
from .records import read_run, write_run

__all__ = ["Timing", "cold_start", "host_overhead_us", "environment", "measure", "peak_extra_memory", "read_run", "summarize", "write_run"]
