"""Vector add's argument checks run before any GPU work, so they are testable on the CPU."""

import pytest
import torch

from labs.vector_add import vector_add


def test_cpu_tensors_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        vector_add(torch.randn(4), torch.randn(4))


def test_wrong_dtype_and_rank():
    with pytest.raises(ValueError, match="float32"):
        vector_add(torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        vector_add(torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(ValueError, match="torch.Tensor"):
        vector_add([1.0], torch.randn(1))
