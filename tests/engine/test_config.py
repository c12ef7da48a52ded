"""EngineConfig's field checks: each bad value gets a ValueError naming the field, before the engine
loads anything (the path need not exist: validation comes first)."""

import pytest
import torch

from tileattn.engine.config import EngineConfig, parse_dtype

BAD_FIELDS = [
    ({"model": ""}, "^model must be a checkpoint path"),
    ({"model": None}, "^model must be a checkpoint path"),
    ({"max_num_seqs": 0}, "^max_num_seqs must be a positive int"),
    ({"max_num_batched_tokens": 8.0}, "^max_num_batched_tokens must be a positive int"),
    ({"block_size": True}, "^block_size must be a positive int"),
    ({"tensor_parallel_size": -1}, "^tensor_parallel_size must be a positive int"),
    ({"max_lora_rank": 0}, "^max_lora_rank must be a positive int"),
    ({"max_loras": -1}, "^max_loras must be an int >= 0"),
    ({"max_loras": False}, "^max_loras must be an int >= 0"),
    ({"scheduling_policy": "lifo"}, "^scheduling_policy must be 'fcfs' or 'priority'"),
    ({"max_loras": 1, "tensor_parallel_size": 2}, "^max_loras > 0 is not served with tensor_parallel_size > 1"),
    ({"max_model_len": 0}, "^max_model_len must be a positive int"),
    ({"kv_cache_blocks": 2.5}, "^kv_cache_blocks must be a positive int"),
    ({"num_speculative_tokens": 17}, r"^num_speculative_tokens must be an int in \[0, 16\]"),
    ({"gpu_memory_utilization": 0.0}, r"^gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"^gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": float("nan")}, r"^gpu_memory_utilization must be a number in \(0, 1\]"),
    # a string used to escape as a TypeError from the comparison
    ({"gpu_memory_utilization": "0.9"}, r"^gpu_memory_utilization must be a number in \(0, 1\], got '0.9'"),
    ({"gpu_memory_utilization": True}, r"^gpu_memory_utilization must be a number in \(0, 1\], got True"),
    ({"dtype": "int8"}, "^dtype must be 'auto', float32, bfloat16 or float16"),
    ({"dtype": torch.int32}, "^dtype must be float32, bfloat16 or float16"),
    ({"device": "gpu:0"}, "^device 'gpu:0' is not a torch device"),
    ({"device": 1.5}, "^device 1.5 is not a torch device"),  # a TypeError from torch.device before
    ({"device": ["cuda"]}, r"^device \['cuda'\] is not a torch device"),
]


@pytest.mark.parametrize("change,match", BAD_FIELDS)
def test_bad_fields_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"model": "/no/such/checkpoint", **change})


def test_good_fields_pass_and_dtypes_parse():
    config = EngineConfig("/no/such/checkpoint", dtype="BF16", device="cpu", max_loras=0, max_model_len=None)
    assert config.dtype == torch.bfloat16
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("float16") == parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="^max_dtype must be"):
        parse_dtype("double", name="max_dtype")
