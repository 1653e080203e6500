"""PyTorch integration: the flash_attn-compatible functions and flashattn.torch on CPU and (where
built and present) CUDA tensors, outputs and gradients against the float64 reference; autograd;
torch.compile with fullgraph=True (forward and backward graphs); deterministic backward; the
caller's CUDA stream; PyTorch's allocator (outputs and the backward's workspace); DLPack without
copies.

Runs where PyTorch is installed (the GPU machine: scripts/gpu_python.sh); skipped, with that
reason shown, elsewhere."""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (the GPU machine runs this suite)")
ml_dtypes = pytest.importorskip("ml_dtypes")

import flashattn  # noqa: E402
import flashattn.torch as fa_torch  # noqa: E402
import reference  # noqa: E402
from flashattn import ops  # noqa: E402
from flashattn._arrays import TorchFramework  # noqa: E402
from test_numpy import P_DROP, keep_mask  # noqa: E402
from tolerance import atol_for, check_close, max_abs  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_compiled()
NO_CUDA = "no CUDA device, or this build has no CUDA backend"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA))]
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)


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


def check_gradients(dout, q, k, v, grads, **opts):
    """grads = (dq, dk, dv) against the float64 reference: 3x the naive's error. One atol for the
    three, at the largest one's scale: a gradient that is ~0 (dq with a single key) must not get
    an atol of ~0 that float32 noise from the other terms could never meet."""
    args = [to_numpy(t) for t in (dout, q, k, v)]
    ref = reference.backward(*args, **opts)
    naive = reference.naive_backward(*args, **opts)
    atol = atol_for(to_numpy(grads[0]).dtype, max_abs(*ref))
    for name, ours, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        check_close(name, to_numpy(ours), r, n, 3, atol)


def check_autograd(rng, out, q, k, v, **opts):
    """Backpropagates a random dout through out (autograd runs the library's backward) and checks
    the gradients of the leaves q, k, v against the reference with the same options."""
    dout = randn(rng, out.shape, out.dtype, out.device)
    out.backward(dout)
    check_gradients(dout, q, k, v, (q.grad, k.grad, v.grad), **opts)


def leaves(*tensors):
    """Copies of tensors as autograd leaves (their .grad collects the gradients)."""
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv,d", [(113, 203, 6, 2, 64), (128, 128, 4, 4, 128), (1, 147, 6, 1, 64)])
def test_flash_attn_func_matches_reference(rng, device, dtype, causal, sq, sk, hq, hkv, d):
    # Plain, causal, GQA (6 / 2) and MQA (6 / 1): outputs, then autograd's gradients.
    q, k, v = leaves(*(randn(rng, (2, s, h, d), dtype, device) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))))
    out, lse, probs = flashattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.device == q.device and out.dtype == dtype and probs is None
    check_forward(q, k, v, out, lse, causal=causal)
    check_autograd(rng, out, q, k, v, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "all"])
def test_window_softcap_alibi(rng, device, feature):
    q, k, v = leaves(*(randn(rng, (2, s, 6, 64), torch.bfloat16, device) for s in (127, 513, 513)))
    slopes = torch.from_numpy(rng.random(6).astype(np.float32) * 0.3).to(device)
    opts = {}
    if feature in ("window", "all"):
        opts["window_size"] = (40, 7)
    if feature in ("softcap", "all"):
        opts["softcap"] = 50.0
    if feature in ("alibi", "all"):
        opts["alibi_slopes"] = slopes
    ref_opts = dict(opts, alibi_slopes=to_numpy(slopes)) if "alibi_slopes" in opts else opts
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    check_forward(q, k, v, out, lse, **ref_opts)
    check_autograd(rng, out, q, k, v, **ref_opts)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_empty_sequences(rng, device):
    # Sequence 1 has no queries (its keys get zero dk, dv), sequence 2 no keys (its queries see
    # none: out 0, lse -inf, dq 0).
    lens_q, lens_k = [37, 0, 128, 5], [64, 9, 0, 200]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device=device)
    q = randn(rng, (sum(lens_q), 4, 64), torch.float16, device)
    k, v = (randn(rng, (sum(lens_k), 2, 64), torch.float16, device) for _ in range(2))
    q, k, v = leaves(q, k, v)
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                   return_attn_probs=True)
    opts = dict(cu_seqlens_q=cu_q.cpu().numpy(), cu_seqlens_k=cu_k.cpu().numpy(), causal=True)
    check_forward(q, k, v, out, lse, **opts)
    check_autograd(rng, out, q, k, v, **opts)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_layouts_read_in_place(rng, device):
    qkv = randn(rng, (2, 96, 3, 4, 64), torch.bfloat16, device)
    packed = flashattn.flash_attn_qkvpacked_func(qkv, causal=True)
    separate = flashattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(packed, separate)
    kv = qkv[:, :, 1:]
    assert torch.equal(flashattn.flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True), separate)


def gradient_case(rng, device, dtype):
    q, k, v = leaves(*(randn(rng, (2, s, h, 64), dtype, device) for s, h in ((77, 6), (131, 2), (131, 2))))
    opts = dict(causal=True, softcap=30.0)
    check_autograd(rng, flashattn.flash_attn_func(q, k, v, **opts), q, k, v, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_cpu(rng, dtype):
    gradient_case(rng, "cpu", dtype)


@cuda_only
def test_autograd_cuda(rng):
    gradient_case(rng, "cuda", torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_gradients_with_the_forwards_seed(rng, device, causal):
    # Autograd's backward must redraw the forward's keep-mask from the seed it saved. The mask is
    # read back from the CPU backend (keep_mask: head_dim == seqlen_k): every backend draws the same.
    b, sq, sk, hq, hkv = 2, 40, 64, 4, 2
    q, k, v = leaves(*(randn(rng, (b, s, h, sk), torch.float16, device) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))))
    seed = int(rng.integers(0, 2**62))
    keep = keep_mask(to_numpy(q), to_numpy(k), seed, causal)
    out, lse = fa_torch.attention_with_lse(q, k, v, dropout_p=P_DROP, seed=seed, causal=causal)
    # The library holds dropout_p as a float32: its kept values are scaled by 1 / (1 - float32(p)).
    ref_opts = dict(dropout_p=float(np.float32(P_DROP)), dropout_mask=keep, causal=causal)
    check_forward(q, k, v, out, lse, **ref_opts)
    check_autograd(rng, out, q, k, v, **ref_opts)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_backward_is_bitwise_repeatable(rng, device):
    # GQA (8 / 2) and 512 keys: many key blocks add into each dq element and many query heads
    # into each dk / dv element; deterministic=True fixes the order of every such sum.
    q, dout = (randn(rng, (2, 256, 8, 128), torch.bfloat16, device) for _ in range(2))
    k, v = (randn(rng, (2, 512, 2, 128), torch.bfloat16, device) for _ in range(2))
    out, lse = flashattn.forward(q, k, v, causal=True)
    first = flashattn.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(10):
        again = flashattn.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    # autograd passes the flag on: the same bits
    ql, kl, vl = leaves(q, k, v)
    flashattn.flash_attn_func(ql, kl, vl, causal=True, deterministic=True).backward(dout)
    assert all(torch.equal(t.grad, g) for t, g in zip((ql, kl, vl), first))
    check_gradients(dout, q, k, v, first, causal=True)


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
        return flashattn.flash_attn_func(q * 2, k, v, causal=True, deterministic=True).sum(dim=-1)

    # aot_eager traces through our fake implementations and autograd without needing a C++
    # compiler for CPU kernels; on CUDA the default (inductor) backend runs too.
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    assert torch.equal(compiled(q, k, v), block(q, k, v))
    # Forward and backward: AOTAutograd traces the forward op's registered autograd into a
    # compiled backward graph that calls flashattn::backward (its workspace allocated inside).
    # Eager, the gradient of sum(dim=-1) reaches the backward expanded (stride 0 along head_dim).
    grads = {}
    for name, fn in (("compiled", compiled), ("eager", block)):
        ql, kl, vl = leaves(q, k, v)
        fn(ql, kl, vl).sum().backward()
        grads[name] = (ql.grad, kl.grad, vl.grad)
    assert all(torch.equal(a, b) for a, b in zip(grads["compiled"], grads["eager"]))  # deterministic
    # d block / dq is 2 * dq at q * 2 (exact in bf16), for a dout of ones
    dq, dk, dv = grads["compiled"]
    check_gradients(torch.ones_like(q), q * 2, k, v, (dq / 2, dk, dv), causal=True)


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
def test_kvcache_device_index_check_runs_in_a_cuda_graph(rng):
    """index_check="device" never waits on the stream, so a decode step can be captured in a CUDA
    graph; replayed, it gives the eager (host-checked) call's bits. A bad cache_seqlens entry met
    by the kernels turns only its own sequence's rows NaN."""
    b, hq, hkv, d, page, pages = 2, 8, 2, 128, 16, 8
    k_cache, v_cache = (randn(rng, (b * pages, page, hkv, d), torch.bfloat16, "cuda") for _ in range(2))
    table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
    q = randn(rng, (b, 1, hq, d), torch.bfloat16, "cuda")
    k_new, v_new = (randn(rng, (b, 1, hkv, d), torch.bfloat16, "cuda") for _ in range(2))
    seqlens = torch.tensor([37, 100], dtype=torch.int32, device="cuda")
    kc_eager, vc_eager = k_cache.clone(), v_cache.clone()
    expected = flashattn.flash_attn_with_kvcache(q, kc_eager, vc_eager, k_new, v_new, cache_seqlens=seqlens,
                                                 block_table=table, num_splits=3, index_check="host")

    kc, vc = k_cache.clone(), v_cache.clone()
    step = lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,  # noqa: E731
                                                     block_table=table, num_splits=3, index_check="device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (the append rewrites the same rows)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)

    seqlens[0] = 1 << 20  # past the capacity: found by the kernels, not the host
    bad = flashattn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                            num_splits=3, index_check="device")
    assert torch.isnan(bad[0]).all() and torch.equal(bad[1], expected[1])
    with pytest.raises(ValueError, match=r"cache_seqlens: entry 0 is 1048576, outside \[0, 127\]"):
        flashattn.check_device_errors()


@cuda_only
def test_kvcache_bad_index_is_raised_after_the_asynchronous_call(rng):
    """The default index_check="device": a call with a bad block_table entry returns at once
    (NaN rows for its sequence); the entry is raised, named, by check_device_errors() or by the
    next call before it writes anything, once. index_check="host" raises at the call itself."""
    b, hq, hkv, d, page, pages = 3, 8, 2, 64, 16, 4
    k_cache, v_cache = (randn(rng, (b * pages, page, hkv, d), torch.float16, "cuda") for _ in range(2))
    table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
    q = randn(rng, (b, 1, hq, d), torch.float16, "cuda")
    seqlens = torch.tensor([40, 64, 9], dtype=torch.int32, device="cuda")
    good = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    bad_table = table.clone()
    bad_table[1, 2] = 5000
    message = r"block_table: entry \[1, 2\] is 5000, outside \[0, 12\)"
    with pytest.raises(ValueError, match=message):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=bad_table,
                                          index_check="host")
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=bad_table)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[0], good[0]) and torch.equal(out[2], good[2])
    with pytest.raises(ValueError, match=message):
        flashattn.check_device_errors(q.device)
    flashattn.check_device_errors()  # raised once: cleared

    flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=bad_table)
    torch.cuda.synchronize()
    given = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=message):  # the next call, before it writes
        flashattn.forward_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, out=given)
    assert torch.isnan(given).all()
    again = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(again, good)


@cuda_only
def test_varlen_bad_lengths_are_raised_after_the_asynchronous_call(rng):
    """flash_attn_varlen_func's default checks cu_seqlens on the GPU: a call with a bad entry returns
    at once with NaN outputs, and the host check's error is raised by check_device_errors() or by
    the next such call before it writes anything. index_check="host" raises at the call."""
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 9, 13, 19], dtype=torch.int32, device="cuda")
    q = randn(rng, (12, 4, 64), torch.float16, "cuda")
    k, v = (randn(rng, (19, 2, 64), torch.float16, "cuda") for _ in range(2))
    good = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True)
    bad_cu_k = cu_k.clone()
    bad_cu_k[2] = 8  # going backwards
    message = r"cu_seqlens_k: not monotone at entry 2 \(8 < 9\)"
    with pytest.raises(ValueError, match=message):
        flashattn.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=bad_cu_k, max_seqlen_q=7, max_seqlen_k=9,
                          index_check="host")
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, bad_cu_k, 7, 9, causal=True)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match=message + r".*varlen forward call"):
        flashattn.check_device_errors(q.device)
    flashattn.check_device_errors()  # raised once: cleared

    flashattn.flash_attn_varlen_func(q, k, v, cu_q, bad_cu_k, 7, 9, causal=True)
    given = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=message):  # the next call, before it writes
        flashattn.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=9,
                          causal=True, out=given)
    assert torch.isnan(given).all()
    again = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True)
    assert torch.equal(again, good)
    # A max_seqlen below a length is a broken rule too (the GPU grid is sized from it).
    flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 9, causal=True)
    with pytest.raises(ValueError, match=r"max_seqlen_q: 6 < length 7 of sequence 2"):
        flashattn.check_device_errors()


@cuda_only
def test_varlen_calls_run_in_a_cuda_graph(rng):
    """The default device check never waits on the stream: a varlen forward + backward
    (flashattn.forward / backward) and flash_attn_varlen_func's forward are captured in a CUDA
    graph and replay to the eager results. (Capturing torch.autograd.grad itself in this pattern
    fails inside the autograd engine with PyTorch's own SDPA as well, so it is not tested here.)"""
    cu_q = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 300, 357], dtype=torch.int32, device="cuda")
    q = randn(rng, (357, 8, 128), torch.bfloat16, "cuda")
    k, v = (randn(rng, (357, 2, 128), torch.bfloat16, "cuda") for _ in range(2))
    dout = randn(rng, (357, 8, 128), torch.bfloat16, "cuda")
    lengths = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=257, max_seqlen_k=236, causal=True)

    def step():
        out, lse = flashattn.forward(q, k, v, **lengths)
        grads = flashattn.backward(dout, q, k, v, out, lse, deterministic=True, **lengths)
        return (out, flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 257, 236, causal=True)) + grads

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    flashattn.check_device_errors()


@cuda_only
def test_backward_runs_on_the_current_stream(rng):
    q, k, v, dout = (randn(rng, (1, 512, 8, 128), torch.bfloat16, "cuda") for _ in range(4))
    out, lse = flashattn.forward(q, k, v)
    expected = flashattn.backward(dout, q, k, v, out, lse, deterministic=True)
    dout_late = torch.zeros_like(dout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # ~10 ms: dout_late is written long after this call returns
        dout_late.copy_(dout)
        # wrong unless it runs on `side` after the copy, its outputs and workspace with it
        grads = flashattn.backward(dout_late, q, k, v, out, lse, deterministic=True)
    side.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_workspace_from_the_pytorch_allocator(rng, device, monkeypatch):
    # The CUDA backward's scratch memory is a tensor of PyTorch's (stream-ordered) caching
    # allocator on q's device, 256-byte aligned; the CPU backend needs none.
    workspaces = []
    allocate = TorchFramework.workspace

    def spy(self, like, nbytes):
        workspaces.append(allocate(self, like, nbytes))
        return workspaces[-1]

    monkeypatch.setattr(TorchFramework, "workspace", spy)
    q, k, v, dout = (randn(rng, (2, 256, 4, 64), torch.bfloat16, device) for _ in range(4))
    out, lse = flashattn.forward(q, k, v)
    flashattn.backward(dout, q, k, v, out, lse)
    if device == "cpu":
        assert workspaces == []
        return
    assert len(workspaces) == 1
    ws = workspaces[0]
    assert ws.device == q.device and ws.dtype == torch.uint8 and ws.numel() > 0 and ws.data_ptr() % 256 == 0


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
    # the backward, its workspace from CuPy's (stream-ordered) memory pool
    dout = randn(rng, q.shape, torch.float16, "cuda")
    grads = flashattn.backward(cupy.from_dlpack(dout), cq, ck, cv, out, lse, causal=True, deterministic=True)
    expected_grads = flashattn.backward(dout, q, k, v, torch.from_dlpack(out), torch.from_dlpack(lse), causal=True,
                                        deterministic=True)
    for g, e in zip(grads, expected_grads):
        assert isinstance(g, cupy.ndarray) and torch.equal(torch.from_dlpack(g), e)


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
    # the backward, its outputs and (CUDA) workspace buffers of the extension
    dout = randn(rng, q.shape, torch.float16, device)
    grads = flashattn.backward(jax.device_put(to_numpy(dout), jax_device), jq, jk, jv, out, lse, causal=True,
                               deterministic=True)
    expected_grads = flashattn.backward(dout, q, k, v, *flashattn.forward(q, k, v, causal=True), causal=True,
                                        deterministic=True)
    for g, e in zip(grads, expected_grads):
        assert isinstance(g, jax.Array) and np.array_equal(np.asarray(g), to_numpy(e))


# ----------------------------------------------------------------------------- head_dim % 8 != 0, strided head_dim

def padded_everywhere(monkeypatch):
    """Pads head dims that are not a multiple of 8 on CPU tensors too (as on CUDA ones); returns
    the list of tensors padded, filled as the calls run."""
    monkeypatch.setattr(ops, "head_dim_padding", functools.partial(ops.head_dim_padding, always=True))
    padded = []
    pad_last = TorchFramework.pad_last
    monkeypatch.setattr(TorchFramework, "pad_last", lambda self, a, n: padded.append(a) or pad_last(self, a, n))
    return padded


@pytest.mark.parametrize("d", [5, 59])
def test_padded_autograd_cpu(rng, monkeypatch, d):
    # GQA and causal; gradients come back cut to head_dim d through the padding's autograd.
    padded = padded_everywhere(monkeypatch)
    q, k, v = leaves(*(randn(rng, (2, s, h, d), torch.bfloat16, "cpu") for s, h in ((50, 4), (77, 2), (77, 2))))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert len(padded) == 3 and out.shape == q.shape and lse.shape == (2, 4, 50)
    check_forward(q, k, v, out, lse, causal=True)
    check_autograd(rng, out, q, k, v, causal=True)


def test_padded_torch_compile_fullgraph(rng, monkeypatch):
    padded = padded_everywhere(monkeypatch)
    q, k, v = (randn(rng, (2, 64, 4, 20), torch.bfloat16, "cpu") for _ in range(3))

    def block(q, k, v):
        return flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), block(q, k, v))
    dout = randn(rng, q.shape, torch.bfloat16, "cpu")
    grads = {}
    for name, fn in (("compiled", compiled), ("eager", block)):
        ql, kl, vl = leaves(q, k, v)
        fn(ql, kl, vl).backward(dout)
        grads[name] = (ql.grad, kl.grad, vl.grad)
    assert padded and all(torch.equal(a, b) for a, b in zip(grads["compiled"], grads["eager"]))
    check_gradients(dout, q, k, v, grads["compiled"], causal=True)


def _skip_without_kernels_for(d):
    """Skips (saying why) where this build compiles no forward or backward kernel for the head-dim
    bucket that head_dim d runs in once padded (dev builds restrict FLASHATTN_CUDA_HEAD_DIMS)."""
    padded = -(-d // 8) * 8
    bucket = next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if b >= padded)
    names = flashattn.cuda_kernels()
    for direction in ("fwd", "bwd"):
        if not any(f"_{direction}_" in n and f"_d{bucket}" in n for n in names):
            pytest.skip(f"this build has no {direction} kernel for d{bucket} (FLASHATTN_CUDA_HEAD_DIMS)")


@cuda_only
@pytest.mark.parametrize("d", [1, 5, 33, 59, 72, 100, 111, 250])
def test_head_dims_not_a_multiple_of_8_cuda(rng, d):
    # The CUDA kernels take head_dim % 8 == 0: the others run zero-padded (72 needs none).
    _skip_without_kernels_for(d)
    q, k, v = leaves(*(randn(rng, (2, s, h, d), torch.bfloat16, "cuda") for s, h in ((97, 6), (130, 2), (130, 2))))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape
    check_forward(q, k, v, out, lse, causal=True)
    check_autograd(rng, out, q, k, v, causal=True)
    # flashattn.forward / backward (no autograd) pad too.
    dout = randn(rng, q.shape, torch.bfloat16, "cuda")
    out2, lse2 = flashattn.forward(q.detach(), k.detach(), v.detach(), causal=True)
    check_forward(q, k, v, out2, lse2, causal=True)
    grads = flashattn.backward(dout, q.detach(), k.detach(), v.detach(), out2, lse2, causal=True)
    check_gradients(dout, q, k, v, grads, causal=True)


@cuda_only
@pytest.mark.parametrize("d", [5, 59])
def test_kvcache_head_dim_not_a_multiple_of_8_cuda(rng, d):
    """Padded copies of the caches on CUDA: the caller's caches get the rows the CPU backend
    (which needs no padding) appends, bit for bit (rotary included where the head dim holds 16
    features), and out matches."""
    b, hq, hkv, capacity = 2, 4, 2, 64
    k_cache, v_cache = (randn(rng, (b, capacity, hkv, d), torch.float16, "cpu") for _ in range(2))
    q = randn(rng, (b, 1, hq, d), torch.float16, "cpu")
    k_new, v_new = (randn(rng, (b, 1, hkv, d), torch.float16, "cpu") for _ in range(2))
    seqlens = torch.tensor([3, 40], dtype=torch.int32)
    rot = d // 16 * 16  # the CUDA kernels rotate whole 16-feature groups (none at d 5)
    freqs = 10000.0 ** (-torch.arange(rot // 2) / max(rot // 2, 1))
    pos = torch.arange(capacity, dtype=torch.float32)[:, None] * freqs
    cos, sin = (pos.cos().half(), pos.sin().half()) if rot else (None, None)
    cpu = [t.clone() for t in (k_cache, v_cache)]
    want = flashattn.flash_attn_with_kvcache(q, *cpu, k_new, v_new, cos, sin, seqlens, causal=True)
    gpu = [t.cuda() for t in (k_cache, v_cache)]
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    got = flashattn.flash_attn_with_kvcache(q.cuda(), *gpu, k_new.cuda(), v_new.cuda(), cuda(cos), cuda(sin),
                                           seqlens.cuda(), causal=True)
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_head_dim_inputs_are_copied(rng, device):
    # flash_attn makes inputs with a strided last dimension contiguous; so does flashattn, with
    # autograd's gradients unchanged.
    q, k, v = (randn(rng, (2, 40, 4, 64), torch.bfloat16, device) for _ in range(3))
    strided = [t.repeat_interleave(2, dim=-1)[..., ::2] for t in (q, k, v)]
    assert all(t.stride(-1) == 2 for t in strided)
    dout = randn(rng, q.shape, torch.bfloat16, device)
    results = []
    for inputs in ((q, k, v), strided):
        ls = leaves(*inputs)
        out = flashattn.flash_attn_func(*ls, causal=True, deterministic=True)
        out.backward(dout.repeat_interleave(2, dim=-1)[..., ::2])
        results.append((out,) + tuple(t.grad for t in ls))
    assert all(torch.equal(a, b) for a, b in zip(*results))
