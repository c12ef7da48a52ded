"""The timing harness on a GPU: the timed repetitions measure the device, not the host's launches."""

import time

import pytest
import torch

from tileattn.bench import harness

# exclusive: both tests time the device (CUDA events around flushes and a tiny kernel); with other
# pytest workers' kernels time-sliced onto the same GPU, the events also bracket their work.
pytestmark = [pytest.mark.gpu, pytest.mark.exclusive]


def test_host_lead_keeps_slow_host_calls_out_of_the_timing():
    """A call whose host side takes 2 ms and whose device side takes microseconds: without the
    lead of flushes before the repetitions, every repetition would start on an idle device and
    its events would bracket the host's 2 ms."""
    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(0.002)  # host work between the events, as a slow Python launch path would be
        x.add_(1)

    timing = harness.measure(call, warmup=3, reps=10, memory=False)
    assert timing.reps == 10
    assert timing.median_ms < 0.5, timing


def test_host_lead_is_capped_and_counts_flushes():
    device_s, host_s = harness.flush_costs()
    assert device_s > 0 and host_s > 0
    assert harness.host_lead(0.0) == 0
    count = harness.host_lead(10.0)  # far above the cap
    assert count == pytest.approx(harness.LEAD_MAX_SECONDS / device_s, abs=1)
    torch.cuda.synchronize()
