"""Where an engine step's wall time goes, per step kind (decode / prefill / mixed).

Phases of one step, in order (wall time on the host, perf_counter laps):
  schedule     the scheduler picks sequences and token counts
  prepare      the packed input arrays of the step are built on the host
  h2d          they are copied to the device (enqueue only on CUDA)
  forward      the model forward and the logits of the sampled rows are launched (eager kernels or
               a graph replay); on the CPU this is the compute itself
  sample       sampling and the copy of the tokens back to the host; on CUDA this waits for the
               GPU to finish the forward, so the GPU time not hidden behind the host lands here
  postprocess  tokens appended, stop checks, detokenization, outputs built, blocks registered
and, on CUDA, device time between CUDA events recorded around the forward + logits and around
the sampling kernels (read after the step's sync point, so recording them adds no sync).

Enable it with LLMEngine.enable_profiling() (`tileattn bench engine --profile`) or the environment
variable TILEATTN_ENGINE_PROFILE=1 (the engine prints the table at shutdown).
"""

from __future__ import annotations

import time

PHASES = ("schedule", "prepare", "h2d", "forward", "sample", "postprocess")
GPU_PHASES = ("gpu_forward", "gpu_sample")
KINDS = ("decode", "prefill", "mixed")


class StepProfiler:
    """Accumulates per-kind phase times; cheap enough to leave on for a whole benchmark (a
    perf_counter call per phase, two pairs of CUDA events per step on CUDA)."""

    def __init__(self, device=None):
        self.cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        self.reset()

    def reset(self) -> None:
        self.totals = {kind: dict.fromkeys(PHASES + GPU_PHASES, 0.0) for kind in KINDS}
        self.steps = dict.fromkeys(KINDS, 0)
        self.tokens = dict.fromkeys(KINDS, 0)
        self.seqs = dict.fromkeys(KINDS, 0)
        self._laps = dict.fromkeys(PHASES, 0.0)
        self._events = None
        self._pending = []  # (kind, events) whose device times are read once they completed
        self._last = time.perf_counter()

    def begin(self) -> None:
        """Start of a step (its schedule phase starts here)."""
        self._last = time.perf_counter()
        for phase in PHASES:
            self._laps[phase] = 0.0
        self._events = None

    def lap(self, phase: str) -> None:
        """The time since the previous lap (or begin) was spent in ``phase``."""
        now = time.perf_counter()
        self._laps[phase] += now - self._last
        self._last = now

    def record(self, index: int) -> None:
        """CUDA event ``index`` of the step: 0 before the forward, 1 after the logits, 2 after the
        sampling kernels (before the tokens' copy to the host)."""
        if not self.cuda:
            return
        import torch

        if self._events is None:
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._events[index].record()

    def end(self, kind: str, tokens: int, seqs: int) -> None:
        """A step of ``kind`` with ``tokens`` tokens in ``seqs`` sequences ended."""
        totals = self.totals[kind]
        for phase in PHASES:
            totals[phase] += self._laps[phase]
        self.steps[kind] += 1
        self.tokens[kind] += tokens
        self.seqs[kind] += seqs
        if self._events is not None:
            self._pending.append((kind, self._events))
            self._events = None
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        """Add the device times of finished steps (all of them when ``wait``)."""
        keep = []
        for kind, events in self._pending:
            if not wait and not events[2].query():
                keep.append((kind, events))
                continue
            events[2].synchronize()
            totals = self.totals[kind]
            totals["gpu_forward"] += events[0].elapsed_time(events[1]) / 1e3
            totals["gpu_sample"] += events[1].elapsed_time(events[2]) / 1e3
        self._pending = keep

    def report(self) -> dict:
        """{kind: {"steps", "tokens_per_step", "seqs_per_step", "<phase>_ms" (mean per step),
        "total_ms"}} for the kinds that ran."""
        self._collect(wait=True)
        out = {}
        for kind in KINDS:
            steps = self.steps[kind]
            if not steps:
                continue
            totals = self.totals[kind]
            row = {"steps": steps, "tokens_per_step": self.tokens[kind] / steps,
                   "seqs_per_step": self.seqs[kind] / steps}
            for phase in PHASES + (GPU_PHASES if self.cuda else ()):
                row[f"{phase}_ms"] = totals[phase] / steps * 1e3
            row["total_ms"] = sum(totals[p] for p in PHASES) / steps * 1e3
            out[kind] = row
        return out

    def table(self, title: str = "engine step profile") -> str:
        """The report as a text table: mean milliseconds per step of each phase."""
        report = self.report()
        phases = PHASES + (GPU_PHASES if self.cuda else ())
        head = f"{'kind':<8}{'steps':>7}{'tok/step':>9}{'seq/step':>9}" + "".join(f"{p:>12}" for p in phases)
        lines = [f"{title} (mean ms per step)", head + f"{'total':>10}"]
        for kind, row in report.items():
            lines.append(f"{kind:<8}{row['steps']:>7}{row['tokens_per_step']:>9.1f}{row['seqs_per_step']:>9.1f}"
                         + "".join(f"{row[p + '_ms']:>12.3f}" for p in phases) + f"{row['total_ms']:>10.3f}")
        return "\n".join(lines)


class NullProfiler:
    """The profiler's interface doing nothing (profiling off)."""

    cuda = False

    def begin(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def record(self, index: int) -> None:
        pass

    def end(self, kind: str, tokens: int, seqs: int) -> None:
        pass


NULL = NullProfiler()
