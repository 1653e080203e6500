"""PyTorch integration: the flash_attn-compatible functions and flashattn.torch on CPU and (where
built and present) CUDA tensors, against the float64 reference; autograd; torch.compile with
fullgraph=True; the caller's CUDA stream; PyTorch's allocator; DLPack without copies.

Runs where PyTorch is installed (the GPU machine: scripts/gpu_python.sh); skipped, with that
reason shown, elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (the GPU machine runs this suite)")
ml_dtypes = pytest.importorskip("ml_dtypes")

import flashattn  # noqa: E402
import flashattn.torch as fa_torch  # noqa: E402
import reference  # noqa: E402
from tolerance import atol_for, check_close, max_abs  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_compiled()
NO_CUDA = "no CUDA device, or this build has no CUDA backend"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA))]
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
# The CUDA backward is the sm80 backward milestone; until it lands the CUDA gradient tests must
# fail with the library's NotImplementedError (strict: they flag when it starts working).
cuda_backward_missing = pytest.mark.xfail(raises=NotImplementedError, strict=True,
                                          reason="the CUDA backend has no backward pass yet")


def to_numpy(t):
    """A torch tensor as a numpy array of the same dtype (bfloat16 through ml_dtypes), exactly."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def randn(rng, shape, dtype, device, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(device=device, dtype=dtype)


def assert_close(ours, ref, naive, factor, name):
    ours = to_numpy(ours)
    scale = max_abs(ref[np.isfinite(ref)])
    check_close(name, ours, ref, naive, factor, atol_for(np.float32 if name == "lse" else ours.dtype, scale))


def check_forward(q, k, v, out, lse, **opts):
    args = [to_numpy(t) for t in (q, k, v)]
    ref_out, ref_lse = reference.forward(*args, **opts)
    naive_out, naive_lse = reference.naive_forward(*args, **opts)
    assert_close(out, ref_out, naive_out, 2, "out")
    assert_close(lse, ref_lse, naive_lse, 2, "lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv,d", [(113, 203, 6, 2, 64), (128, 128, 4, 4, 128), (1, 147, 6, 1, 64)])
def test_flash_attn_func_matches_reference(rng, device, dtype, causal, sq, sk, hq, hkv, d):
    q, k, v = (randn(rng, (2, s, h, d), dtype, device) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    out, lse, probs = flashattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.device == q.device and out.dtype == dtype and probs is None
    check_forward(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
def test_window_softcap_alibi(rng, device):
    q, k, v = (randn(rng, (2, s, 6, 64), torch.bfloat16, device) for s in (127, 513, 513))
    slopes = torch.from_numpy(rng.random(6).astype(np.float32) * 0.3).to(device)
    opts = dict(window_size=(40, 7), softcap=50.0, alibi_slopes=slopes)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    check_forward(q, k, v, out, lse, **dict(opts, alibi_slopes=to_numpy(slopes)))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_empty_sequences(rng, device):
    lens_q, lens_k = [37, 0, 128, 5], [64, 9, 0, 200]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device=device)
    q = randn(rng, (sum(lens_q), 4, 64), torch.float16, device)
    k, v = (randn(rng, (sum(lens_k), 2, 64), torch.float16, device) for _ in range(2))
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                   return_attn_probs=True)
    check_forward(q, k, v, out, lse, cu_seqlens_q=cu_q.cpu().numpy(), cu_seqlens_k=cu_k.cpu().numpy(), causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_layouts_read_in_place(rng, device):
    qkv = randn(rng, (2, 96, 3, 4, 64), torch.bfloat16, device)
    packed = flashattn.flash_attn_qkvpacked_func(qkv, causal=True)
    separate = flashattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(packed, separate)
    kv = qkv[:, :, 1:]
    assert torch.equal(flashattn.flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True), separate)


def gradient_case(rng, device, dtype):
    q, k, v = (randn(rng, (2, s, h, 64), dtype, device).requires_grad_() for s, h in ((77, 6), (131, 2), (131, 2)))
    dout = randn(rng, (2, 77, 6, 64), dtype, device)
    opts = dict(causal=True, softcap=30.0)
    out = flashattn.flash_attn_func(q, k, v, **opts)
    out.backward(dout)
    args = [to_numpy(t) for t in (q, k, v)]
    ref = reference.backward(to_numpy(dout), *args, **opts)
    naive = reference.naive_backward(to_numpy(dout), *args, **opts)
    for name, ours, r, n in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, naive):
        assert_close(ours, r, n, 3, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_cpu(rng, dtype):
    gradient_case(rng, "cpu", dtype)


@cuda_only
@cuda_backward_missing
def test_autograd_cuda(rng):
    gradient_case(rng, "cuda", torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_seed_from_torch_generator(rng, device):
    q, k, v = (randn(rng, (1, 64, 2, 64), torch.bfloat16, device) for _ in range(3))
    torch.manual_seed(7)
    a = flashattn.flash_attn_func(q, k, v, dropout_p=0.2)
    torch.manual_seed(7)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.2)
    c = flashattn.flash_attn_func(q, k, v, dropout_p=0.2)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(rng, device):
    q, k, v = (randn(rng, (2, 128, 4, 64), torch.bfloat16, device) for _ in range(3))

    def block(q, k, v):
        return flashattn.flash_attn_func(q * 2, k, v, causal=True).sum(dim=-1)

    # aot_eager traces through our fake implementations and autograd without needing a C++
    # compiler for CPU kernels; on CUDA the default (inductor) backend runs too.
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    assert torch.equal(compiled(q, k, v), block(q, k, v))
    if device == "cpu":  # gradients through the compiled graph (the CUDA backward is pending)
        qg = q.float().requires_grad_()
        compiled(qg, k.float(), v.float()).sum().backward()
        qe = q.float().requires_grad_()
        block(qe, k.float(), v.float()).sum().backward()
        assert torch.allclose(qg.grad, qe.grad)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16)
        out, lse = fa_torch.attention_with_lse(q, k, k, causal=True)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32


@cuda_only
def test_runs_on_the_current_stream(rng):
    q, k, v = (randn(rng, (1, 512, 8, 128), torch.bfloat16, "cuda") for _ in range(3))
    expected = flashattn.flash_attn_func(q, k, v)
    q_late = torch.zeros_like(q)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # ~10 ms: q_late is written long after this call returns
        q_late.copy_(q)
        out = flashattn.flash_attn_func(q_late, k, v)  # wrong unless it runs on `side`, after the copy
    side.synchronize()
    assert torch.equal(out, expected)


@cuda_only
def test_outputs_come_from_the_pytorch_allocator(rng):
    q = randn(rng, (1, 256, 8, 128), torch.bfloat16, "cuda")
    before = torch.cuda.memory_allocated()
    out, lse = fa_torch.attention_with_lse(q, q, q)
    grown = torch.cuda.memory_allocated() - before
    assert grown >= out.numel() * out.element_size() + lse.numel() * lse.element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack_zero_copy(rng, device):
    q = randn(rng, (1, 64, 2, 64), torch.float16, device)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 64, device=device)
    got_out, got_lse = flashattn.forward(q, q, q, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    # and the inputs were read in place: a strided view gives the same result as its copy
    qkv = randn(rng, (1, 64, 3, 2, 64), torch.float16, device)
    view_out, _ = flashattn.forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    copy_out, _ = flashattn.forward(*(qkv[:, :, i].contiguous() for i in range(3)))
    assert torch.equal(view_out, copy_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq,sk,hq,hkv", [(96, 96, 4, 4), (160, 96, 4, 2), (64, 200, 4, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_layout_matches_torch(rng, device, sq, sk, hq, hkv, is_causal):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = randn(rng, (2, hq, sq, 64), dtype, device)
    k, v = (randn(rng, (2, hkv, sk, 64), dtype, device) for _ in range(2))
    ours = fa_torch.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.1, enable_gqa=hq != hkv)
    theirs = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                                              scale=0.1, enable_gqa=hq != hkv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), theirs, atol=tol, rtol=tol)


def test_sdpa_rejects_what_it_cannot_honour():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        fa_torch.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa"):
        fa_torch.scaled_dot_product_attention(q, q[:, :1], q[:, :1])


@pytest.mark.parametrize("device", DEVICES)
def test_lazy_views_are_read_as_their_values(rng, device):
    q, k, v = (randn(rng, (1, 32, 2, 64), torch.float32 if device == "cpu" else torch.float16, device)
               for _ in range(3))
    # A negative-bit view's memory holds -k; the descriptor path must not read that memory as k.
    neg = torch._neg_view(-k)
    assert neg.is_neg()
    assert torch.equal(flashattn.flash_attn_func(q, neg, v), flashattn.flash_attn_func(q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_errors_are_python_exceptions(device):
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="k: dtype"):
        flashattn.flash_attn_func(q, q.float(), q)
    with pytest.raises(ValueError, match="head_dim"):
        flashattn.flash_attn_func(q, q[..., :8], q)
    if device == "cuda":
        with pytest.raises(ValueError, match="k"):
            flashattn.flash_attn_func(q, q.cpu(), q)


@cuda_only
def test_cupy_round_trip(rng):
    cupy = pytest.importorskip("cupy")
    q, k, v = (randn(rng, (1, 100, 4, 64), torch.float16, "cuda") for _ in range(3))
    expected = flashattn.flash_attn_func(q, k, v, causal=True)
    cq, ck, cv = (cupy.from_dlpack(t) for t in (q, k, v))
    out, lse = flashattn.forward(cq, ck, cv, causal=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert torch.equal(torch.from_dlpack(out), expected)
    given = cupy.empty_like(cq)
    assert flashattn.forward(cq, ck, cv, out=given)[0].data.ptr == given.data.ptr


@pytest.mark.parametrize("device", DEVICES)
def test_jax_round_trip(rng, device):
    jax = pytest.importorskip("jax")
    platform = "gpu" if device == "cuda" else "cpu"
    try:
        jax_device = jax.devices(platform)[0]
    except RuntimeError:
        pytest.skip(f"JAX has no {platform} device here")
    q, k, v = (randn(rng, (1, 100, 4, 64), torch.float16, device) for _ in range(3))
    expected = flashattn.flash_attn_func(q, k, v, causal=True)
    jq, jk, jv = (jax.device_put(to_numpy(t), jax_device) for t in (q, k, v))
    out, lse = flashattn.forward(jq, jk, jv, causal=True)
    assert isinstance(out, jax.Array) and next(iter(out.devices())) == jax_device
    assert np.array_equal(np.asarray(out), to_numpy(expected))
