"""What flash_attn 2.8 accepts and flashattn must too: head dims that are not a multiple of 8 on
CUDA (zero-padded in the Python layer; the padded path is forced on the CPU here), inputs whose
last dimension is strided (copied), index arrays of the wrong dtype (a TypeError naming the
argument and dtype), and flash_attn's signatures.

The CPU backend takes every head_dim, so on the CPU the padded path runs only where a test forces
it (ops.head_dim_padding with always=True); the CUDA tests run it for real where a GPU is present."""
from __future__ import annotations

import functools
import inspect

import ml_dtypes
import numpy as np
import pytest

import flashattn
import reference as ref
from flashattn import ops
from flashattn._arrays import Framework
from test_kvcache import rotary_tables, rotate
from test_numpy import cu_seqlens, dense_inputs, randn, run_and_check
from tolerance import atol_for, check_close, max_abs

BF16 = ml_dtypes.bfloat16


def force_padding(monkeypatch):
    """Pads head dims that are not a multiple of 8 on the CPU too, from now on; returns the list
    of widths pad_last is asked for (so a test can tell that the padded path ran)."""
    monkeypatch.setattr(ops, "head_dim_padding", functools.partial(ops.head_dim_padding, always=True))
    widths = []
    pad_last = Framework.pad_last

    def spy(self, a, n):
        widths.append(a.shape[-1] + n)
        return pad_last(self, a, n)

    monkeypatch.setattr(Framework, "pad_last", spy)
    return widths


@pytest.fixture
def forced_padding(monkeypatch):
    return force_padding(monkeypatch)


# ----------------------------------------------------------------------------- head_dim padding

def test_head_dim_padding_decision(rng):
    fw = Framework()
    a5, a8, a6 = (np.zeros((1, 2, 1, d), np.float16) for d in (5, 8, 6))
    assert ops.head_dim_padding(fw, a5, a5) == 0  # CPU arrays: any head_dim
    assert ops.head_dim_padding(fw, a5, a5, None, always=True) == 3
    assert ops.head_dim_padding(fw, a8, a8, always=True) == 0
    assert ops.head_dim_padding(fw, a5, a6, always=True) == 0  # mismatch: the library reports it
    assert ops.head_dim_padding(fw, np.zeros((1, 1, 1, 257)), always=True) == 0
    assert ops.head_dim_padding(fw, np.zeros((1, 1, 1, 250)), always=True) == 6


def test_head_dim_pair_left_unpadded_where_cuda_would_refuse_it():
    """The CUDA kernels take equal head dims only: a (q / k, v) pair that padding leaves unequal
    is not padded, so the refusal names the dims the caller gave; one that padding makes equal
    runs padded. (A framework that calls every array a CUDA one stands in for a GPU.)"""
    class OnCuda(Framework):
        def on_cuda(self, like) -> bool:
            return True

    cuda, cpu = OnCuda(), Framework()
    q100, v100, v104, v60, v64 = (np.zeros((1, 2, 1, d), np.float16) for d in (100, 100, 104, 60, 64))
    assert ops.head_dim_paddings(cuda, q100, q100, v100) == (4, 4)
    assert ops.head_dim_paddings(cuda, q100, q100, v104) == (4, 0)  # 104 and 104: runs
    assert ops.head_dim_paddings(cuda, q100, q100, v60) == (0, 0)  # 104 and 64: refused as 100 and 60
    assert ops.head_dim_paddings(cuda, q100, q100, v64, v64) == (0, 0)
    assert ops.head_dim_paddings(cpu, q100, q100, v60) == (0, 0)  # CPU arrays: any head_dim


@pytest.mark.parametrize("d", [1, 5, 33, 59, 100, 111, 250])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_padded_equals_unpadded_numpy(rng, forced_padding, d, dtype):
    # GQA, a window and softcap; the default softmax_scale must stay 1 / sqrt(d), not the padded one.
    q, k, v, dout = dense_inputs(rng, 2, 37, 71, 4, 2, d, dtype)
    run_and_check(q, k, v, dout, window_size=(30, 5), softcap=20.0)
    assert forced_padding and all(w % 8 == 0 and w - d < 8 for w in forced_padding)


def test_padded_varlen_and_given_outputs(rng, forced_padding):
    lens_q, lens_k = np.array([5, 0, 40]), np.array([17, 3, 40])
    opts = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), causal=True)
    q, dout = (randn(rng, (int(lens_q.sum()), 4, 13), np.float16) for _ in range(2))
    k, v = (randn(rng, (int(lens_k.sum()), 1, 13), np.float16) for _ in range(2))
    out, lse, dq, dk, dv = run_and_check(q, k, v, dout, **opts)
    # Arrays the caller gives receive the cut-back results.
    given = [np.full(a.shape, np.nan, a.dtype) for a in (out, dq, dk, dv)]
    got_out, _ = flashattn.forward(q, k, v, out=given[0], **opts)
    grads = flashattn.backward(dout, q, k, v, out, lse, dq=given[1], dk=given[2], dv=given[3], **opts)
    assert got_out is given[0] and all(g is h for g, h in zip(grads, given[1:]))
    for ours, theirs in zip(given, (out, dq, dk, dv)):
        np.testing.assert_array_equal(ours, theirs)
    assert forced_padding


@pytest.mark.parametrize("paged", [False, True])
def test_padded_kvcache_updates_the_callers_cache(rng, monkeypatch, paged):
    """The padded call appends to the caller's (unpadded) caches the bits an unpadded call
    writes, rotary included, and attends like the reference."""
    batch, hq, hkv, d, capacity, page = 2, 4, 2, 36, 48, 16
    seqlens = np.array([0, 30], np.int32)
    shape = (batch * capacity // page, page, hkv, d) if paged else (batch, capacity, hkv, d)
    k_cache, v_cache = (randn(rng, shape, np.float16) for _ in range(2))
    table = rng.permutation(shape[0]).astype(np.int32).reshape(batch, -1) if paged else None
    q = randn(rng, (batch, 1, hq, d), np.float16)
    k_new, v_new = (randn(rng, (batch, 1, hkv, d), np.float16) for _ in range(2))
    cos, sin = rotary_tables(capacity, 16, np.float16)
    opts = dict(cache_seqlens=seqlens, block_table=table, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False,
                causal=True)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    flashattn.forward_kvcache(q, expected_k, expected_v, k_new, v_new, **opts)  # unpadded: the expected caches
    forced_padding = force_padding(monkeypatch)
    out, lse = flashattn.forward_kvcache(q, k_cache, v_cache, k_new, v_new, **opts)
    assert forced_padding and out.shape == q.shape
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)

    def rows(cache, b, n):  # sequence b's first n keys, dense
        if not paged:
            return cache[b:b + 1, :n]
        return np.concatenate([cache[blk] for blk in table[b]])[None, :n]

    for b in range(batch):
        n = seqlens[b] + 1
        qb = rotate(q[b:b + 1], cos, sin, [seqlens[b]], False)
        kb, vb = rows(k_cache, b, n), rows(v_cache, b, n)
        ref_out, ref_lse = ref.forward(qb, kb, vb, causal=True)
        naive_out, naive_lse = ref.naive_forward(qb, kb, vb, causal=True)
        check_close("out", out[b:b + 1], ref_out, naive_out, 2.0, atol_for(np.float16, max_abs(ref_out)))
        check_close("lse", lse[b:b + 1], ref_lse, naive_lse, 2.0, 1e-5 * max_abs(ref_lse))


def test_padded_rotary_wider_than_head_dim_is_refused(rng, forced_padding):
    # rotary_dim 6 > head_dim 5 must not become valid by padding to 8.
    cache = randn(rng, (1, 8, 1, 5), np.float16)
    new = randn(rng, (1, 1, 1, 5), np.float16)
    cos, sin = rotary_tables(9, 6, np.float16)
    with pytest.raises(ValueError, match="rotary_dim"):
        flashattn.forward_kvcache(new, cache, cache.copy(), new, new, cache_seqlens=2, rotary_cos=cos, rotary_sin=sin)


# ----------------------------------------------------------------------------- strided last dimension

@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_strided_head_dim_inputs_are_copied(rng, dtype):
    q, k, v, dout = dense_inputs(rng, 2, 33, 50, 4, 2, 32, dtype)
    wide = [np.repeat(a, 2, axis=-1) for a in (q, k, v, dout)]  # a[..., ::2] of these is a
    strided = [a[..., ::2] for a in wide]
    assert all(a.strides[-1] == 2 * a.itemsize for a in strided)
    out, lse = flashattn.forward(q, k, v, causal=True)
    s_out, s_lse = flashattn.forward(*strided[:3], causal=True)
    np.testing.assert_array_equal(s_out, out)
    np.testing.assert_array_equal(s_lse, lse)
    out_strided = np.repeat(out, 2, axis=-1)[..., ::2]
    grads = flashattn.backward(dout, q, k, v, out, lse, causal=True)
    s_grads = flashattn.backward(strided[3], *strided[:3], out_strided, lse, causal=True)
    for g, s in zip(grads, s_grads):
        np.testing.assert_array_equal(s, g)


def test_strided_index_and_kvcache_inputs_are_copied(rng):
    cache_k, cache_v = (randn(rng, (2, 20, 2, 16), np.float32) for _ in range(2))
    q = randn(rng, (2, 1, 2, 16), np.float32)
    k_new, v_new = (randn(rng, (2, 1, 2, 16), np.float32) for _ in range(2))
    seqlens = np.array([[3, 9], [7, 9]], np.int32)[:, 0]  # stride of 2 elements
    cos, sin = rotary_tables(20, 8, np.float32)
    expected = [c.copy() for c in (cache_k, cache_v)]
    want, _ = flashattn.forward_kvcache(q, *expected, k_new, v_new, cache_seqlens=np.ascontiguousarray(seqlens),
                                        rotary_cos=cos, rotary_sin=sin)
    got, _ = flashattn.forward_kvcache(q, cache_k, cache_v, np.repeat(k_new, 2, -1)[..., ::2],
                                       np.repeat(v_new, 2, -1)[..., ::2], cache_seqlens=seqlens,
                                       rotary_cos=np.repeat(cos, 2, -1)[:, ::2],
                                       rotary_sin=np.repeat(sin, 2, -1)[:, ::2])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache_k, expected[0])
    np.testing.assert_array_equal(cache_v, expected[1])


@pytest.mark.parametrize("padded", [False, True])
def test_strided_outputs_are_refused(rng, monkeypatch, padded):
    if padded:
        monkeypatch.setattr(ops, "head_dim_padding", functools.partial(ops.head_dim_padding, always=True))
    d = 13 if padded else 16
    q, k, v, dout = dense_inputs(rng, 1, 8, 8, 2, 2, d, np.float16)
    bad = np.zeros((1, 8, 2, 2 * d), np.float16)[..., ::2]
    with pytest.raises(ValueError, match="out: head_dim stride 2 must be 1"):
        flashattn.forward(q, k, v, out=bad)
    out, lse = flashattn.forward(q, k, v)
    for name in ("dq", "dk", "dv"):
        with pytest.raises(ValueError, match=f"{name}: head_dim stride 2 must be 1"):
            flashattn.backward(dout, q, k, v, out, lse, **{name: bad})


# ----------------------------------------------------------------------------- index dtypes

def _index_calls(rng, xp_array):
    """Each index argument given as int64 (xp_array(values, dtype) builds it): name -> call."""
    q, k, v, dout = (xp_array(a, None) for a in dense_inputs(rng, 1, 4, 6, 2, 2, 16, np.float32))
    flat = [a[0] for a in (q, k, v, dout)]
    cu_q, cu_k = xp_array([0, 4], np.int32), xp_array([0, 6], np.int32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=6)
    out, lse = flashattn.forward(*flat[:3], **varlen)
    wide = lambda a: xp_array(a, np.int64)  # noqa: E731
    seqlens, table = xp_array([2], np.int32), xp_array([[0]], np.int32)
    return {
        "cu_seqlens_q": lambda: flashattn.forward(*flat[:3], **dict(varlen, cu_seqlens_q=wide([0, 4]))),
        "cu_seqlens_k": lambda: flashattn.backward(flat[3], *flat[:3], out, lse,
                                                   **dict(varlen, cu_seqlens_k=wide([0, 6]))),
        "seqused_k": lambda: flashattn.forward(*flat[:3], seqused_k=wide([6]), **varlen),
        "block_table": lambda: flashattn.forward(flat[0], k, v, block_table=wide([[0]]), **varlen),
        "cache_seqlens": lambda: flashattn.forward_kvcache(q, k, v, cache_seqlens=wide([2])),
        "cache_batch_idx": lambda: flashattn.forward_kvcache(q, k, v, cache_seqlens=seqlens,
                                                             cache_batch_idx=wide([0])),
        "cache_leftpad": lambda: flashattn.forward_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=wide([0])),
        "kvcache-block_table": lambda: flashattn.forward_kvcache(q, k, v, cache_seqlens=seqlens,
                                                                 block_table=wide([[0]])),
        "int32-control": lambda: flashattn.forward_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table),
    }


def _numpy_array(values, dtype):
    return np.asarray(values, dtype=dtype)


def _check_index_errors(calls):
    calls.pop("int32-control")()  # the same calls with int32 indices run
    for name, call in calls.items():
        arg = name.split("-")[-1]
        with pytest.raises(TypeError, match=rf"^{arg}: .*int32 expected, got int64\)$"):
            call()


def test_int64_indices_numpy(rng):
    _check_index_errors(_index_calls(rng, _numpy_array))


def test_int64_indices_torch(rng):
    torch = pytest.importorskip("torch")
    dtypes = {None: None, np.int32: torch.int32, np.int64: torch.int64}
    _check_index_errors(_index_calls(rng, lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dtypes[dt])))


def test_int64_indices_jax(rng):
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]  # the float32 inputs run on the CPU backend, whatever JAX's default
    jax.config.update("jax_enable_x64", True)  # else JAX makes every int64 array int32
    try:
        _check_index_errors(_index_calls(rng, lambda a, dt: jax.device_put(np.asarray(a, dtype=dt), cpu)))
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", [np.float16, np.uint8, np.int16])
def test_other_index_dtypes_are_named(dtype):
    q = np.zeros((4, 2, 16), np.float16)
    with pytest.raises(TypeError, match=rf"cu_seqlens_q: .*int32 expected, got {np.dtype(dtype).name}\)"):
        flashattn.flash_attn_varlen_func(q, q, q, np.array([0, 4], dtype), np.array([0, 4], np.int32), 4, 4)


@pytest.mark.parametrize("dtype,name", [(np.int64, "int64"), (np.uint8, "uint8"), (np.bool_, "bool"),
                                        (np.complex64, "complex64")])
def test_unsupported_value_dtypes_are_named(dtype, name):
    q = np.zeros((1, 4, 2, 16), np.float16)
    with pytest.raises(TypeError, match=rf"^k: unsupported dtype {name};"):
        flashattn.forward(q, q.astype(dtype), q)


def test_float8_beside_float16_is_named():
    # FP8 inputs are q, k and v all FP8 (test_float8.py); one FP8 tensor among 16-bit ones is named.
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"^v: dtype float8_e4m3fn != q dtype float16"):
        flashattn.forward(q, q, q.to(torch.float8_e4m3fn))


# ----------------------------------------------------------------------------- flash_attn 2.8's signatures

_DENSE_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                  ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQUIRED = inspect.Parameter.empty
FLASH_ATTN_2_8 = {  # flash_attn/flash_attn_interface.py of flash_attn 2.8: (name, default) in order
    "flash_attn_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _DENSE_OPTIONS,
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _DENSE_OPTIONS,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _DENSE_OPTIONS,
    "flash_attn_varlen_func": [(n, _REQUIRED) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                        "max_seqlen_k")] + _DENSE_OPTIONS + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [(n, _REQUIRED) for n in ("qkv", "cu_seqlens", "max_seqlen")]
    + _DENSE_OPTIONS,
    "flash_attn_varlen_kvpacked_func": [(n, _REQUIRED) for n in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                                                 "max_seqlen_q", "max_seqlen_k")] + _DENSE_OPTIONS,
    "flash_attn_with_kvcache": [("q", _REQUIRED), ("k_cache", _REQUIRED), ("v_cache", _REQUIRED), ("k", None),
                                ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}
# flashattn's own, after flash_attn's and optional: learnable_sink keyword-only (FlashAttention-4's
# name), so no positional call of flash_attn 2.8 can reach it.
# The descale factors of FP8 inputs keep FlashAttention-3's names.
EXTRAS = {name: ["learnable_sink", "sink_tokens", "q_descale", "k_descale", "v_descale"] for name in FLASH_ATTN_2_8}
EXTRAS["flash_attn_with_kvcache"] = ["index_check", "learnable_sink", "sink_tokens", "k_descale", "v_descale"]


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_8))
def test_signatures_are_flash_attn_2_8s(name):
    params = list(inspect.signature(getattr(flashattn, name)).parameters.values())
    expected = FLASH_ATTN_2_8[name]
    assert [(p.name, p.default) for p in params[:len(expected)]] == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:len(expected)])
    extras = params[len(expected):]
    assert [p.name for p in extras] == EXTRAS.get(name, [])
    assert all(p.default is not _REQUIRED for p in extras)


def _public():
    yield from (getattr(flashattn, n) for n in ["forward", "backward", "forward_kvcache", "cuda_compiled",
                                                "cuda_kernels", *FLASH_ATTN_2_8])
    try:
        import flashattn.torch as fa_torch
    except ImportError:
        return
    yield from (fa_torch.attention, fa_torch.attention_with_lse, fa_torch.scaled_dot_product_attention)


@pytest.mark.parametrize("fn", list(_public()), ids=lambda fn: fn.__name__)
def test_public_functions_are_documented(fn):
    doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    assert sig.return_annotation is not inspect.Signature.empty, "no return type"
    assert "Returns:" in doc, "no Returns section"
    if sig.parameters:
        assert "Raises:" in doc, "no Raises section"
    for param in sig.parameters:
        assert f"{param}:" in doc, f"argument {param} is not documented"
    if fn.__name__ in ("forward", "backward", "forward_kvcache") or fn.__name__.startswith("flash_attn_"):
        assert "i + sk - sq - window_left <= j <= i + sk - sq + window_right" in doc, "no mask rule"
        assert "h // (heads // heads_kv)" in doc, "no GQA mapping"
