"""Learnable attention sinks through the Python package: numpy forward against the math written
here in float64; PyTorch autograd (eager and torch.compile) against PyTorch's own autograd of
the same math (a zero-value key whose score is the sink), d sink included; flashattn.backward's
fourth result; the KV-cache path; clear errors."""
from __future__ import annotations

import numpy as np
import pytest

import flashattn
import reference


def sink_attention(q, k, v, sink, *, causal=False, xp=np, hidden=None):
    """out, lse of attention with a sink, in float64, through the equivalent form: one more key
    per head whose score is sink[h] and whose value row is zero. q [b, sq, h, d], k / v
    [b, sk, hkv, d], sink [h]; xp: numpy, or torch (then differentiable); hidden: bool [sq, sk],
    the masked scores (default: causal's, or none)."""
    torch_like = xp is not np
    b, sq, h, d = q.shape
    sk, rep = k.shape[1], h // k.shape[2]
    repeat = (lambda x: x.repeat_interleave(rep, 2)) if torch_like else (lambda x: np.repeat(x, rep, 2))
    s = xp.einsum("bihd,bjhd->bhij", q, repeat(k)) / np.sqrt(d)
    if causal and hidden is None:
        hidden = ~reference.visible(sq, sk, causal=True)
    if hidden is not None:
        s = s.masked_fill(xp.as_tensor(hidden), float("-inf")) if torch_like else np.where(hidden, -np.inf, s)
    col = sink.reshape(1, h, 1, 1) * xp.ones((b, h, sq, 1), dtype=s.dtype)
    s = xp.cat([s, col], -1) if torch_like else np.concatenate([s, col], -1)
    m = s.amax(-1, keepdim=True) if torch_like else s.max(-1, keepdims=True)
    e = xp.exp(s - m)
    lse = m + xp.log(e.sum(-1, keepdim=True) if torch_like else e.sum(-1, keepdims=True))
    out = xp.einsum("bhij,bjhd->bihd", xp.exp(s - lse)[..., :sk], repeat(v))
    return out, lse[..., 0]


def make(rng, b=2, sq=37, sk=53, h=4, hkv=2, d=32, dtype=np.float64):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    sink = rng.uniform(-1, 3, h).astype(np.float32)
    return q, k, v, sink


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_forward_matches_the_math(rng, causal):
    q, k, v, sink = make(rng)
    out, lse = flashattn.forward(q, k, v, causal=causal, learnable_sink=sink)
    ref_out, ref_lse = sink_attention(q, k, v, sink.astype(np.float64), causal=causal)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-6)  # the LSE is float32
    flash_out = flashattn.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    np.testing.assert_array_equal(flash_out, out)


def test_backward_returns_the_sink_gradient(rng):
    q, k, v, sink = make(rng)
    dout = rng.standard_normal(q.shape)
    out, lse = flashattn.forward(q, k, v, learnable_sink=sink)
    grads = flashattn.backward(dout, q, k, v, out, lse, learnable_sink=sink)
    assert len(grads) == 4 and grads[3].shape == (4,) and grads[3].dtype == np.float32
    # d sink = -sum over rows of P_sink * D, D = dout . out
    p_sink = np.exp(sink.astype(np.float64)[None, :, None] - lse)  # [b, h, sq]
    delta = np.einsum("bihd,bihd->bhi", dout, out)
    np.testing.assert_allclose(grads[3], -(p_sink * delta).sum((0, 2)), rtol=1e-5, atol=1e-6)
    given = np.full(4, 7.0, np.float32)
    again = flashattn.backward(dout, q, k, v, out, lse, learnable_sink=sink, dsink=given)
    assert again[3] is given or np.shares_memory(again[3], given)
    np.testing.assert_array_equal(given, grads[3])
    assert len(flashattn.backward(dout, q, k, v, out, lse)) == 3  # no sink: three gradients
    with pytest.raises(ValueError, match="dsink: given without a learnable_sink"):
        flashattn.backward(dout, q, k, v, out, lse, dsink=given)


def test_sink_tokens_stay_visible_past_the_window(rng):
    q, k, v, sink = make(rng, sq=40, sk=60)
    vis = reference.visible(40, 60, causal=True, window_size=(5, 0))
    vis[:, :3] |= reference.visible(40, 60, causal=True)[:, :3]  # the first 3 keys, where causal allows
    out, lse = flashattn.forward(q, k, v, causal=True, window_size=(5, 0), sink_tokens=3, learnable_sink=sink)
    ref_out, ref_lse = sink_attention(q, k, v, sink.astype(np.float64), hidden=~vis)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-6)
    with pytest.raises(ValueError, match="sink_tokens: -1 must be >= 0"):
        flashattn.forward(q, k, v, sink_tokens=-1)


def test_kvcache_matches_the_dense_forward(rng):
    q, k, v, sink = make(rng, b=2, sq=2, sk=30, dtype=np.float32)
    k_cache = np.zeros((2, 40, 2, 32), np.float32)
    v_cache = np.zeros_like(k_cache)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0, causal=True,
                                            learnable_sink=sink)
    dense = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    np.testing.assert_allclose(out, dense, atol=1e-6)


def test_bad_sinks_are_named(rng):
    q, k, v, sink = make(rng)
    with pytest.raises(ValueError, match="learnable_sink: heads 3 != q heads 4"):
        flashattn.forward(q, k, v, learnable_sink=sink[:3])
    with pytest.raises(TypeError, match="learnable_sink: dtype float64 must be float32"):
        flashattn.forward(q, k, v, learnable_sink=sink.astype(np.float64))


# ---- PyTorch ------------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed here (the GPU machine runs this suite)")


@pytest.mark.parametrize("mask", ["none", "causal", "sink_tokens"])
@pytest.mark.parametrize("compiled", [False, True])
def test_torch_gradients_match_torch_autograd(rng, mask, compiled):
    torch = _torch()
    q, k, v, sink = (torch.from_numpy(x) for x in make(rng))
    dout = torch.from_numpy(rng.standard_normal(tuple(q.shape)))
    causal = mask != "none"
    window, tokens = ((4, 0), 3) if mask == "sink_tokens" else ((-1, -1), 0)
    vis = reference.visible(q.shape[1], k.shape[1], causal=causal, window_size=window)
    vis[:, :tokens] |= reference.visible(q.shape[1], k.shape[1], causal=causal)[:, :tokens]

    def ours(q, k, v, sink):
        return flashattn.flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink,
                                         sink_tokens=tokens)

    fn = torch.compile(ours, fullgraph=True, backend="aot_eager") if compiled else ours
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    fn(*leaves).backward(dout)
    # PyTorch's autograd of the math, in float64 (the sink as float64 too).
    ref = [x.clone().double().requires_grad_() for x in (q, k, v, sink)]
    out, _ = sink_attention(*ref, xp=torch, hidden=~vis)
    out.backward(dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), leaves, ref):
        tol = 2e-6 if name == "dsink" else 1e-10  # dsink is float32
        assert torch.allclose(a.grad.double(), b.grad, atol=tol, rtol=tol), name
    assert leaves[3].grad.dtype == torch.float32


def test_torch_sink_without_grad(rng):
    torch = _torch()
    q, k, v, sink = (torch.from_numpy(x) for x in make(rng))
    ql = q.clone().requires_grad_()
    flashattn.flash_attn_func(ql, k, v, learnable_sink=sink).sum().backward()  # the sink needs no grad
    assert ql.grad is not None and sink.grad is None


def _cuda(torch):
    if not (torch.cuda.is_available() and flashattn.cuda_compiled()):
        pytest.skip("no CUDA device, or a package built without the CUDA kernels")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "sink_tokens"])
@pytest.mark.parametrize("hd", [64, 128])
def test_torch_cuda_matches_the_math(rng, dtype, mask, hd):
    """The CUDA kernels (forward as dispatched, backward with d sink) against PyTorch's float64
    autograd of the math on the same (rounded) inputs: rows that see no key (the masks, sq > sk),
    GQA, a head whose sink is -inf, sink tokens past a causal window (the sink-token pass)."""
    torch = _torch()
    _cuda(torch)
    dt = getattr(torch, dtype)
    q, k, v, sink = make(rng, b=2, sq=150, sk=97, h=4, hkv=2, d=hd, dtype=np.float32)
    if mask == "none":  # (with a mask, rows that see no key: the math's -inf - -inf is NaN there)
        sink[3] = -np.inf
    q, k, v = (torch.from_numpy(x).to(dt) for x in (q, k, v))
    sink = torch.from_numpy(sink)
    dout = torch.from_numpy(rng.standard_normal(tuple(q.shape)).astype(np.float32)).to(dt)
    causal = mask in ("causal", "sink_tokens")
    window = {"window": (20, 5), "sink_tokens": (20, 0)}.get(mask, (-1, -1))
    tokens = 3 if mask == "sink_tokens" else 0
    leaves = [x.cuda().requires_grad_() for x in (q, k, v, sink)]
    out, lse, _ = flashattn.flash_attn_func(*leaves[:3], causal=causal, window_size=window,
                                            learnable_sink=leaves[3], return_attn_probs=True, sink_tokens=tokens)
    out.backward(dout.cuda())
    vis = reference.visible(q.shape[1], k.shape[1], causal=causal, window_size=window)
    vis[:, :tokens] |= reference.visible(q.shape[1], k.shape[1], causal=causal)[:, :tokens]
    ref = [x.double().requires_grad_() for x in (q, k, v, sink)]
    ref_out, ref_lse = sink_attention(*ref, xp=torch, hidden=~vis)
    ref_out.backward(dout.double())
    # Within a few units of the 16-bit type's rounding at each result's scale.
    eps = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    for name, got, want in [("out", out, ref_out), ("lse", lse, ref_lse)] + [
            (n, a.grad, b.grad) for n, a, b in zip(("dq", "dk", "dv", "dsink"), leaves, ref)]:
        got, want = got.detach().double().cpu(), want.detach()
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite), name
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        assert err <= 8 * eps * max(scale, 1.0), f"{name}: error {err:.3g} at scale {scale:.3g}"
    if mask == "none":
        assert leaves[3].grad[3].item() == 0.0  # a sink of -inf takes nothing and gets no gradient


def test_torch_cuda_kvcache_and_sink_tokens(rng):
    torch = _torch()
    _cuda(torch)
    q, k, v, sink = make(rng, b=2, sq=1, sk=300, h=8, hkv=2, d=64, dtype=np.float32)
    q, k, v = (torch.from_numpy(x).cuda().to(torch.bfloat16) for x in (q, k, v))
    sink = torch.from_numpy(sink).cuda()
    k_cache, v_cache = k.contiguous(), v.contiguous()
    seqlens = torch.tensor([300, 177], dtype=torch.int32, device="cuda")
    for splits in (1, 3):
        got = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits,
                                                learnable_sink=sink)
        for b, n in enumerate((300, 177)):
            want = flashattn.flash_attn_func(q[b:b + 1].cpu().float(), k[b:b + 1, :n].cpu().float(),
                                             v[b:b + 1, :n].cpu().float(), learnable_sink=sink.cpu())
            torch.testing.assert_close(got[b:b + 1].cpu().float(), want, atol=2e-2, rtol=2e-2)
    # Sink tokens past a window: the decode kernels' window, then the sink-token pass.
    got = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                            window_size=(16, 0), sink_tokens=3, learnable_sink=sink)
    want = flashattn.flash_attn_with_kvcache(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(),
                                             cache_seqlens=seqlens.cpu(), causal=True, window_size=(16, 0),
                                             sink_tokens=3, learnable_sink=sink.cpu())
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)
