"""FP8 inputs (float8_e4m3fn, float8_e5m2) on the CPU backend through Python: numpy arrays of
ml_dtypes' FP8 types and PyTorch CPU tensors, flashattn.forward, flash_attn_func,
flash_attn_varlen_func and flash_attn_with_kvcache, judged by the FP8 tolerance rule
(docs/CONVENTIONS.md) against the float64 reference of the dequantised inputs; an FP8 KV cache's
quantise-on-append against ml_dtypes' rounding; bad arguments raise, naming them, and write
nothing."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashattn
import reference as ref
from tolerance import atol_for, check_close, max_abs

BF16 = ml_dtypes.bfloat16
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_inputs(rng, kind, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(FP8[kind])


def descales(rng, batch, heads_kv):
    return rng.uniform(0.25, 4.0, (batch, heads_kv)).astype(np.float32)


def dequantised(x, factors, heads_kv, cu_seqlens=None):
    """x's values times the factor of each element's (batch entry, KV head): [b, s, h, d] dense,
    [total, h, d] varlen (rows of sequence b from cu_seqlens)."""
    x = x.astype(np.float64)
    group = x.shape[-2] // heads_kv
    per_head = np.repeat(factors.astype(np.float64), group, axis=1)  # [b, h]
    if cu_seqlens is None:
        return x * per_head[:, None, :, None]
    out = x.copy()
    for b in range(len(cu_seqlens) - 1):
        out[cu_seqlens[b]:cu_seqlens[b + 1]] *= per_head[b][None, :, None]
    return out


def check_fp8_forward(out, lse, q, k, v, qs, ks, vs, kind, out_dtype, cu=None, **opts):
    hkv = k.shape[-2]
    cu_q, cu_k = (None, None) if cu is None else cu
    qd, kd, vd = dequantised(q, qs, hkv, cu_q), dequantised(k, ks, hkv, cu_k), dequantised(v, vs, hkv, cu_k)
    if cu is not None:
        opts = dict(opts, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    exact_out, exact_lse = ref.forward(qd, kd, vd, **opts)
    naive_out, naive_lse = ref.naive_forward_float8(qd, kd, vd, FP8[kind], out_dtype, **opts)
    assert out.dtype == out_dtype
    check_close("out", out, exact_out, naive_out, 2.0, atol_for(out_dtype, max_abs(exact_out)))
    check_close("lse", lse, exact_lse, naive_lse, 2.0, atol_for(np.float32, max(1.0, max_abs(exact_lse))))
    err = np.abs(out.astype(np.float64) - exact_out).max()
    naive_err = np.abs(naive_out.astype(np.float64) - exact_out).max()
    return err / max(naive_err, 1e-300)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(19, 3), softcap=15.0), dict()])
def test_numpy_forward(rng, kind, opts):
    b, sq, sk, hq, hkv, d = 2, 37, 53, 6, 2, 40
    q, k, v = (fp8_inputs(rng, kind, (b, s, h, d)) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    qs, ks, vs = (descales(rng, b, hkv) for _ in range(3))
    out, lse = flashattn.forward(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, **opts)
    ratio = check_fp8_forward(out, lse, q, k, v, qs, ks, vs, kind, BF16, **opts)
    assert ratio <= 2.0
    # float16 out when the caller gives one; the same call otherwise.
    out16 = np.full(out.shape, np.nan, np.float16)
    flashattn.forward(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, out=out16, **opts)
    check_fp8_forward(out16, lse, q, k, v, qs, ks, vs, kind, np.float16, **opts)


def test_numpy_varlen_alibi(rng):
    lens_q, lens_k = [5, 0, 23], [11, 4, 30]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    hq, hkv, d = 4, 1, 24
    q = fp8_inputs(rng, "e4m3", (cu_q[-1], hq, d))
    k, v = (fp8_inputs(rng, "e4m3", (cu_k[-1], hkv, d)) for _ in range(2))
    qs, ks, vs = (descales(rng, 3, hkv) for _ in range(3))
    slopes = rng.uniform(0, 0.3, hq).astype(np.float32)
    out, lse = flashattn.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                 max_seqlen_k=max(lens_k), causal=True, alibi_slopes=slopes, q_descale=qs,
                                 k_descale=ks, v_descale=vs)
    check_fp8_forward(out, lse, q, k, v, qs, ks, vs, "e4m3", BF16, cu=(cu_q, cu_k), causal=True,
                      alibi_slopes=slopes)


def test_absent_descale_is_one(rng):
    q, k, v = (fp8_inputs(rng, "e5m2", (1, 9, 2, 16)) for _ in range(3))
    ones = np.ones((1, 2), np.float32)
    a, lse_a = flashattn.forward(q, k, v)
    b, lse_b = flashattn.forward(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)) and np.array_equal(lse_a, lse_b)


def test_packed_functions_take_descales(rng):
    """The packed flash_attn_* functions pass the descale factors on: each equals the unpacked
    call on the same (strided) views bit for bit, and a descale changes the result."""
    b, s, h, d = 2, 19, 2, 16
    qkv = fp8_inputs(rng, "e4m3", (b, s, 3, h, d))
    qs, ks, vs = (descales(rng, b, h) for _ in range(3))
    fp8 = dict(q_descale=qs, k_descale=ks, v_descale=vs)
    bits = lambda x: x.view(np.uint16)  # noqa: E731
    want = flashattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, **fp8)
    assert np.array_equal(bits(flashattn.flash_attn_qkvpacked_func(qkv, causal=True, **fp8)), bits(want))
    assert np.array_equal(bits(flashattn.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, **fp8)),
                          bits(want))
    assert not np.array_equal(bits(flashattn.flash_attn_qkvpacked_func(qkv, causal=True)), bits(want))

    cu = np.array([0, 7, 7, 19], np.int32)
    packed = fp8_inputs(rng, "e5m2", (19, 3, h, d))
    qs, ks, vs = (descales(rng, 3, h) for _ in range(3))
    fp8 = dict(q_descale=qs, k_descale=ks, v_descale=vs)
    want = flashattn.flash_attn_varlen_func(packed[:, 0], packed[:, 1], packed[:, 2], cu, cu, 12, 12, **fp8)
    got = flashattn.flash_attn_varlen_qkvpacked_func(packed, cu, 12, **fp8)
    assert np.array_equal(bits(got), bits(want))
    got = flashattn.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 12, 12, **fp8)
    assert np.array_equal(bits(got), bits(want))


def round_fp8(x, kind):
    """The rule's rounding of x (float32): to nearest even, magnitudes past the largest finite
    value saturating to it (ml_dtypes' conversion itself rounds to nearest even)."""
    return np.clip(x.astype(np.float32), -FP8_MAX[kind], FP8_MAX[kind]).astype(FP8[kind])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [0, 8])
def test_numpy_fp8_cache(rng, kind, page_size):
    batch, cap, hq, hkv, d, new = 3, 32, 6, 2, 32, 2
    blocks = batch * cap // page_size if page_size else batch
    rows = page_size or cap
    k_cache, v_cache = (fp8_inputs(rng, kind, (blocks, rows, hkv, d), 2.0) for _ in range(2))
    table = rng.permutation(blocks).astype(np.int32).reshape(batch, -1) if page_size else None
    seqlens = np.array([0, 7, 30], np.int32)
    q = rng.standard_normal((batch, 1, hq, d)).astype(BF16)
    k_new, v_new = (rng.standard_normal((batch, new, hkv, d)).astype(BF16) * BF16(4) for _ in range(2))
    k_new[0, 0, 0, 0] = 1e4  # saturates (e4m3)
    ks = rng.choice([0.5, 0.75, 1.5, 2.0], (batch, hkv)).astype(np.float32)
    vs = rng.choice([0.5, 0.75, 1.5, 2.0], (batch, hkv)).astype(np.float32)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                 block_table=table, return_softmax_lse=True, k_descale=ks,
                                                 v_descale=vs)

    def row(b, pos):  # (block, row in block) of sequence b's position pos
        return (table[b, pos // page_size], pos % page_size) if page_size else (b, pos)

    appended = np.zeros((blocks, rows), bool)
    for b in range(batch):
        for t in range(new):
            blk, r = row(b, seqlens[b] + t)
            appended[blk, r] = True
            for cache, src, s in ((k_cache, k_new, ks), (v_cache, v_new, vs)):
                want = round_fp8(src[b, t].astype(np.float32) / s[b][:, None], kind)
                assert np.array_equal(cache[blk, r].view(np.uint8), want.view(np.uint8)), (b, t)
    for cache, before in ((k_cache, k_before), (v_cache, v_before)):
        assert np.array_equal(cache[~appended].view(np.uint8), before[~appended].view(np.uint8))
    # Attention: the dense float64 reference on each sequence's dequantised cache.
    for b in range(batch):
        n = seqlens[b] + new
        where = [row(b, j) for j in range(n)]
        kd = np.stack([k_cache[blk, r] for blk, r in where]).astype(np.float64) * ks[b][None, :, None]
        vd = np.stack([v_cache[blk, r] for blk, r in where]).astype(np.float64) * vs[b][None, :, None]
        exact_out, exact_lse = ref.forward(q[b:b + 1].astype(np.float64), kd[None], vd[None])
        naive_out, naive_lse = ref.naive_forward_float8(q[b:b + 1], kd[None], vd[None], FP8[kind], BF16)
        check_close("out", out[b:b + 1], exact_out, naive_out, 2.0, atol_for(BF16, max_abs(exact_out)))
        check_close("lse", lse[b:b + 1], exact_lse, naive_lse, 2.0, atol_for(np.float32, max(1.0, max_abs(exact_lse))))


def test_numpy_errors_write_nothing(rng):
    q, k, v = (fp8_inputs(rng, "e4m3", (2, 5, 2, 16)) for _ in range(3))
    good = np.ones((2, 2), np.float32)
    out = np.full((2, 5, 2, 16), np.nan, np.float32).astype(BF16)
    lse = np.full((2, 2, 5), np.nan, np.float32)

    def call(**kw):
        args = dict(q=q, k=k, v=v, q_descale=good, k_descale=good, v_descale=good, out=out, lse=lse)
        args.update(kw)
        flashattn.forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    cases = [
        (TypeError, "q_descale: dtype float64 must be float32", dict(q_descale=good.astype(np.float64))),
        (ValueError, "k_descale: heads 3 != heads_kv 2", dict(k_descale=np.ones((2, 3), np.float32))),
        (ValueError, "v_descale: batch 1 != batch 2", dict(v_descale=np.ones((1, 2), np.float32))),
        (TypeError, "out: dtype float8_e4m3fn with q float8_e4m3fn", dict(out=out.astype(FP8["e4m3"]))),
        (TypeError, "k: dtype bfloat16 != q dtype float8_e4m3fn", dict(k=k.astype(BF16))),
        (ValueError, "q_descale: given for q of dtype bfloat16",
         dict(q=q.astype(BF16), k=k.astype(BF16), v=v.astype(BF16))),
    ]
    for error, message, kw in cases:
        with pytest.raises(error, match=message):
            call(**kw)
        assert np.isnan(out.astype(np.float32)).all() and np.isnan(lse).all(), message
    dout = np.zeros((2, 5, 2, 16), BF16)
    with pytest.raises(NotImplementedError, match="the backward pass does not take float8 inputs yet"):
        flashattn.backward(dout, q, k, v, out, lse)


# ---------------------------------------------------------------------------------------------
# PyTorch CPU tensors
# ---------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def test_torch_flash_attn_func_matches_numpy(rng):
    b, s, hq, hkv, d = 2, 29, 4, 2, 32
    qn, kn, vn = (fp8_inputs(rng, "e4m3", (b, s, h, d)) for h in (hq, hkv, hkv))
    qs, ks, vs = (descales(rng, b, hkv) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn) for x in (qn, kn, vn))
    tqs, tks, tvs = (torch.from_numpy(x) for x in (qs, ks, vs))
    out, lse, _ = flashattn.flash_attn_func(tq, tk, tv, causal=True, return_attn_probs=True, q_descale=tqs,
                                            k_descale=tks, v_descale=tvs)
    assert out.dtype == torch.bfloat16 and out.shape == (b, s, hq, d)
    nout, nlse = flashattn.forward(qn, kn, vn, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert np.array_equal(out.view(torch.int16).numpy(), nout.view(np.int16))
    assert np.array_equal(lse.numpy(), nlse)
    check_fp8_forward(nout, nlse, qn, kn, vn, qs, ks, vs, "e4m3", BF16, causal=True)


def test_torch_compile_fullgraph(rng):
    """FP8 tensors and their descale factors through the custom op under torch.compile
    (fullgraph: no graph break), equal to the eager call bit for bit; the fake gives the
    bfloat16 out."""
    b, s, hq, hkv, d = 2, 21, 4, 2, 32
    q, k, v = (torch.randn(b, s, h, d).to(torch.float8_e4m3fn) for h in (hq, hkv, hkv))
    qs, ks, vs = (torch.from_numpy(descales(rng, b, hkv)) for _ in range(3))

    def block(q, k, v, qs, ks, vs):
        out = flashattn.flash_attn_func(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
        return out.float().sum(dim=-1)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, qs, ks, vs), block(q, k, v, qs, ks, vs)
    assert torch.equal(got, want)
    from flashattn import torch as fa_torch

    out, lse = fa_torch.attention_with_lse(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out.float().sum(dim=-1), want)


def test_torch_varlen(rng):
    cu = np.array([0, 7, 7, 20], np.int32)
    q, k, v = (fp8_inputs(rng, "e5m2", (20, h, 16)) for h in (4, 4, 4))
    qs, ks, vs = (descales(rng, 3, 4) for _ in range(3))
    as_torch = lambda x: torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e5m2)  # noqa: E731
    out = flashattn.flash_attn_varlen_func(as_torch(q), as_torch(k), as_torch(v), torch.from_numpy(cu),
                                           torch.from_numpy(cu), 13, 13, q_descale=torch.from_numpy(qs),
                                           k_descale=torch.from_numpy(ks), v_descale=torch.from_numpy(vs))
    nout, _ = flashattn.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13,
                                q_descale=qs, k_descale=ks, v_descale=vs)
    assert np.array_equal(out.view(torch.int16).numpy(), nout.view(np.int16))


def test_torch_fp8_cache_append(rng):
    batch, cap, hq, hkv, d = 2, 16, 4, 2, 16
    k_cache = torch.zeros(batch, cap, hkv, d, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(batch, cap, hkv, d, dtype=torch.float8_e4m3fn)
    q = torch.randn(batch, 1, hq, d, dtype=torch.float16)
    k_new = torch.randn(batch, 1, hkv, d, dtype=torch.float16) * 300
    v_new = torch.randn(batch, 1, hkv, d, dtype=torch.float16)
    ks = torch.tensor([[0.5, 1.5], [2.0, 0.75]])
    vs = torch.tensor([[1.0, 1.25], [0.5, 3.0]])
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                            k_descale=ks, v_descale=vs)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    for b in range(batch):
        pos = int(seqlens[b])
        want = round_fp8(k_new[b, 0].float().numpy() / ks[b].numpy()[:, None], "e4m3")
        assert np.array_equal(k_cache[b, pos].view(torch.uint8).numpy(), want.view(np.uint8))
        others = torch.ones(cap, dtype=torch.bool)
        others[pos] = False
        assert (k_cache[b, others].view(torch.uint8) == 0).all() and (v_cache[b, others].view(torch.uint8) == 0).all()


def test_torch_errors(rng):
    q = torch.randn(1, 4, 2, 16).to(torch.float8_e4m3fn)
    k16 = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k: dtype bfloat16 != q dtype float8_e4m3fn"):
        flashattn.flash_attn_func(q, k16, k16)
    with pytest.raises(TypeError, match="k_descale: dtype float16 must be float32"):
        flashattn.flash_attn_func(q, q, q, k_descale=torch.ones(1, 2, dtype=torch.float16))
    cache = torch.zeros(1, 8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="forward_kvcache takes bfloat16 or float16 queries"):
        flashattn.flash_attn_with_kvcache(q, cache, cache)
