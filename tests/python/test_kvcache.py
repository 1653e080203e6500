"""flash_attn_with_kvcache / flashattn.forward_kvcache on numpy arrays (the CPU backend) against an
oracle built here: the test's own map of cache positions (pages, leftpad, batch_idx), the rotary
embedding in the API's stated float32 arithmetic, every sequence gathered into dense K / V for
reference.py's float64 attention. Positions no call may read hold NaN; after the call every cache
element is checked."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashattn
import reference as ref
from tolerance import atol_for, check_close, max_abs

BF16 = ml_dtypes.bfloat16


def rotary_tables(rows, rotary_dim, dtype):
    pos = np.arange(rows)[:, None]
    inv = 10000.0 ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    return np.cos(pos * inv).astype(dtype), np.sin(pos * inv).astype(dtype)


def rotate(x, cos, sin, positions, interleaved):
    """x [..., n, d] rotated row by row to positions [n] in the arithmetic the API states (float32,
    float64 for float64 arrays; each product rounded, no fused multiply-add), rounded to x.dtype:
    the bits every backend must store."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = x.astype(acc)
    half = cos.shape[1]
    c, s = cos[positions].astype(acc), sin[positions].astype(acc)
    a = np.arange(half) * 2 if interleaved else np.arange(half)
    b = a + 1 if interleaved else a + half
    x1, x2 = y[..., a].copy(), y[..., b].copy()
    y[..., a] = x1 * c - x2 * s
    y[..., b] = x1 * s + x2 * c
    return y.astype(x.dtype)


class Cache:
    """A paged (page_size > 0) or contiguous cache and the test's map of it."""

    def __init__(self, rng, batch, capacity, heads_kv, d, dtype, seqlens, leftpad, page_size):
        self.page_size = page_size
        self.seqlens, self.leftpad = seqlens, leftpad
        if page_size:
            pages = -(-capacity // page_size)
            self.capacity = pages * page_size
            self.table = np.full((batch, pages), -1, np.int32)
            slots = [(b, p) for b in range(batch)
                     for p in range(leftpad[b] // page_size, -(-(seqlens[b] + 1) // page_size))]
            blocks = rng.permutation(len(slots) + 2)
            for (b, p), blk in zip(slots, blocks):
                self.table[b, p] = blk
            shape = (len(slots) + 2, page_size, heads_kv, d)
        else:
            self.capacity = capacity
            self.table = None
            shape = (batch, capacity, heads_kv, d)
        self.k = np.full(shape, np.nan, dtype)
        self.v = np.full(shape, np.nan, dtype)
        for b in range(batch):
            for pos in range(leftpad[b], seqlens[b]):
                self.k[self.at(b, pos)] = rng.standard_normal((heads_kv, d)).astype(dtype)
                self.v[self.at(b, pos)] = rng.standard_normal((heads_kv, d)).astype(dtype)

    def at(self, b, pos):
        if self.page_size:
            return self.table[b, pos // self.page_size], pos % self.page_size
        return b, pos


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
@pytest.mark.parametrize("interleaved", [True, False])
def test_decode_append_rotary_matches_oracle(rng, dtype, page_size, interleaved):
    batch, hq, hkv, d, rotary_dim, capacity = 3, 6, 2, 64, 32, 200
    seqlens = np.array([0, capacity - 1, rng.integers(0, capacity - 1)], np.int32)
    leftpad = np.array([0, rng.integers(0, seqlens[1] + 1), rng.integers(0, seqlens[2] + 1)], np.int32)
    cache = Cache(rng, batch, capacity, hkv, d, dtype, seqlens, leftpad, page_size)
    q = rng.standard_normal((batch, 1, hq, d)).astype(dtype)
    k_new = rng.standard_normal((batch, 1, hkv, d)).astype(dtype)
    v_new = rng.standard_normal((batch, 1, hkv, d)).astype(dtype)
    cos, sin = rotary_tables(cache.capacity + 1, rotary_dim, dtype)
    k_before, v_before = cache.k.copy(), cache.v.copy()

    out, lse = flashattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_leftpad=leftpad, block_table=cache.table, causal=True, rotary_interleaved=interleaved,
        return_softmax_lse=True)

    # The cache: only the appended rows changed, to the rotated keys and the values.
    k_exp, v_exp = k_before.copy(), v_before.copy()
    for b in range(batch):
        k_exp[cache.at(b, seqlens[b])] = rotate(k_new[b, 0][None], cos, sin, [seqlens[b]], interleaved)[0]
        v_exp[cache.at(b, seqlens[b])] = v_new[b, 0]
    np.testing.assert_array_equal(cache.v.astype(np.float64), v_exp.astype(np.float64))  # NaN == NaN
    np.testing.assert_array_equal(cache.k.astype(np.float64), k_exp.astype(np.float64))

    for b in range(batch):
        rows = [cache.at(b, pos) for pos in range(leftpad[b], seqlens[b] + 1)]
        kb = np.stack([k_exp[r] for r in rows])[None]
        vb = np.stack([v_exp[r] for r in rows])[None]
        qb = rotate(q[b:b + 1], cos, sin, [seqlens[b]], interleaved)
        ref_out, ref_lse = ref.forward(qb, kb, vb, causal=True)
        naive_out, naive_lse = ref.naive_forward(qb, kb, vb, causal=True)
        check_close("out", out[b:b + 1], ref_out, naive_out, 2.0, atol_for(dtype, max_abs(ref_out)))
        check_close("lse", lse[b:b + 1], ref_lse, naive_lse, 2.0, 1e-5 * max_abs(ref_lse))


def test_without_append_int_seqlens_and_batch_idx(rng):
    batch, hq, hkv, d, capacity = 2, 4, 4, 32, 50
    k_cache = rng.standard_normal((4, capacity, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((4, capacity, hkv, d)).astype(np.float32)
    q = rng.standard_normal((batch, 3, hq, d)).astype(np.float32)
    batch_idx = np.array([3, 1], np.int32)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, cache_batch_idx=batch_idx,
                                            softcap=30.0, window_size=(8, 0))
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    for b in range(batch):
        kb, vb = k_cache[batch_idx[b], None, :20], v_cache[batch_idx[b], None, :20]
        ref_out, _ = ref.forward(q[b:b + 1], kb, vb, softcap=30.0, window_size=(8, 0))
        check_close("out", out[b:b + 1], ref_out, None, 2.0, 1e-5 * max_abs(ref_out))


def test_errors_name_the_argument_and_leave_the_cache(rng):
    k_cache = rng.standard_normal((4, 16, 2, 32)).astype(np.float32)
    v_cache = k_cache.copy()
    q = rng.standard_normal((2, 1, 2, 32)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 2, 32)).astype(np.float32)
    table = np.array([[0, 1], [2, 9]], np.int32)
    before = k_cache.copy()
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 1\] is 9, outside \[0, 4\)"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=np.array([3, 20], np.int32),
                                          block_table=table)
    np.testing.assert_array_equal(k_cache, before)
    # Host arrays are checked on the host whatever index_check asks.
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 1\] is 9"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=np.array([3, 20], np.int32),
                                          block_table=table, index_check="device")
    np.testing.assert_array_equal(k_cache, before)
    with pytest.raises(ValueError, match='index_check: \'gpu\' is neither "host" nor "device"'):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, index_check="gpu")
    with pytest.raises(ValueError, match="cache_seqlens: required with k_new"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, block_table=table)
    with pytest.raises(TypeError, match="cache_seqlens: dtype float32 must be int32"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="num_splits: -2 must be >= 0"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=-2)


def test_varlen_block_table_equals_packed_keys(rng):
    """flash_attn_varlen_func with block_table (k / v in shuffled pages) gives the packed call's bits."""
    hq, hkv, d, page = 4, 2, 32, 8
    lens_q, lens_k = [3, 1, 6], [20, 0, 13]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float16)
    pages = [-(-n // page) for n in lens_k]
    blocks = rng.permutation(sum(pages) + 1)
    table = np.full((3, max(pages)), -1, np.int32)
    k_pages = np.full((len(blocks), page, hkv, d), np.nan, np.float16)
    v_pages = k_pages.copy()
    used = 0
    for b, n in enumerate(lens_k):
        table[b, :pages[b]] = blocks[used:used + pages[b]]
        used += pages[b]
        for j in range(n):
            k_pages[table[b, j // page], j % page] = k[cu_k[b] + j]
            v_pages[table[b, j // page], j % page] = v[cu_k[b] + j]
    packed = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 20, causal=True)
    paged = flashattn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 20, causal=True, block_table=table)
    np.testing.assert_array_equal(paged.astype(np.float64), packed.astype(np.float64))
