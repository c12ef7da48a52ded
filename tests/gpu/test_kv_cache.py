"""GPU tests of the paged KV-cache write (csrc/kv_cache.cu, tileattn.api_paged.write_kv_cache)
against tileattn.reference.write_kv_cache: the caches start random, so every slot the kernel must
leave alone is checked too, bit for bit (the copy is exact)."""

from __future__ import annotations

import pytest
import torch

from tileattn import api_paged, reference

pytestmark = pytest.mark.gpu


def make(tokens, kv_heads, head_dim, num_blocks, block_size, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    k, v = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    return k, v, k_cache, v_cache


def slots_for(tokens, num_slots, seed, index_dtype):
    """Distinct slots in random order, some negative (skipped) and some past the cache (skipped)."""
    cpu = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=cpu)[:tokens]
    slots[torch.rand(tokens, generator=cpu) < 0.2] = -1
    if tokens > 2:
        slots[1] = num_slots  # first slot past the end
        slots[2] = num_slots + 12345
    return slots.to(index_dtype).cuda()


def check_write(k, v, k_cache, v_cache, slots, what):
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    assert api_paged.write_kv_cache(k, v, k_cache, v_cache, slots) is None
    bad_k = (k_cache != want_k).reshape(-1, *k_cache.shape[2:]).any(-1).any(-1).nonzero()
    assert bad_k.numel() == 0, f"{what}: k_cache differs at slots {bad_k[:8, 0].tolist()}"
    assert torch.equal(v_cache, want_v), f"{what}: v_cache differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_matches_reference(dtype, head_dim, block_size, index_dtype):
    num_blocks = 4096 // block_size
    k, v, k_cache, v_cache = make(1000, 8, head_dim, num_blocks, block_size, dtype, seed=head_dim + block_size)
    slots = slots_for(1000, num_blocks * block_size, seed=block_size, index_dtype=index_dtype)
    check_write(k, v, k_cache, v_cache, slots, f"{dtype} d={head_dim} bs={block_size} {index_dtype}")


@pytest.mark.sanitize
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_small_sanitize(tokens):
    k, v, k_cache, v_cache = make(tokens, 2, 64, 4, 16, torch.float16, seed=tokens)
    check_write(k, v, k_cache, v_cache, slots_for(tokens, 64, seed=tokens, index_dtype=torch.int64), f"T={tokens}")


def test_strided_views():
    """k/v as views into a fused qkv projection, caches as views with a padded head."""
    tokens, kv_heads, d = 129, 2, 128
    qkv = torch.randn(tokens, 8 + 2 * kv_heads, d, device="cuda").to(torch.bfloat16)
    k, v = qkv[:, 8 : 8 + kv_heads], qkv[:, 8 + kv_heads :]
    padded = torch.randn(2, 32, 16, kv_heads + 1, d, device="cuda").to(torch.bfloat16)
    k_cache, v_cache = padded[0, :, :, :kv_heads], padded[1, :, :, :kv_heads]
    slots = slots_for(tokens, 32 * 16, seed=4, index_dtype=torch.int64)
    pad_before = padded[..., kv_heads, :].clone()
    check_write(k, v, k_cache, v_cache, slots, "strided views")
    assert torch.equal(padded[..., kv_heads, :], pad_before), "the padding head of the cache was written"


def test_validate_reports_slots_past_the_cache():
    k, v, k_cache, v_cache = make(4, 2, 64, 2, 16, torch.bfloat16, seed=1)
    slots = torch.tensor([0, -1, 31, 32], device="cuda")
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = 32 is past the cache's 32 slots"):
        api_paged.write_kv_cache(k, v, k_cache, v_cache, slots, validate=True)
    api_paged.write_kv_cache(k[:3], v[:3], k_cache, v_cache, slots[:3], validate=True)  # in range: fine


def test_empty_is_a_no_op():
    k, v, k_cache, v_cache = make(0, 2, 64, 2, 16, torch.bfloat16, seed=2)
    before = k_cache.clone()
    api_paged.write_kv_cache(k, v, k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device="cuda"))
    assert torch.equal(k_cache, before)


def test_pdl_launch_matches_reference_eager_and_in_a_graph(monkeypatch):
    """TILEATTN_PDL=1: the kernel waits (griddepcontrol.wait) before reading k written by the kernel
    just before it; eager and graph-replayed writes equal the reference, and on sm_90+ the plan is
    a PDL plan."""
    from tileattn.kernels import kv_cache

    monkeypatch.setenv("TILEATTN_PDL", "1")
    tokens, kv_heads, d, block_size = 33, 4, 128, 16
    k, v, k_cache, v_cache = make(tokens, kv_heads, d, 64, block_size, torch.bfloat16, seed=7)
    slots = slots_for(tokens, 64 * block_size, seed=7, index_dtype=torch.int64)
    src = k.clone()
    k2 = torch.empty_like(k)

    def step():  # k2 written by a torch kernel right before the cache write reads it
        torch.mul(src, 2, out=k2)
        api_paged.write_kv_cache(k2, v, k_cache, v_cache, slots)

    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(src * 2, v, want_k, want_v, slots)
    step()
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "eager PDL write differs"
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert any(p.pdl for p in kv_cache._plans.values()) == hopper, f"PDL plan expected: {hopper}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        new = make(tokens, kv_heads, d, 64, block_size, torch.bfloat16, seed=100 + seed)
        src.copy_(new[0])
        v.copy_(new[1])
        k_cache.copy_(new[2])
        v_cache.copy_(new[3])
        want_k, want_v = k_cache.clone(), v_cache.clone()
        reference.write_kv_cache(src * 2, v, want_k, want_v, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, want_k), f"graph replay {seed}: k_cache differs"
        assert torch.equal(v_cache, want_v), f"graph replay {seed}: v_cache differs"
