"""CPU tests for the inference references: attention_varlen, attention_paged, write_kv_cache.

The oracle here is a row-by-row loop (one query row, one head at a time, explicit softmax in
float64) written independently of tileattn.reference's batched code, plus the dense
reference.attention where the shapes allow it. Inputs are fresh random draws; every message
carries the seed (replay with TILEATTN_TEST_SEED=<seed>).
"""

import math
import os

import numpy as np
import pytest
import torch

from tileattn import reference as ref

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture
def seed():
    return int(os.environ.get("TILEATTN_TEST_SEED", np.random.SeedSequence().generate_state(1)[0]))


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def loop_oracle(q, keys, values, visible, scale):
    """q [nq, H, d], keys/values [nk, Hkv, d|dv], visible(i, j) -> bool; float64 row loop.

    Returns (out [nq, H, dv], lse [H, nq]).
    """
    nq, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(nq, heads, values.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, nq), -math.inf, dtype=torch.float64)
    for h in range(heads):
        for i in range(nq):
            cols = [j for j in range(keys.shape[0]) if visible(i, j)]
            if not cols:
                continue
            s = torch.stack([scale * (q[i, h] @ keys[j, h // group]) for j in cols])  # [n]
            m = s.max()
            p = torch.exp(s - m)
            lse[h, i] = m + torch.log(p.sum())
            out[i, h] = sum(p[c] * values[j, h // group] for c, j in enumerate(cols)) / p.sum()
    return out, lse


def packed(gen, lengths, heads, d, dtype=torch.float64):
    return torch.randn(sum(lengths), heads, d, generator=gen, dtype=torch.float64).to(dtype)


def cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_varlen_matches_row_loop(seed, causal, heads, kv_heads):
    gen = torch.Generator().manual_seed(seed)
    # Length 0 on either side, queries longer than keys (causal: leading rows see nothing).
    lens_q, lens_k = [3, 0, 5, 1, 4], [7, 2, 3, 0, 4]
    q = packed(gen, lens_q, heads, 8)  # [Tq, H, d]
    k = packed(gen, lens_k, kv_heads, 8)  # [Tk, Hkv, d]
    v = packed(gen, lens_k, kv_heads, 6)  # [Tk, Hkv, dv]
    out, lse = ref.attention_varlen(
        q, k, v, cu(lens_q), cu(lens_k), 5, 7, causal=causal, scale=0.3, return_lse=True
    )
    assert out.shape == (sum(lens_q), heads, 6) and lse.shape == (heads, sum(lens_q))
    sq, sk = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        exp_o, exp_l = loop_oracle(
            q[sq[b] : sq[b + 1]],
            k[sk[b] : sk[b + 1]],
            v[sk[b] : sk[b + 1]],
            lambda i, j, nq=nq, nk=nk: (not causal) or j <= i + nk - nq,
            0.3,
        )
        got_o, got_l = out[sq[b] : sq[b + 1]], lse[:, sq[b] : sq[b + 1]]
        msg = f"seed={seed} sequence {b} (nq={nq}, nk={nk})"
        assert torch.allclose(got_o, exp_o, atol=1e-12), msg
        assert torch.equal(torch.isinf(got_l), torch.isinf(exp_l)), msg
        fin = torch.isfinite(exp_l)
        assert torch.allclose(got_l[fin], exp_l[fin], atol=1e-12), msg


def test_varlen_gradients_equal_dense_batch(seed):
    """Equal lengths: the packed op is the dense op on [B, H, N, d], gradients included."""
    gen = torch.Generator().manual_seed(seed)
    b, n, heads, kv_heads, d = 3, 5, 4, 2, 8
    q = torch.randn(b * n, heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b * n, kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b * n, kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    seqs = cu([n] * b)
    out = ref.attention_varlen(q, k, v, seqs, seqs, n, n, causal=True)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)  # [Tq, H, d]
    got = torch.autograd.grad(out, (q, k, v), g)

    def dense(t):  # [B*N, heads, d] -> [B, heads, N, d]
        return t.reshape(b, n, t.shape[1], d).transpose(1, 2)

    dense_out, _ = ref.attention(dense(q), dense(k), dense(v), causal=True)
    want = torch.autograd.grad(dense_out, (q, k, v), dense(g))
    assert rel_err(out, dense_out.transpose(1, 2).reshape(b * n, heads, d)) < 1e-14
    for name, x, y in zip("qkv", got, want, strict=True):
        assert rel_err(x, y) < 1e-13, f"d{name} differs, seed={seed}"


def test_varlen_dtypes_and_uncovered_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    q = packed(gen, [3, 2], 2, 8, torch.bfloat16)  # 5 rows, only 4 covered
    k = packed(gen, [3, 2], 2, 8, torch.bfloat16)
    seqs_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    seqs_k = torch.tensor([0, 3, 5], dtype=torch.int32)
    out, lse = ref.attention_varlen(q, k, k, seqs_q, seqs_k, 2, 3, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.all(out[4] == 0) and torch.all(lse[:, 4] == -math.inf), "row past cu_seqlens_q"
    out64 = ref.attention_varlen(q, k, k, seqs_q, seqs_k, 2, 3, compute_dtype=torch.float64)
    assert out64.dtype == torch.float64
    assert rel_err(out[:4], out64[:4]) < 1e-2, f"seed={seed}"


def paged_case(gen, lens_q, lens_k, block_size, kv_heads, d, extra_blocks=3, share=True):
    """Packed keys of each sequence scattered into a shuffled paged cache.

    Returns (k_packed, v_packed, k_cache, v_cache, block_table, cu_k). When ``share``, sequence 1
    reuses sequence 0's first full block (a prefix-cache hit), so its packed keys copy them.
    """
    pages = [-(-n // block_size) for n in lens_k]
    num_blocks = sum(pages) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen, dtype=torch.float64)
    max_blocks = max(pages) + 1
    table = torch.full((len(lens_k), max_blocks), -7, dtype=torch.int32)  # unused entries: junk
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    if share and len(lens_k) > 1 and lens_k[0] >= block_size and lens_k[1] > block_size:
        table[1, 0] = table[0, 0]
    keys, values = [], []
    for b, n in enumerate(lens_k):
        pos = torch.arange(n)
        blocks = table[b, pos // block_size].long()
        keys.append(k_cache[blocks, pos % block_size])
        values.append(v_cache[blocks, pos % block_size])
    return torch.cat(keys), torch.cat(values), k_cache, v_cache, table, cu(lens_k)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_paged_equals_varlen_on_gathered_keys(seed, block_size, heads, kv_heads):
    gen = torch.Generator().manual_seed(seed)
    # decode (1 query), chunked prefill (several queries after a prefix), queries == keys
    lens_q = [1, 3, 1, 6, 2]
    lens_k = [block_size + 1, 2 * block_size + 3, 1, 6, max(block_size - 1, 2), block_size]
    lens_q.append(block_size)
    kp, vp, kc, vc, table, cu_k = paged_case(gen, lens_q, lens_k, block_size, kv_heads, 8)
    q = packed(gen, lens_q, heads, 8)  # [Tq, H, d]
    seqlens_k = torch.tensor(lens_k, dtype=torch.int32)
    args = (q, kc, vc, table, cu(lens_q), seqlens_k, max(lens_q), max(lens_k))
    for causal in (False, True):
        got = ref.attention_paged(*args, causal=causal, return_lse=True, validate=True)
        want = ref.attention_varlen(
            q, kp, vp, cu(lens_q), cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=True
        )
        for name, x, y in zip(("out", "lse"), got, want, strict=True):
            assert torch.equal(x, y), f"{name} differs (causal={causal}), seed={seed}"


PAGED_VARIANTS = [
    {"window": (3, 0)},  # sliding window smaller than the lengths, causal-like
    {"window": (100, 100)},  # larger than every length: no effect
    {"window": (2, 1)},  # right > 0: sees one key past the diagonal (non-causal calls only)
    {"window": (-1, 0)},
    {"softcap": 0.5},  # |s| up to ~8 / 0.5: saturated tanh
    {"alibi": "h"},
    {"alibi": "bh"},
    {"window": (4, 2), "softcap": 2.0, "alibi": "bh"},
]


@pytest.mark.parametrize("variant", PAGED_VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_paged_variants_equal_varlen_on_gathered_keys(seed, variant, heads, kv_heads):
    """window / softcap / alibi_slopes of the paged reference: the varlen reference (itself tested
    against the dense one and per-element loops in tests/test_variants_cpu.py) on the gathered keys,
    for decode, chunked prefill, nq > nk, an empty sequence and prefix sharing."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 4
    lens_q = [1, 3, 6, 0, 2, 5]
    lens_k = [block_size + 1, 2 * block_size + 3, 6, 3, 9, 3]  # the last: nq > nk
    kp, vp, kc, vc, table, cu_k = paged_case(gen, lens_q, lens_k, block_size, kv_heads, 8)
    q = 4 * packed(gen, lens_q, heads, 8)  # [Tq, H, d]; x4: logits large enough to saturate softcap
    seqlens_k = torch.tensor(lens_k, dtype=torch.int32)
    options = {k: v for k, v in variant.items() if k != "alibi"}
    if "alibi" in variant:
        shape = (heads,) if variant["alibi"] == "h" else (len(lens_q), heads)
        options["alibi_slopes"] = torch.rand(shape, generator=gen, dtype=torch.float64)
    for causal in (False, True):
        got = ref.attention_paged(q, kc, vc, table, cu(lens_q), seqlens_k, max(lens_q), max(lens_k), causal=causal,
                                  return_lse=True, **options)
        want = ref.attention_varlen(q, kp, vp, cu(lens_q), cu_k, max(lens_q), max(lens_k), causal=causal,
                                    return_lse=True, **options)
        for name, x, y in zip(("out", "lse"), got, want, strict=True):
            assert torch.allclose(x, y, atol=1e-12, rtol=1e-12) and torch.equal(x.isinf(), y.isinf()), (
                f"{name} differs ({variant}, causal={causal}): max {(x - y).nan_to_num().abs().max().item():.3e}, "
                f"seed={seed}")


def test_paged_variants_loop_oracle(seed):
    """One decode and one chunk against the independent row loop: window, softcap and ALiBi by
    their definitions (query i at key position i + nk - nq)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, bs, cap, left, right = 4, 2, 8, 4, 1.5, 5, 0
    lens_q, lens_k = [1, 4], [13, 10]
    _, _, kc, vc, table, _ = paged_case(gen, lens_q, lens_k, bs, kv_heads, d, share=False)
    q = 3 * packed(gen, lens_q, heads, d)
    slopes = torch.rand(len(lens_q), heads, generator=gen, dtype=torch.float64)
    out, lse = ref.attention_paged(q, kc, vc, table, cu(lens_q), torch.tensor(lens_k, dtype=torch.int32), 4, 13,
                                   causal=True, return_lse=True, window=(left, -1), softcap=cap, alibi_slopes=slopes)
    scale = 1 / math.sqrt(d)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        rows = slice(sum(lens_q[:b]), sum(lens_q[: b + 1]))
        pos = torch.arange(nk)
        blocks = table[b, pos // bs].long()
        keys, values = kc[blocks, pos % bs], vc[blocks, pos % bs]  # [nk, Hkv, d]
        group = heads // kv_heads
        for h in range(heads):
            for i in range(nq):
                p_i = i + nk - nq
                cols = [j for j in range(nk) if p_i - left <= j <= p_i + right]
                s = torch.stack([scale * (q[rows][i, h] @ keys[j, h // group]) for j in cols])
                s = cap * torch.tanh(s / cap) - slopes[b, h] * torch.tensor([abs(p_i - j) for j in cols])
                w = torch.softmax(s, 0)
                want = sum(w[c] * values[j, h // group] for c, j in enumerate(cols))
                assert torch.allclose(out[rows][i, h], want, atol=1e-12), f"b={b} h={h} i={i}, seed={seed}"
                assert abs(lse[h, rows][i] - torch.logsumexp(s, 0)) < 1e-12, f"lse b={b} h={h} i={i}, seed={seed}"


def test_paged_variant_argument_errors():
    q = torch.zeros(2, 4, 8)
    kc = torch.zeros(2, 4, 2, 8)
    args = (q, kc, kc, torch.zeros(2, 1, dtype=torch.int32), cu([1, 1]), torch.tensor([1, 1], dtype=torch.int32),
            1, 1)
    for options, match in (
        ({"window": (1,)}, "window must be None or a pair"),
        ({"window": (-2, 0)}, r"window\[0\] \(left\) must be an int >= -1"),
        ({"softcap": -1.0}, "softcap must be None, 0"),
        ({"alibi_slopes": torch.zeros(3)}, "alibi_slopes must have shape"),
        ({"alibi_slopes": [0.5] * 4}, "alibi_slopes must be None or a torch.Tensor"),
    ):
        with pytest.raises(ValueError, match=match):
            ref.attention_paged(*args, **options)


def test_paged_masks_unreadable_keys(seed):
    """Block ids outside [0, num_blocks) and positions past the table are masked, not read."""
    gen = torch.Generator().manual_seed(seed)
    bs, heads, d = 4, 2, 8
    kc = torch.randn(3, bs, 1, d, generator=gen, dtype=torch.float64)
    vc = torch.randn(3, bs, 1, d, generator=gen, dtype=torch.float64)
    table = torch.tensor([[2, -1, 0], [9, 1, 3]], dtype=torch.int32)  # -1, 9, 3 are out of range
    lens_q, lens_k = [2, 1], [14, 7]  # sequence 0 runs past its capacity 3 * 4 = 12
    q = packed(gen, lens_q, heads, d)
    args = (q, kc, vc, table, cu(lens_q), torch.tensor(lens_k, dtype=torch.int32), 2, 14)
    out, lse = ref.attention_paged(*args, return_lse=True)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        blocks = [int(table[b, j // bs]) if j // bs < 3 else -1 for j in range(nk)]
        readable = [0 <= blk < 3 for blk in blocks]
        keys = torch.stack([kc[max(blk, 0) % 3, j % bs] for j, blk in enumerate(blocks)])
        values = torch.stack([vc[max(blk, 0) % 3, j % bs] for j, blk in enumerate(blocks)])
        exp_o, exp_l = loop_oracle(
            q[sum(lens_q[:b]) : sum(lens_q[: b + 1])],
            keys,
            values,
            lambda i, j, nq=nq, nk=nk, r=readable: r[j] and j <= i + nk - nq,
            1 / math.sqrt(d),
        )
        rows = slice(sum(lens_q[:b]), sum(lens_q[: b + 1]))
        assert torch.allclose(out[rows], exp_o, atol=1e-12), f"sequence {b}, seed={seed}"
        assert torch.allclose(lse[:, rows], exp_l, atol=1e-12), f"sequence {b}, seed={seed}"
    with pytest.raises(ValueError, match="capacity 3 \\* 4"):
        ref.attention_paged(*args, validate=True)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"seqlens_k": [5, 40], "max_seqlen_k": 64}, "capacity 2 \\* 4"),
        ({"seqlens_k": [5, 2]}, r"seqlens_k\[1\] = 2 must be >= its query length 3"),
        ({"max_seqlen_k": 4}, "max_seqlen_k"),
        ({"table": [[0, 1], [2, 5]]}, r"block_table\[1, 1\] = 5"),
    ],
)
def test_paged_validate_contents(seed, change, match):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(4, 4, 1, 8, generator=gen)
    table = torch.tensor(change.get("table", [[0, 1], [2, 3]]), dtype=torch.int32)
    seqlens_k = torch.tensor(change.get("seqlens_k", [5, 7]), dtype=torch.int32)
    q = torch.randn(4, 2, 8, generator=gen)
    args = (q, kc, kc, table, cu([1, 3]), seqlens_k, 3, change.get("max_seqlen_k", 8))
    ref.attention_paged(*args)  # without validate the reference masks and returns
    with pytest.raises(ValueError, match=match):
        ref.attention_paged(*args, validate=True)


def test_paged_uncovered_rows_and_zero_keys():
    q = torch.ones(3, 2, 8, dtype=torch.float16)
    kc = torch.ones(2, 16, 2, 8, dtype=torch.float16)
    table = torch.zeros(2, 1, dtype=torch.int32)
    out, lse = ref.attention_paged(
        q, kc, kc, table, cu([1, 1]), torch.tensor([0, 1], dtype=torch.int32), 1, 1,
        return_lse=True,
    )  # fmt: skip
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert torch.all(out[0] == 0) and torch.all(lse[:, 0] == -math.inf), "0 keys"
    assert torch.all(out[1] == 1) and torch.all(lse[:, 1] == 8 / math.sqrt(8)), "1 key"
    assert torch.all(out[2] == 0) and torch.all(lse[:, 2] == -math.inf), "row past cu_seqlens_q"


def test_write_kv_cache_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, bs, kv_heads, d = 5, 4, 2, 8
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 19, 20, 0, 7, -5, 1000], dtype=torch.int64)  # 20, 1000: past end
    k = torch.randn(len(slots), kv_heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(len(slots), kv_heads, d, generator=gen).to(torch.bfloat16)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < num_blocks * bs:
            want_k[s // bs, s % bs], want_v[s // bs, s % bs] = k[t], v[t]
    for dtype in (torch.int64, torch.int32):
        kc, vc = k_cache.clone(), v_cache.clone()
        assert ref.write_kv_cache(k, v, kc, vc, slots.to(dtype)) is None
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"{dtype}, seed={seed}"


def test_write_then_read_is_a_decode_step(seed):
    """Writing a step's keys with write_kv_cache and attending equals attending dense keys."""
    gen = torch.Generator().manual_seed(seed)
    bs, heads, kv_heads, d, n = 4, 4, 2, 8, 10
    k = torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64)  # [N, Hkv, d]
    v = torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64)
    q = torch.randn(1, heads, d, generator=gen, dtype=torch.float64)  # the last token's query
    table = torch.tensor([[6, 1, 3]], dtype=torch.int32)
    slots = table[0, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs  # [N]
    kc = torch.zeros(8, bs, kv_heads, d, dtype=torch.float64)
    vc = torch.zeros(8, bs, kv_heads, d, dtype=torch.float64)
    ref.write_kv_cache(k, v, kc, vc, slots)
    out = ref.attention_paged(q, kc, vc, table, cu([1]), torch.tensor([n], dtype=torch.int32), 1, n)
    dense, _ = ref.attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True
    )
    assert rel_err(out, dense[0].transpose(0, 1)) < 1e-14, f"seed={seed}"


def test_argument_errors_name_the_argument():
    q = torch.zeros(2, 4, 8)
    kc = torch.zeros(3, 16, 2, 8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    seqs = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    good = {
        "q": q,
        "k_cache": kc,
        "v_cache": kc,
        "block_table": table,
        "cu_seqlens_q": seqs,
        "seqlens_k": lens,
    }
    cases = [
        ("q", torch.zeros(2, 4), "q must be rank-3"),
        ("k_cache", torch.zeros(3, 16, 3, 8), r"k_cache and v_cache must share"),
        ("v_cache", torch.zeros(3, 8, 2, 8), "k_cache and v_cache must share"),
        ("block_table", table.float(), "block_table must be an integer tensor"),
        (
            "cu_seqlens_q",
            torch.tensor([0, 1, 2], dtype=torch.int32),
            r"cu_seqlens_q must have B\+1",
        ),
        ("seqlens_k", torch.tensor([1, 2], dtype=torch.int32), "seqlens_k must have B = 1"),
        ("q", torch.zeros(2, 4, 8, dtype=torch.float64), "must share one dtype"),
        ("q", torch.zeros(2, 4, 8, dtype=torch.int32), "^q must have a floating dtype, got torch.int32"),
        ("seqlens_k", torch.tensor([2], dtype=torch.int32, device="meta"),
         "^q, caches, block_table, cu_seqlens_q, seqlens_k must be on one device"),
    ]
    for name, bad, match in cases:
        with pytest.raises(ValueError, match=match):
            ref.attention_paged(**{**good, name: bad}, max_seqlen_q=2, max_seqlen_k=2)
    kc0 = torch.zeros(3, 0, 2, 8)
    with pytest.raises(ValueError, match=r"^k_cache block_size \(dim 1\) must be >= 1"):
        ref.attention_paged(**{**good, "k_cache": kc0, "v_cache": kc0}, max_seqlen_q=2, max_seqlen_k=2)
    kc3 = torch.zeros(3, 16, 3, 8)
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide q heads \(4\)"):
        ref.attention_paged(
            **{**good, "k_cache": kc3, "v_cache": kc3}, max_seqlen_q=2, max_seqlen_k=2
        )
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence"):
        ref.attention_paged(**good, max_seqlen_q=1, max_seqlen_k=2)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease"):
        ref.attention_paged(
            **{**good, "cu_seqlens_q": seqs.flip(0)}, max_seqlen_q=2, max_seqlen_k=2
        )
    k = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k must have 2 entries"):
        ref.attention_varlen(q, k, k, seqs, torch.tensor([0, 1, 2]), 2, 2)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        ref.attention_varlen(q, k, k, seqs, seqs, 2, 1)
    with pytest.raises(ValueError, match="^cu_seqlens_k must be an integer tensor, got torch.float32"):
        ref.attention_varlen(q, k, k, seqs, seqs.float(), 2, 2)
    with pytest.raises(ValueError, match="slot_mapping must be an integer tensor"):
        ref.write_kv_cache(k, k, kc, kc, torch.zeros(2))
    # flags by value, as the CUDA ops read them: causal="false" is no False
    for flag, value in (("causal", "false"), ("return_lse", 1), ("deterministic", None)):
        with pytest.raises(ValueError, match=f"^{flag} must be a bool"):
            ref.attention_varlen(q, k, k, seqs, seqs, 2, 2, **{flag: value})
    for flag, value in (("causal", "false"), ("return_lse", []), ("validate", "yes")):
        with pytest.raises(ValueError, match=f"^{flag} must be a bool"):
            ref.attention_paged(**good, max_seqlen_q=2, max_seqlen_k=2, **{flag: value})
    dense = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="^causal must be a bool"):
        ref.attention(dense, dense, dense, causal="false")
    with pytest.raises(ValueError, match="^dropout_p must be a number"):  # falsy, but no number: not taken as off
        ref.attention(dense, dense, dense, dropout_p="")
    with pytest.raises(ValueError, match="k .* must be \\[T, Hkv, dim\\] matching k_cache"):
        ref.write_kv_cache(torch.zeros(2, 2, 4), k, kc, kc, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(
    "cu_q,max_seqlen_q,match",
    [
        ([1, 2, 4], 3, "^cu_seqlens_q must start at 0, got 1"),
        ([0, 3, 1], 3, r"^cu_seqlens_q decreases at sequence 1: 3 -> 1"),
        ([0, 1, 4], 2, "^sequence 1 has 3 queries, more than max_seqlen_q = 2"),
    ],
)
def test_paged_contents_checks_of_the_query_offsets(cu_q, max_seqlen_q, match):
    """check_paged_contents is what attention_paged(validate=True) runs on CUDA after the metadata
    checks (which the reference's own path meets first, so it is called directly here)."""
    k_cache = torch.zeros(4, 4, 1, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seqlens_k = torch.tensor([5, 7], dtype=torch.int32)
    ref.check_paged_contents(k_cache, table, cu([1, 3]), seqlens_k, 3, 8)  # the valid call passes
    with pytest.raises(ValueError, match=match):
        ref.check_paged_contents(k_cache, table, torch.tensor(cu_q, dtype=torch.int32), seqlens_k, max_seqlen_q, 8)
