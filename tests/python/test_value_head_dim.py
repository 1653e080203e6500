"""v with a head_dim of its own (multi-head latent attention: q / k 192, v 128), on the CPU:
flashattn.forward / backward on numpy arrays against the float64 reference; flash_attn_func,
flash_attn_varlen_func and autograd on torch tensors against attention written in torch float64
math (its gradients by torch's autograd); the padded path with two head dims; the errors; and the
CUDA backend's refusal, named, where a GPU is present."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import flashattn
import reference as ref
from flashattn import ops
from test_compat import force_padding
from test_numpy import cu_seqlens, randn, run_and_check
from tolerance import atol_for, check_close, max_abs

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed here")

# (q / k head_dim, v's): DeepSeek V2 / V3's prefill pair, one with v wider, one odd.
PAIRS = [(192, 128), (128, 64)]


def inputs(rng, b, sq, sk, hq, hkv, d, dv, dtype):
    """q, k, v, dout (dout shaped like out: q's rows, v's head_dim)."""
    return (randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hkv, d), dtype),
            randn(rng, (b, sk, hkv, dv), dtype), randn(rng, (b, sq, hq, dv), dtype))


# ----------------------------------------------------------------------------- numpy arrays

@pytest.mark.parametrize("d,dv", PAIRS + [(64, 128), (33, 17)])
def test_numpy_forward_backward(rng, d, dv):
    # GQA with a causal sliding window, over more than one of the CPU path's 64-key tiles.
    q, k, v, dout = inputs(rng, 2, 40, 70, 4, 2, d, dv, np.float16)
    run_and_check(q, k, v, dout, causal=True, window_size=(45, 0))


def test_kvcache_latent_cache_read_as_keys_and_values(rng):
    """Absorbed multi-head latent attention: one latent cache of 576 columns, its first 512 the
    values (v_cache a view of k_cache), paged, two query tokens a sequence; equal to the dense
    forward over the gathered keys and values."""
    b, sq, hq, d, dv, page = 2, 2, 8, 576, 512, 64
    seqlens = np.array([70, 128], np.int32)
    latent = randn(rng, (5, page, 1, d), np.float32)
    table = np.array([[3, 0], [4, 1]], np.int32)
    q = randn(rng, (b, sq, hq, d), np.float32)
    out, lse = flashattn.forward_kvcache(q, latent, latent[..., :dv], cache_seqlens=seqlens, block_table=table,
                                         causal=True)
    assert out.shape == (b, sq, hq, dv)
    for i in range(b):
        keys = np.concatenate([latent[p] for p in table[i]])[:seqlens[i]][None]  # [1, sk, 1, d]
        want, want_lse = flashattn.forward(q[i:i + 1], keys, keys[..., :dv], causal=True)
        np.testing.assert_array_equal(out[i:i + 1], want)
        np.testing.assert_array_equal(lse[i:i + 1], want_lse)


def test_numpy_varlen(rng):
    lens_q, lens_k = np.array([30, 0, 9]), np.array([20, 7, 70])
    opts = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), causal=True)
    q, dout = randn(rng, (41, 4, 33), np.float32), randn(rng, (41, 4, 17), np.float32)  # 2 rows of no sequence
    k, v = randn(rng, (97, 1, 33), np.float32), randn(rng, (97, 1, 17), np.float32)
    out, _, dq, dk, dv = run_and_check(q, k, v, dout, **opts)
    assert out.shape == (41, 4, 17) and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("d,dv", [(33, 17), (40, 17), (33, 24)])
def test_padded_path_pads_each_head_dim(rng, monkeypatch, d, dv):
    # The CUDA layer's padding (forced on the CPU): q / k and v padded each to its own multiple of
    # 8, out and the gradients cut back to theirs, the default scale q's.
    widths = force_padding(monkeypatch)
    q, k, v, dout = inputs(rng, 1, 20, 30, 2, 1, d, dv, np.float16)
    out, lse, dq, dk, dv_grad = run_and_check(q, k, v, dout, causal=True)
    assert set(widths) == {w + -w % 8 for w in (d, dv) if w % 8}  # only the head dims that need it
    given = [np.full(a.shape, np.nan, a.dtype) for a in (out, dq, dk, dv_grad)]
    assert flashattn.forward(q, k, v, out=given[0], causal=True)[0] is given[0]
    flashattn.backward(dout, q, k, v, out, lse, dq=given[1], dk=given[2], dv=given[3], causal=True)
    for ours, theirs in zip(given, (out, dq, dk, dv_grad)):
        np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match=rf"out: shape \[1, 20, 2, {d}\] != expected \[1, 20, 2, {dv}\]"):
        flashattn.forward(q, k, v, out=np.zeros(q.shape, q.dtype))


def test_errors_name_the_argument(rng):
    q, k, v, dout = inputs(rng, 1, 8, 9, 2, 2, 16, 8, np.float32)
    with pytest.raises(ValueError, match=r"out: shape \[1, 8, 2, 16\] != \[1, 8, 2, 8\], q's shape with v's head_dim "
                                         r"\(v's head_dim 8 differs from q's 16\)"):
        flashattn.forward(q, k, v, out=np.zeros(q.shape, q.dtype))
    out, lse = flashattn.forward(q, k, v)
    with pytest.raises(ValueError, match=r"dout: shape \[1, 8, 2, 16\] != \[1, 8, 2, 8\]"):
        flashattn.backward(q, q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"dv: shape \[1, 9, 2, 16\] != v shape \[1, 9, 2, 8\]"):
        flashattn.backward(dout, q, k, v, out, lse, dv=np.zeros(k.shape, k.dtype))
    with pytest.raises(ValueError, match=r"v: shape \[1, 8, 2, 8\] != k shape \[1, 9, 2, 16\] \(v may differ"):
        flashattn.forward(q, k, v[:, :8])
    with pytest.raises(ValueError, match=r"v_cache: dim 1 is 8, k_cache's 9 \(v may differ from k in head_dim alone\)"):
        flashattn.forward_kvcache(q, k, v[:, :8], cache_seqlens=8)
    with pytest.raises(ValueError, match=r"out: shape \[1, 8, 2, 16\] != \[1, 8, 2, 8\]"):
        flashattn.forward_kvcache(q, k, v, cache_seqlens=9, out=np.zeros(q.shape, q.dtype))


# ----------------------------------------------------------------------------- torch tensors

def math_attention(q, k, v, cu_q=None, cu_k=None, causal=False, window_size=(-1, -1)):
    """Attention in torch float64 math, explicit softmax(Q K^T / sqrt(d)) V with the library's
    bottom-right masks; (out, lse), differentiable by torch's autograd. Dense [b, s, h, d] or,
    with cu_q / cu_k, varlen [total, h, d] (every query row must see a key)."""
    if cu_q is not None:
        bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
        parts = [math_attention(q[None, a:b], k[None, c:e], v[None, c:e], causal=causal, window_size=window_size)
                 for a, b, c, e in bounds]
        return torch.cat([o[0] for o, _ in parts]), torch.cat([lse[0] for _, lse in parts], dim=-1)
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    scores = (qh @ kh.transpose(-1, -2)) / q.shape[-1] ** 0.5
    visible = torch.from_numpy(ref.visible(q.shape[1], k.shape[1], causal, window_size))
    scores = scores.masked_fill(~visible, -torch.inf)
    return (torch.softmax(scores, -1) @ vh).transpose(1, 2), torch.logsumexp(scores, -1)


def to_numpy(t):
    """A bfloat16 tensor as a numpy array of the same values and dtype (ml_dtypes'), exactly."""
    return t.detach().float().numpy().astype(ml_dtypes.bfloat16)


def check_against_math(rng, out, lse, q, k, v, varlen=None, **mask):
    """out, lse and autograd's gradients of the leaves q, k, v (bfloat16) against math_attention
    in float64 by the tolerance rule, the naive term from reference.py."""
    cu = {} if varlen is None else dict(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    exact_out, exact_lse = math_attention(*exact, *(varlen or ()), **mask)
    arrays = [to_numpy(x) for x in (q, k, v)]
    naive_out, naive_lse = ref.naive_forward(*arrays, **cu, **mask)
    exact_out_np, exact_lse_np = exact_out.detach().numpy(), exact_lse.detach().numpy()
    check_close("out", to_numpy(out), exact_out_np, naive_out, 2, atol_for(naive_out.dtype, max_abs(exact_out_np)))
    check_close("lse", lse.numpy(), exact_lse_np, naive_lse, 2, atol_for(np.float32, max_abs(exact_lse_np)))

    dout = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32)).to(out.dtype)
    out.backward(dout)
    exact_grads = [g.numpy() for g in torch.autograd.grad(exact_out, exact, dout.double())]
    naive_grads = ref.naive_backward(to_numpy(dout), *arrays, **cu, **mask)
    atol = atol_for(naive_out.dtype, max_abs(*exact_grads))
    for name, leaf, e, n in zip(("dq", "dk", "dv"), (q, k, v), exact_grads, naive_grads):
        assert leaf.grad.shape == leaf.shape, name
        check_close(name, to_numpy(leaf.grad), e, n, 3, atol)


def leaves(rng, *shapes):
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(torch.bfloat16).requires_grad_()
            for s in shapes]


@needs_torch
@pytest.mark.parametrize("d,dv", PAIRS)
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(20, 5))])
def test_flash_attn_func_and_autograd(rng, d, dv, mask):
    q, k, v = leaves(rng, (2, 33, 4, d), (2, 47, 2, d), (2, 47, 2, dv))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **mask)
    assert out.shape == (2, 33, 4, dv) and out.dtype == torch.bfloat16
    check_against_math(rng, out, lse, q, k, v, **mask)


@needs_torch
def test_flash_attn_varlen_func_and_autograd(rng):
    lens_q, lens_k = np.array([5, 40]), np.array([17, 40])
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v = leaves(rng, (45, 4, 192), (57, 2, 192), (57, 2, 128))
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 40, 40,
                                                   causal=True, return_attn_probs=True)
    assert out.shape == (45, 4, 128)
    check_against_math(rng, out, lse, q, k, v, varlen=(cu_q, cu_k), causal=True)


@needs_torch
def test_padded_autograd_and_fake_shapes(rng, monkeypatch):
    monkeypatch.setattr(ops, "head_dim_padding", functools.partial(ops.head_dim_padding, always=True))
    q, k, v = leaves(rng, (1, 30, 2, 33), (1, 30, 2, 33), (1, 30, 2, 17))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (1, 30, 2, 17)
    check_against_math(rng, out, lse, q, k, v, causal=True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the custom op's fake (torch.compile's shapes)
        fq, fv = torch.empty(2, 100, 8, 192), torch.empty(2, 300, 2, 128)
        fake_out = flashattn.flash_attn_func(fq, torch.empty(2, 300, 2, 192), fv, causal=True)
        assert fake_out.shape == (2, 100, 8, 128)


@needs_torch
def test_sdpa_and_flex_layouts_match_torch(rng):
    # [b, h, s, d] with value's head_dim 48 (SDPA's Ev), float32 against PyTorch's SDPA in float64.
    import flashattn.torch  # noqa: F401 (the SDPA wrapper's module)

    q, k = (torch.from_numpy(rng.standard_normal((1, 4, s, 64)).astype(np.float32)) for s in (40, 50))
    v = torch.from_numpy(rng.standard_normal((1, 4, 50, 48)).astype(np.float32))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = {causal: sdpa(q.double(), k.double(), v.double(), is_causal=causal) for causal in (False, True)}
    for is_causal, theirs in expected.items():
        ours = flashattn.torch.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        assert ours.shape == (1, 4, 40, 48)
        torch.testing.assert_close(ours.double(), theirs, atol=1e-5, rtol=1e-5)
    ours = flashattn.flex_attention(q, k, v)  # no block mask: every key visible
    torch.testing.assert_close(ours.double(), expected[False], atol=1e-5, rtol=1e-5)


@needs_torch
@pytest.mark.skipif(torch is None or not (torch.cuda.is_available() and flashattn.cuda_compiled()),
                    reason="no CUDA device, or this build has no CUDA backend")
def test_cuda_raises_by_name():
    q, k = (torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 16, 2, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="v: head_dim 32 differs from q/k's 64: the CUDA kernels need equal"):
        flashattn.flash_attn_func(q, k, v)
    # The KV-cache call: the decode kernels' check (or the build's lack of them) names it.
    with pytest.raises(NotImplementedError, match="v_cache: head_dim 32 differs from q/k's 64: the CUDA decode kernels"
                                                  "|needs the decode kernels"):
        flashattn.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=16)
