"""CPU tests of `tileattn bench variants`' table: each case's median over the rotated rounds, the
ratio to plain's median."""

import pytest
import torch

from tileattn.bench import variants
from tileattn.runtime import NoGPUError


def test_overhead_table_takes_medians_over_rounds():
    base = {"suite": "overhead", "n": 2048, "causal": False, "mode": "fwd", "status": "ok"}
    rounds = {"plain": (600.0, 540.0, 550.0), "alibi": (500.0, 495.0, 505.0)}  # plain's first round reads fast
    records = [dict(base, impl=impl, round=i, tflops=t) for impl, ts in rounds.items() for i, t in enumerate(ts)]
    row = next(line for line in variants.render(records).splitlines() if line.startswith("| 2048 |"))
    assert row == f"| 2048 | False | fwd | 550 | - | - | 500 ({500 / 550:.3f}) | - |"


def test_variant_filter_options_parse_before_the_gpu_is_needed():
    # --variant takes the overhead suite's case names only; valid options get as far as the GPU check.
    with pytest.raises(SystemExit):
        variants.main(["--suite", "overhead", "--variant", "tanh"])
    if not torch.cuda.is_available():  # on a GPU machine the call would run the benchmark
        with pytest.raises(NoGPUError):
            variants.main(["--suite", "overhead", "--variant", "softcap", "--variant", "alibi", "--forward-only"])


@pytest.mark.parametrize("heads", [0, -4])
def test_geometric_alibi_slopes_rejects_no_heads(heads):
    """An empty or negative head count is refused before any tensor is made (no GPU needed)."""
    with pytest.raises(ValueError, match="heads must be >= 1"):
        variants.geometric_alibi_slopes(heads)
