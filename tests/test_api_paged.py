"""CPU tests for tileattn.api_paged: argument checks (ValueError naming the argument, before any
launch), and the launch decisions that need no GPU (warp layout, split-KV count, registry)."""

import numpy as np
import pytest
import torch

from tileattn import api_paged
from tileattn.kernels import attention_paged_sm80 as paged
from tileattn.kernels import family, kv_cache

pytestmark = pytest.mark.filterwarnings("error")


def paged_args(**change):
    """Valid metadata for attention_paged (CPU tensors: they pass every check but the device one)."""
    args = {
        "q": torch.zeros(5, 8, 128, dtype=torch.bfloat16),
        "k_cache": torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16),
        "v_cache": torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16),
        "block_table": torch.zeros(2, 3, dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 1, 5], dtype=torch.int32),
        "seqlens_k": torch.tensor([7, 20], dtype=torch.int32),
        "max_seqlen_q": 4,
        "max_seqlen_k": 20,
    }
    args.update(change)
    return args


BAD_PAGED = [
    ({"q": torch.zeros(5, 8, 128)}, "must share one dtype"),
    (
        {
            "q": torch.zeros(5, 8, 128),
            "k_cache": torch.zeros(6, 16, 2, 128),
            "v_cache": torch.zeros(6, 16, 2, 128),
        },
        "q has dtype torch.float32; attention_paged supports",
    ),
    ({"q": torch.zeros(5, 8, 128, 1, dtype=torch.bfloat16)}, "q must be rank-3"),
    ({"q": [1, 2]}, "q must be a torch.Tensor"),
    ({"block_table": torch.zeros(2, 3, dtype=torch.int64)}, "block_table must be int32"),
    ({"cu_seqlens_q": torch.tensor([0, 1, 5])}, "cu_seqlens_q must be int32"),
    ({"seqlens_k": torch.tensor([7.0, 20.0])}, "seqlens_k must be an integer tensor"),
    ({"seqlens_k": torch.tensor([7], dtype=torch.int32)}, "seqlens_k must have B = 2"),
    ({"cu_seqlens_q": torch.tensor([0, 5], dtype=torch.int32)}, "cu_seqlens_q must have B\\+1 = 3"),
    ({"q": torch.zeros(5, 8, 96, dtype=torch.bfloat16)}, "q and k_cache head dims must match"),
    ({"q": torch.zeros(5, 7, 128, dtype=torch.bfloat16)}, r"kv heads \(2\) must divide q heads \(7\)"),
    (
        {
            "q": torch.zeros(5, 8, 48, dtype=torch.bfloat16),
            "k_cache": torch.zeros(6, 16, 2, 48, dtype=torch.bfloat16),
            "v_cache": torch.zeros(6, 16, 2, 48, dtype=torch.bfloat16),
        },
        r"head dim d=48 is not supported by attention_paged",
    ),
    (
        {
            "k_cache": torch.zeros(6, 24, 2, 128, dtype=torch.bfloat16),
            "v_cache": torch.zeros(6, 24, 2, 128, dtype=torch.bfloat16),
        },
        "block_size .* power of two in 16..256, got 24",
    ),
    (
        {
            "k_cache": torch.zeros(6, 8, 2, 128, dtype=torch.bfloat16),
            "v_cache": torch.zeros(6, 8, 2, 128, dtype=torch.bfloat16),
        },
        "power of two in 16..256, got 8",
    ),
    ({"v_cache": torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)}, "v_cache .* must have k_cache's shape"),
    ({"max_seqlen_q": -1}, "max_seqlen_q must be a non-negative int"),
    ({"max_seqlen_k": 2.0}, "max_seqlen_k must be a non-negative int"),
    ({"scale": 0.0}, "scale must be finite and > 0"),
    ({"scale": float("nan")}, "scale must be finite and > 0"),
    ({"num_splits": 0}, "num_splits must be None or an int >= 1"),
    ({"num_splits": True}, "num_splits must be None or an int >= 1"),
    (
        {"q": torch.zeros(5, 128, 8, dtype=torch.bfloat16).transpose(1, 2)},
        "q must have a contiguous last dim",
    ),
    (
        {"q": torch.zeros(5, 8, 132, dtype=torch.bfloat16)[..., :128]},
        r"q.stride\(1\) = 132 is not a multiple",
    ),
    (
        {"k_cache": torch.zeros(6, 16, 2, 132, dtype=torch.bfloat16)[..., :128]},
        r"k_cache.stride\(2\) = 132",
    ),
    ({"block_table": torch.zeros(3, 2, dtype=torch.int32).t()}, r"block_table must have stride\(1\) == 1"),
    ({"seqlens_k": torch.zeros(4, dtype=torch.int32)[::2]}, "seqlens_k must be contiguous"),
    ({"q": torch.zeros(5, 0, 128, dtype=torch.bfloat16)}, r"^q must have at least one head, got shape \(5, 0, 128\)"),
    # the kernels' int32 index arithmetic (zero-stride expands and meta tensors: no memory)
    ({"block_table": torch.zeros(2, 1, dtype=torch.int32).expand(2, 2**27)},
     r"^block_table capacity 134217728 \* 16 keys exceeds 2\^31 - 1"),
    ({"k_cache": torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16).expand(2**27, 16, 2, 128),
      "v_cache": torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16).expand(2**27, 16, 2, 128)},
     r"^k_cache has 2147483648 slots and q 40 rows; at most 2\^31 - 1"),
    ({"max_seqlen_q": 2**30}, r"^max_seqlen_q=1073741824 times the GQA group size exceeds 2\^31 - 1"),
    ({"q": torch.empty(5, 8, 128, dtype=torch.bfloat16, device="meta"),
      "k_cache": torch.empty(6, 16, 2, 128, dtype=torch.bfloat16, device="meta"),
      "v_cache": torch.empty(6, 16, 2, 128, dtype=torch.bfloat16, device="meta"),
      "block_table": torch.empty_strided((2, 3), (2**31, 1), dtype=torch.int32, device="meta"),
      "cu_seqlens_q": torch.empty(3, dtype=torch.int32, device="meta"),
      "seqlens_k": torch.empty(2, dtype=torch.int32, device="meta")},
     r"^block_table row stride 2147483648 exceeds 2\^31 - 1"),
    ({"q": torch.empty(5, 8, 128, dtype=torch.bfloat16, device="meta"),
      "k_cache": torch.empty_strided((6, 16, 2, 128), (16 * 2**27, 2**27, 128, 1), dtype=torch.bfloat16, device="meta"),
      "v_cache": torch.empty_strided((6, 16, 2, 128), (16 * 2**27, 2**27, 128, 1), dtype=torch.bfloat16, device="meta"),
      "block_table": torch.empty(2, 3, dtype=torch.int32, device="meta"),
      "cu_seqlens_q": torch.empty(3, dtype=torch.int32, device="meta"),
      "seqlens_k": torch.empty(2, dtype=torch.int32, device="meta")},
     r"^one cache block spans more than 2\^31 - 1 elements \(block_size 16 x row stride 134217728\)"),
    (  # one grid row per sequence: 65536 sequences exceed CUDA's 65535 (tileattn.launch_limits)
        {
            "block_table": torch.zeros(65536, 1, dtype=torch.int32),
            "cu_seqlens_q": torch.zeros(65537, dtype=torch.int32),
            "seqlens_k": torch.zeros(65536, dtype=torch.int32),
        },
        r"B=65536 and Hkv=2 must be at most 65535 \(launch grid limit\)",
    ),
    ({}, "attention_paged needs CUDA tensors, got device cpu"),
]


@pytest.mark.parametrize("change,match", BAD_PAGED)
def test_attention_paged_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        api_paged.attention_paged(**paged_args(**change))
    # A failed call is never cached: the same arguments fail the same way again.
    with pytest.raises(ValueError, match=match):
        api_paged.attention_paged(**paged_args(**change))


BAD_VARIANTS = [
    ({"window": (1,)}, "window must be None or a pair"),
    ({"window": [3, -2]}, r"window\[1\] \(right\) must be an int >= -1"),
    ({"window": (2.5, 0)}, r"window\[0\] \(left\) must be an int >= -1"),
    ({"softcap": -1.0}, "softcap must be None, 0 .off. or a finite number > 0"),
    ({"softcap": float("inf")}, "softcap must be None, 0 .off. or a finite number > 0"),
    ({"softcap": 1e-50}, "softcap must be None, 0 .off. or a finite number > 0 within"),  # scale / cap: inf in float32
    ({"scale": 1e39}, "scale must be finite and > 0 within"),
    ({"alibi_slopes": [0.1] * 8}, "alibi_slopes must be None or a torch.Tensor"),
    ({"alibi_slopes": torch.zeros(4)}, r"alibi_slopes must have shape \[H\]=\[8\] or \[B, H\]=\[2, 8\]"),
    ({"alibi_slopes": torch.zeros(3, 8)}, "alibi_slopes must have shape"),
    ({"alibi_slopes": torch.zeros(8, dtype=torch.float64)}, "alibi_slopes must be float32"),
    ({"alibi_slopes": torch.zeros(8, 2).t()}, "alibi_slopes must be contiguous"),
    # the variant kernels' int32 window arithmetic: Tq and the table's capacity <= 2^28
    ({"window": (8, 0), "block_table": torch.zeros(2, (1 << 20) + 1, dtype=torch.int32),
      "k_cache": torch.zeros(6, 256, 2, 128, dtype=torch.bfloat16),
      "v_cache": torch.zeros(6, 256, 2, 128, dtype=torch.bfloat16)},
     r"capacity max_blocks \* block_size <= 2\^28 .*capacity=268435712"),
    # well-formed variants reach the device check like a plain call
    ({"window": (8, 0), "softcap": 30.0, "alibi_slopes": torch.zeros(2, 8)}, "attention_paged needs CUDA tensors"),
    ({"softcap": 0.0}, "attention_paged needs CUDA tensors"),  # 0: off, the plain path
    ({"softcap": ""}, "softcap must be None, 0"),  # falsy, but no number: named, not taken as off
    ({"softcap": []}, "softcap must be None, 0"),
    # flags are read by value: causal="false" once ran causal attention
    ({"causal": "false"}, "^causal must be a bool"), ({"causal": 0}, "^causal must be a bool"),
    ({"return_lse": None}, "^return_lse must be a bool"), ({"validate": "yes"}, "^validate must be a bool"),
    ({"causal": np.False_, "return_lse": np.True_}, "attention_paged needs CUDA tensors"),
]


@pytest.mark.parametrize("change,match", BAD_VARIANTS)
def test_attention_paged_rejects_bad_variants(change, match):
    """Variant arguments are checked as tileattn.attention checks them, before the device check
    (so CPU tensors report them), and a failed call is not cached."""
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            api_paged.attention_paged(**paged_args(**change))


def test_variant_instantiations_registered_and_configs():
    fam = family(paged.FAMILY_NAME)
    for d in paged.HEAD_DIMS:
        for bf16 in (False, True):
            for rows in (1, 16, 17, 64, 65, 4096):
                config = paged.pick_config(d, rows, "sm_90a", variants=True)
                assert config == paged.pick_config(d, rows, "sm_80"), "variant kernels take the base table"
                expr = paged.variant_expression(d, config, bf16)
                assert expr.startswith("tileattn::attention_paged_variants_sm80<"), expr
                fam.require(expr)
    assert len(paged.VARIANT_INSTANTIATIONS) == len(paged.PLAIN_INSTANTIATIONS) == 30


def write_args(**change):
    args = {
        "k": torch.zeros(3, 2, 64, dtype=torch.float16),
        "v": torch.zeros(3, 2, 64, dtype=torch.float16),
        "k_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16),
        "v_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16),
        "slot_mapping": torch.tensor([0, -1, 5]),
    }
    args.update(change)
    return args


BAD_WRITE = [
    ({"k": torch.zeros(3, 2, 64)}, "k, v, k_cache, v_cache must share one dtype"),
    ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int16)}, "slot_mapping must be int64 or int32"),
    ({"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, "slot_mapping must be an integer tensor"),
    ({"slot_mapping": torch.tensor([0, 1])}, "one token count"),
    ({"v": torch.zeros(3, 2, 32, dtype=torch.float16)}, r"v \(3, 2, 32\) must be \[T, Hkv, dim\] matching"),
    (
        {
            "k_cache": torch.zeros(4, 12, 2, 64, dtype=torch.float16),
            "v_cache": torch.zeros(4, 12, 2, 64, dtype=torch.float16),
        },
        "block_size .* must be a power of two, got 12",
    ),
    (
        {
            "k": torch.zeros(3, 2, 4, dtype=torch.float16),
            "v": torch.zeros(3, 2, 4, dtype=torch.float16),
            "k_cache": torch.zeros(4, 16, 2, 4, dtype=torch.float16),
            "v_cache": torch.zeros(4, 16, 2, 4, dtype=torch.float16),
        },
        "multiple of 16 bytes",
    ),
    ({"k": torch.zeros(3, 2, 68, dtype=torch.float16)[..., :64]}, r"k.stride\(1\) = 68"),
    (
        {
            "k": torch.zeros(3, 2, 1032),
            "v": torch.zeros(3, 2, 1032),
            "k_cache": torch.zeros(4, 16, 2, 1032),
            "v_cache": torch.zeros(4, 16, 2, 1032),
        },
        "is 4128 bytes; it must be a multiple of 16 bytes and at most 4096",
    ),
    ({"slot_mapping": torch.zeros(6, dtype=torch.int64)[::2]}, "slot_mapping must be contiguous"),
    (  # d = 0: reached the launch layer's division by the row's 16-byte chunks
        {
            "k": torch.zeros(3, 2, 0, dtype=torch.float16),
            "v": torch.zeros(3, 2, 0, dtype=torch.float16),
            "k_cache": torch.zeros(4, 16, 2, 0, dtype=torch.float16),
            "v_cache": torch.zeros(4, 16, 2, 0, dtype=torch.float16),
        },
        "is 0 bytes; it must be a multiple of 16 bytes",
    ),
    ({"k_cache": "cache"}, "k_cache must be a torch.Tensor"),
    ({"slot_mapping": torch.tensor([0, 1, 2], device="meta")}, "^k, v, k_cache, v_cache, slot_mapping must be on one device"),
    (  # caches of two widths (the shared checks compare only [num_blocks, block_size, Hkv])
        {"v": torch.zeros(3, 2, 32, dtype=torch.float16), "v_cache": torch.zeros(4, 16, 2, 32, dtype=torch.float16)},
        r"^v_cache \(4, 16, 2, 32\) must have k_cache's shape \(4, 16, 2, 64\)",
    ),
    (  # the kernel's int32 row index: T * Hkv = 2^31 rows (zero-stride expands: no memory)
        {
            "k": torch.zeros(1, 2, 64, dtype=torch.float16).expand(2**30, 2, 64),
            "v": torch.zeros(1, 2, 64, dtype=torch.float16).expand(2**30, 2, 64),
            "slot_mapping": torch.zeros(1, dtype=torch.int64).expand(2**30),
        },
        r"^k: T \* Hkv = 2147483648 rows exceeds 2\^31 - 257",
    ),
    ({"validate": "no"}, "^validate must be a bool"),  # read by value, not truthiness (a sync when true)
    ({}, "write_kv_cache needs CUDA tensors, got device cpu"),
]


@pytest.mark.parametrize("change,match", BAD_WRITE)
def test_write_kv_cache_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        api_paged.write_kv_cache(**write_args(**change))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
def test_pick_config_by_rows(head_dim, arch):
    decode, small, prefill = paged.configs(head_dim, arch)
    assert paged.pick_config(head_dim, 1, arch) is decode
    assert paged.pick_config(head_dim, 16, arch) is decode  # GQA-8 with 2 speculative tokens
    assert paged.pick_config(head_dim, 17, arch) is small
    assert paged.pick_config(head_dim, 64, arch) is small
    assert paged.pick_config(head_dim, 65, arch) is prefill
    for config in (decode, small, prefill):
        assert config.block_m // config.warps_m in (16, 32) and config.block_m % config.warps_m == 0, config
        assert config.warps_n == 1 or config.block_m == 16, config
        assert 1 in (config.warps_m, config.warps_n), config
        assert config.smem_bytes(head_dim) <= 227 * 1024, f"{config} at d={head_dim} does not fit an H200 SM"


def test_num_splits_from_launch_shape():
    sms, per_sm = 132, 2
    # Enough CTAs already: no split.
    assert paged.choose_num_splits(64 * 8, sms, per_sm, 4096, 64) == 1
    # B=1, MHA 32 heads: as many splits as fit in one wave: 8, 256 CTAs for 264 slots.
    assert paged.choose_num_splits(32, sms, per_sm, 4096, 64) == 8
    # B=1, GQA 32/8: 32 splits of two 64-key tiles (the capacity cap), 256 CTAs.
    assert paged.choose_num_splits(8, sms, per_sm, 4096, 64) == 32
    # B=8, GQA 32/8: 4 splits, 256 CTAs.
    assert paged.choose_num_splits(64, sms, per_sm, 4096, 64) == 4
    # A short table cannot be split finer than two 64-key tiles per split.
    assert paged.choose_num_splits(1, sms, per_sm, 256, 64) == 2
    assert paged.choose_num_splits(1, sms, per_sm, 64, 64) == 1
    # Never more than MAX_SPLITS.
    assert paged.choose_num_splits(1, sms, per_sm, 1 << 24, 64) <= paged.MAX_SPLITS
    # One wave, whatever the table's capacity (a long table must not turn GQA B=8 into 8 waves).
    assert paged.choose_num_splits(64, sms, per_sm, 32768, 64) == 4
    assert paged.choose_num_splits(32, sms, per_sm, 1 << 20, 64) == 8
    # Every choice keeps the grid at least as full as no split, in one wave.
    for ctas in (1, 3, 17, 100, 200):
        s = paged.choose_num_splits(ctas, sms, per_sm, 32768, 64)
        assert 1 <= s <= paged.MAX_SPLITS and ctas * s >= min(ctas, sms) and ctas * s <= sms * per_sm, (ctas, s)


def test_every_launch_expression_is_registered():
    fam = family(paged.FAMILY_NAME)
    for d in paged.HEAD_DIMS:
        for bf16 in (False, True):
            for config in paged.CONFIGS[d]:
                fam.require(paged.expression(d, config, bf16))
            for arch in paged.ARCH_CONFIGS:  # the arch tables' own tiles: in the arch's family
                arch_fam = family(paged.ARCH_FAMILY_NAME[arch])
                assert arch_fam.archs == (arch,)
                for config in paged.configs(d, arch):
                    expr = paged.expression(d, config, bf16)
                    (arch_fam if expr in arch_fam.instantiations else fam).require(expr)
    kv = family(kv_cache.FAMILY_NAME)
    for name in ("int32", "int64"):
        kv.require(kv_cache.expression(name))


def test_bytes_read_counts_k_and_v_per_kv_head():
    assert paged.bytes_read(8, [100, 28], 128) == 2 * 8 * 128 * 128 * 2
