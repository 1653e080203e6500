"""flashattn.flex_attention and block masks through the Python package, on CPU tensors: outputs
and LSE against PyTorch's own flex_attention (eager) with the same BlockMask, and all of out, LSE
and gradients against PyTorch autograd of dense attention under the mask_mod's dense mask (eager
flex_attention has no CPU backward), for causal, document (random lengths), prefix-LM,
sliding-window-with-sink-tokens and per-(batch, head) masks, GQA, and block sizes other than the
default; the conversion's cache; flashattn.BlockMask on numpy arrays through flashattn.forward /
backward; clear errors."""
from __future__ import annotations

import numpy as np
import pytest

import flashattn

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")


def documents(rng, n):
    """Document ids of n tokens: random lengths, one of them a single token."""
    lengths, total = [], 0
    while total < n:
        lengths.append(int(min(n - total, 1 if len(lengths) == 1 else rng.integers(1, n // 2 + 2))))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def mask_mod_of(kind, rng, sq, sk):
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "document":
        doc = documents(rng, sq)
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    if kind == "prefix_lm":
        prefix = int(rng.integers(1, sq))
        return lambda b, h, q, kv: (kv < prefix) | (q >= kv)
    if kind == "window_sinks":  # a causal sliding window that keeps the first 4 tokens in view
        return lambda b, h, q, kv: (q >= kv) & ((q - kv <= 40) | (kv < 4))
    if kind == "per_head":  # batch- and head-dependent: each (b, h) its own stride pattern
        return lambda b, h, q, kv: ((q + kv + b) % (h + 2)) != 0
    raise ValueError(kind)


def inputs(rng, b, h, hkv, sq, sk, d, dtype):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    q = torch.randn(b, h, sq, d, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def dense_attention(q, k, v, return_lse=True, block_mask=None, enable_gqa=False, scale=None, dense_mask=None,
                    score_mod=None):
    """Attention written out in torch ops (differentiable): [b, h, s, d]; dense_mask bool
    [b|1, h|1, sq, sk]; score_mod called once on the whole score tensor with broadcasting
    indices; a row that sees no key gets out 0 and LSE -inf, as flex_attention's."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if score_mod is not None:
        index = [torch.arange(n).view([-1 if i == axis else 1 for i in range(4)]) for axis, n in enumerate(s.shape)]
        s = score_mod(s, *index)
    mask = torch.ones_like(s, dtype=torch.bool) if dense_mask is None else dense_mask.expand(s.shape)
    s = torch.where(mask, s, torch.zeros_like(s))
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.where(mask, torch.exp(s - safe[..., None]), torch.zeros_like(s))
    return torch.einsum("bhij,bhjd->bhid", p, v), lse


def run(fn, q, k, v, dout, **kw):
    for t in (q, k, v):
        t.grad = None
    out, lse = fn(q, k, v, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def assert_close(ours, theirs, tol):
    """Within tol of the larger of 1 and the result's scale; the LSE at float32's rounding at
    least (the library returns it in float32 whatever the inputs)."""
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, theirs):
        tol_here = max(tol, 2.0**-22) if name == "lse" else tol
        a, b = a.double(), b.double()
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{name}: -inf entries differ"
        finite = torch.isfinite(b)
        assert not torch.isnan(a).any(), f"{name}: NaN"
        err = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
        scale = max(1.0, b[finite].abs().max().item() if finite.any() else 0.0)
        assert err <= tol_here * scale, f"{name}: max error {err:.3g} > {tol_here * scale:.3g}"


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["causal", "document", "prefix_lm", "window_sinks", "per_head"])
@pytest.mark.parametrize("block", [128, (64, 32)], ids=["128", "64x32"])
def test_matches_torch_flex_attention(rng, kind, block):
    b, h, hkv, sq, d = 2, 4, 2, 203, 32
    mask_mod = mask_mod_of(kind, rng, sq, sq)
    heads = h if kind == "per_head" else None
    block_mask = flex.create_block_mask(mask_mod, b if kind == "per_head" else None, heads, sq, sq, device="cpu",
                                        BLOCK_SIZE=block)
    q, k, v = inputs(rng, b, h, hkv, sq, sq, d, torch.float64)
    dout = torch.randn(b, h, sq, d, dtype=torch.float64)
    kw = dict(block_mask=block_mask, enable_gqa=True, scale=0.3)
    ours = run(flashattn.flex_attention, q, k, v, dout, **kw)
    dense_mask = flex.create_mask(mask_mod, b if kind == "per_head" else 1, heads or 1, sq, sq, device="cpu")
    assert_close(ours, run(dense_attention, q, k, v, dout, dense_mask=dense_mask, **kw), 1e-10)
    with torch.no_grad():  # eager flex_attention: forward only on the CPU
        out, lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), return_lse=True, **kw)
    assert_close(ours[:2], (out, lse), 1e-10)


def used_lists(m, device="cpu"):
    """A flashattn.BlockMask's lists as {(b, h, qb): (partial key blocks, full key blocks)}."""
    counts, indices = m.kv_num_blocks.to(device), m.kv_indices.to(device)
    full_counts, full_indices = m.full_kv_num_blocks.to(device), m.full_kv_indices.to(device)
    return {(b, h, qb): (indices[b, h, qb, :int(counts[b, h, qb])].tolist(),
                         full_indices[b, h, qb, :int(full_counts[b, h, qb])].tolist())
            for b in range(counts.shape[0]) for h in range(counts.shape[1]) for qb in range(counts.shape[2])}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["causal", "document", "window_sinks", "per_head"])
@pytest.mark.parametrize("block", [(32, 32), (64, 32), (16, 128)], ids=["32", "64x32", "16x128"])
def test_small_blocks_regrouped_as_create_block_mask_would(rng, kind, block):
    """A mask of small blocks regrouped into 128 x 128 ones (what CUDA calls do) has the lists and
    element bits create_block_mask gives at 128 x 128 for the same mask_mod, and the same result."""
    from flashattn.flex import block_mask_from_torch, cuda_block_size

    assert cuda_block_size(block) == (128, 128) and cuda_block_size((128, 128)) is None
    assert cuda_block_size((256, 128)) is None and cuda_block_size((48, 48)) is None
    b, h, sq, sk = 2, 3, 333, 333
    mask_mod = mask_mod_of(kind, rng, sq, sk)
    batch, heads = (b, h) if kind == "per_head" else (None, None)
    small = flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu", BLOCK_SIZE=block)
    large = flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu")
    regrouped = block_mask_from_torch(small, sq, sk, block_size=(128, 128))
    direct = block_mask_from_torch(large, sq, sk)
    assert regrouped.block_size == (128, 128)
    assert used_lists(regrouped) == used_lists(direct)
    assert torch.equal(regrouped.bits_block, direct.bits_block)
    assert torch.equal(regrouped.bits, direct.bits)
    q, k, v = inputs(rng, b, h, h, sq, sk, 16, torch.float64)
    kw = dict(softmax_scale=0.3)
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
    out, lse = flashattn.forward(qt, kt, vt, block_mask=regrouped, **kw)
    ref_out, ref_lse = flashattn.forward(qt, kt, vt, block_mask=block_mask_from_torch(small, sq, sk), **kw)
    assert_close((out, lse), (ref_out, ref_lse), 1e-12)
    with pytest.raises(ValueError, match=r"block_mask: block size \(100, 128\) is not a whole number"):
        block_mask_from_torch(small, sq, sk, block_size=(100, 128))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_float32_and_no_mask(rng):
    q, k, v = inputs(rng, 1, 2, 2, 150, 170, 64, torch.float32)
    dout = torch.randn(1, 2, 150, 64)
    assert_close(run(flashattn.flex_attention, q, k, v, dout), run(dense_attention, q, k, v, dout), 2e-5)
    out = flashattn.flex_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_conversion_is_cached(rng):
    calls = []

    def causal(b, h, q, kv):
        calls.append(1)
        return q >= kv

    block_mask = flex.create_block_mask(causal, None, None, 300, 300, device="cpu")
    q, k, v = inputs(rng, 1, 2, 2, 300, 300, 32, torch.float32)
    calls.clear()
    first = flashattn.flex_attention(q, k, v, block_mask=block_mask)
    assert calls, "mask_mod was not evaluated for the partial blocks"
    calls.clear()
    second = flashattn.flex_attention(q, k, v, block_mask=block_mask)
    assert not calls, "the converted mask was not reused"
    assert torch.equal(first, second)


def assert_form_matches_lists_and_dense(q, k, v, dout, mask_mod, block_mask, **kw):
    """flex_attention under a PyTorch mask that runs as one of the forms: out, LSE and gradients
    equal the same mask's run as lists, and dense autograd's under its element mask."""
    from flashattn.flex import block_mask_from_torch

    sq, sk = q.shape[2], k.shape[2]
    ours = run(flashattn.flex_attention, q, k, v, dout, block_mask=block_mask, **kw)
    lists = run(flashattn.flex_attention, q, k, v, dout, block_mask=block_mask_from_torch(block_mask, sq, sk), **kw)
    assert_close(ours, lists, 1e-12)
    dense_mask = flex.create_mask(mask_mod, 1, 1, sq, sk, device="cpu")
    assert_close(ours, run(dense_attention, q, k, v, dout, dense_mask=dense_mask, **kw), 1e-10)


WINDOW_MASKS = {  # mask_mod (given seqlen_q, seqlen_kv) -> the (window_left, window_right) it is
    "causal": (lambda sq, sk: lambda b, h, q, kv: q + (sk - sq) >= kv, (-1, 0)),
    "window": (lambda sq, sk: lambda b, h, q, kv: (kv - q - (sk - sq) <= 7) & (q + (sk - sq) - kv <= 50), (50, 7)),
    "all": (lambda sq, sk: lambda b, h, q, kv: kv >= 0, (-1, -1)),
}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", sorted(WINDOW_MASKS))
@pytest.mark.parametrize("lengths", [(203, 203), (150, 290), (290, 150)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("block", [128, (64, 32)], ids=["128", "64x32"])
def test_window_masks_run_as_the_librarys_mask(rng, kind, lengths, block):
    """A mask_mod that is a causal / sliding-window mask, bottom-right aligned, runs as the
    library's window; its results equal the lists' run and dense autograd's."""
    from flashattn.flex import _converted

    sq, sk = lengths
    make, window = WINDOW_MASKS[kind]
    mask_mod = make(sq, sk)
    block_mask = flex.create_block_mask(mask_mod, None, None, sq, sk, device="cpu", BLOCK_SIZE=block)
    assert _converted(block_mask, sq, sk)[1].window == window
    q, k, v = inputs(rng, 2, 4, 2, sq, sk, 16, torch.float64)
    dout = torch.randn(2, 4, sq, 16, dtype=torch.float64)
    kw = dict(enable_gqa=True, scale=0.3)
    assert_form_matches_lists_and_dense(q, k, v, dout, mask_mod, block_mask, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("block", [128, (64, 32)], ids=["128", "64x32"])
def test_document_masks_run_as_varlen_calls(rng, causal, block):
    """A mask_mod of packed documents (one of a single token; causal within each or not) runs as
    varlen calls over the documents, one per batch entry; results equal the lists' run and dense
    autograd's, with softcap and per-batch ALiBi score_mods and GQA."""
    from flashattn import score_mods
    from flashattn.flex import _converted

    b, h, hkv, n, d = 2, 4, 2, 333, 16
    doc = documents(rng, n)
    if causal:
        mask_mod = lambda b_, h_, q, kv: (doc[q] == doc[kv]) & (q >= kv)  # noqa: E731
    else:
        mask_mod = lambda b_, h_, q, kv: doc[q] == doc[kv]  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=block)
    form = _converted(block_mask, n, n)[1]
    lengths = torch.bincount(doc).tolist()
    assert form.window is None and form.documents[2] == causal and form.documents[1] == max(lengths)
    assert torch.diff(form.documents[0]).tolist() == lengths
    q, k, v = inputs(rng, b, h, hkv, n, n, d, torch.float64)
    dout = torch.randn(b, h, n, d, dtype=torch.float64)
    score_mod = score_mods.chain(score_mods.softcap(2.0), score_mods.alibi(torch.rand(b, h).double()))
    kw = dict(enable_gqa=True, scale=0.3, score_mod=score_mod)
    assert_form_matches_lists_and_dense(q, k, v, dout, mask_mod, block_mask, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("prefix", [1, 77, 128, 200])
def test_prefix_lm_masks_run_as_two_dense_calls(rng, prefix):
    """A prefix-LM mask_mod (the first keys visible to every row, causal after them) runs as two
    dense calls; results equal the lists' run and dense autograd's, with score_mods and GQA."""
    from flashattn import score_mods
    from flashattn.flex import _converted

    b, h, hkv, n, d = 2, 4, 2, 203, 16
    mask_mod = lambda b_, h_, q, kv: (kv < prefix) | (q >= kv)  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, None, None, n, n, device="cpu")
    form = _converted(block_mask, n, n)[1]
    assert (form.prefix, form.window) == ((prefix, None) if prefix > 1 else (None, (-1, 0)))  # 1: causal
    q, k, v = inputs(rng, b, h, hkv, n, n, d, torch.float64)
    dout = torch.randn(b, h, n, d, dtype=torch.float64)
    score_mod = score_mods.chain(score_mods.softcap(2.0), score_mods.alibi((torch.rand(h) * 0.3).double()))
    kw = dict(enable_gqa=True, scale=0.3, score_mod=score_mod)
    assert_form_matches_lists_and_dense(q, k, v, dout, mask_mod, block_mask, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["top_left_causal", "one_element_off", "prefix_bidirectional_tail", "per_head",
                                  "window_one_block_off", "document_one_element_off", "window_sinks"])
def test_near_windows_keep_their_lists(rng, kind):
    """Masks that are not one of the forms, some differing from one in a single element or block,
    or only in their batch / head dependence, keep the lists (and their results); so does a window
    with sink tokens, which runs faster as lists."""
    from flashattn.flex import _converted

    sq, sk = (203, 203) if kind.startswith(("document", "prefix")) else (203, 290)
    batch = heads = None
    if kind == "top_left_causal":  # causal aligned at the top left: no window of the library's form
        mask_mod = lambda b, h, q, kv: q >= kv  # noqa: E731
    elif kind == "one_element_off":
        mask_mod = lambda b, h, q, kv: (q + sk - sq >= kv) & ~((q == 100) & (kv == 5))  # noqa: E731
    elif kind == "window_one_block_off":  # a window, and one more element far from it
        diag = sk - sq
        mask_mod = lambda b, h, q, kv: (  # noqa: E731
            ((q + diag >= kv) & (q + diag - kv <= 20)) | ((q == 150) & (kv == 3)))
    elif kind == "prefix_bidirectional_tail":  # a prefix-LM whose last row also sees one key ahead of it
        mask_mod = lambda b, h, q, kv: (kv < 50) | (q >= kv) | ((q == 150) & (kv == 151))  # noqa: E731
    elif kind == "document_one_element_off":
        doc = documents(rng, sq)
        mask_mod = lambda b, h, q, kv: ((doc[q] == doc[kv]) & (q >= kv)) | ((q == 180) & (kv == 0))  # noqa: E731
    elif kind == "window_sinks":
        mask_mod = lambda b, h, q, kv: (q + sk - sq >= kv) & ((q + sk - sq - kv <= 40) | (kv < 4))  # noqa: E731
    elif kind == "per_head":  # causal for some heads only
        batch, heads = 2, 4
        mask_mod = lambda b, h, q, kv: (q + sk - sq >= kv) | (h == 3)  # noqa: E731
    else:
        mask_mod = mask_mod_of(kind, rng, sq, sk)
    block_mask = flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu")
    assert _converted(block_mask, sq, sk)[1] is None
    q, k, v = inputs(rng, 2, 4, 4, sq, sk, 16, torch.float64)
    dout = torch.randn(2, 4, sq, 16, dtype=torch.float64)
    dense_mask = flex.create_mask(mask_mod, batch or 1, heads or 1, sq, sk, device="cpu")
    assert_close(run(flashattn.flex_attention, q, k, v, dout, block_mask=block_mask),
                 run(dense_attention, q, k, v, dout, dense_mask=dense_mask), 1e-10)


def catalogue_score_mod(kind, b, h, sq, sk):
    from flashattn import score_mods

    slopes = (torch.rand(h) * 0.3).double()  # float32 values: the kernels take float32 slopes
    if kind == "softcap":
        return score_mods.softcap(2.5)
    if kind == "alibi":
        return score_mods.alibi(slopes, sq, sk)
    if kind == "alibi_per_batch":
        return score_mods.alibi(torch.rand(b, h).double(), sq, sk)
    return score_mods.chain(score_mods.softcap(1.5), score_mods.alibi(slopes, sq, sk))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["softcap", "alibi", "alibi_per_batch", "softcap_alibi"])
@pytest.mark.parametrize("mask", ["none", "causal", "document"])
def test_catalogue_score_mods_match_torch_flex_attention(rng, kind, mask):
    """flashattn.score_mods' modifiers, run in the kernels, against PyTorch's flex_attention (eager)
    running the same callables, and against dense autograd of them; with masks and GQA."""
    b, h, hkv, sq, sk, d = 2, 4, 2, 150, 230 if mask == "causal" else 150, 32
    score_mod = catalogue_score_mod(kind, b, h, sq, sk)
    kw = dict(enable_gqa=True, scale=0.3, score_mod=score_mod)
    dense_mask = None
    if mask != "none":
        mask_mod = (lambda b_, h_, q, kv: q + sk - sq >= kv) if mask == "causal" else mask_mod_of(mask, rng, sq, sk)
        kw["block_mask"] = flex.create_block_mask(mask_mod, None, None, sq, sk, device="cpu")
        dense_mask = flex.create_mask(mask_mod, 1, 1, sq, sk, device="cpu")
    q, k, v = inputs(rng, b, h, hkv, sq, sk, d, torch.float64)
    dout = torch.randn(b, h, sq, d, dtype=torch.float64)
    ours = run(flashattn.flex_attention, q, k, v, dout, **kw)
    dense_kw = {key: value for key, value in kw.items() if key != "block_mask"}
    assert_close(ours, run(dense_attention, q, k, v, dout, dense_mask=dense_mask, **dense_kw), 1e-10)
    with torch.no_grad():
        out, lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), return_lse=True, **kw)
    assert_close(ours[:2], (out, lse), 1e-10)


def test_score_mods_refused_by_name(rng):
    from flashattn import score_mods

    q, k, v = inputs(rng, 1, 2, 2, 64, 80, 16, torch.float32)
    slopes = torch.ones(2)
    with pytest.raises(ValueError, match=r"alibi built for seqlen_kv - seqlen_q = 0, the call has 80 - 64"):
        flashattn.flex_attention(q, k, v, score_mod=score_mods.alibi(slopes))
    with pytest.raises(NotImplementedError, match="ALiBi slopes that require grad"):
        flashattn.flex_attention(q, k, v, score_mod=score_mods.alibi(slopes.requires_grad_(), 64, 80))
    with pytest.raises(ValueError, match="softcap after another softcap or after ALiBi"):
        score_mods.chain(score_mods.alibi(torch.ones(2)), score_mods.softcap(3.0))
    with pytest.raises(ValueError, match="two ALiBi"):
        score_mods.chain(score_mods.alibi(torch.ones(2)), score_mods.alibi(torch.ones(2)))
    with pytest.raises(ValueError, match="cap must be positive"):
        score_mods.softcap(0.0)
    with pytest.raises(ValueError, match=r"slopes must be a floating-point tensor of \[heads\]"):
        score_mods.alibi(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="alibi_slopes"):  # the library's own check of their shape
        flashattn.flex_attention(q, k, v, score_mod=score_mods.alibi(torch.ones(3), 64, 80))


def full_numpy_mask(sq, sk, block=(32, 32)):
    """A flashattn.BlockMask on numpy arrays listing every block full."""
    qb, kb = -(-sq // block[0]), -(-sk // block[1])
    zeros = np.zeros((1, 1, qb), np.int32)
    index = np.broadcast_to(np.arange(kb, dtype=np.int32), (1, 1, qb, kb)).copy()
    return flashattn.BlockMask(zeros, np.zeros((1, 1, qb, kb), np.int32), np.full((1, 1, qb), kb, np.int32), index,
                               block_size=block)


def test_numpy_block_mask_all_full_is_no_mask(rng):
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in ((2, 70, 2, 16), (2, 90, 1, 16),
                                                                           (2, 90, 1, 16), (2, 70, 2, 16)))
    bm = full_numpy_mask(70, 90)
    out, lse = flashattn.forward(q, k, v, block_mask=bm)
    ref_out, ref_lse = flashattn.forward(q, k, v)
    assert np.array_equal(out, ref_out) and np.array_equal(lse, ref_lse)
    grads = flashattn.backward(dout, q, k, v, out, lse, block_mask=bm)
    ref_grads = flashattn.backward(dout, q, k, v, out, lse)
    assert all(np.array_equal(a, b) for a, b in zip(grads, ref_grads))


def test_errors_name_the_argument(rng):
    q, k, v = inputs(rng, 1, 2, 2, 64, 64, 16, torch.float32)
    with pytest.raises(NotImplementedError, match="score_mod: flashattn.flex_attention runs flashattn.score_mods'"):
        flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashattn.flex_attention(q, k[:, :1], v[:, :1])
    block_mask = flex.create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    with pytest.raises(ValueError, match="block_mask: built for sequences"):
        flashattn.flex_attention(q, k, v, block_mask=block_mask)
    qn = np.zeros((1, 64, 2, 16), np.float32)
    with pytest.raises(TypeError, match="block_mask: expected a flashattn.BlockMask"):
        flashattn.forward(qn, qn, qn, block_mask=block_mask)
    bm = full_numpy_mask(64, 64)
    bm.kv_indices = bm.kv_indices.astype(np.int64)
    with pytest.raises(TypeError, match="block_mask.kv_indices: dtype int64 must be int32"):
        flashattn.forward(qn, qn, qn, block_mask=bm)
    bm = full_numpy_mask(64, 64, block=(16, 16))
    kv = np.zeros((1, 65, 2, 16), np.float32)
    with pytest.raises(ValueError, match="do not cover seqlen_q 64 x seqlen_k 65"):
        flashattn.forward(qn, kv, kv, block_mask=bm)


def _cuda():
    if not (torch.cuda.is_available() and flashattn.cuda_compiled()):
        pytest.skip("no CUDA device, or a package built without the CUDA kernels")


def _family(monkeypatch, family, dtype, d):
    """Runs the block-sparse calls of this test on `family`'s kernel: "sm90" the Hopper one (skipped
    where the device or the build has none), "sm80" the sm80 one (on Hopper too)."""
    if family == "sm80":
        monkeypatch.setenv("FLASHATTN_DISABLE_SM90", "1")
        return
    name = "sm90_fwd_%s_d%d_masked_blocksparse" % ("bf16" if dtype == torch.bfloat16 else "fp16", d)
    if torch.cuda.get_device_capability() != (9, 0) or name not in flashattn.cuda_kernels():
        pytest.skip(f"{name}: not on this device or not in this build")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("kind", ["causal", "document", "window_sinks", "per_head"])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64)], ids=["bf16-d128", "fp16-d64"])
def test_cuda_forward_matches_the_cpu(rng, monkeypatch, family, kind, dtype, d):
    """The CUDA forward under a block mask (the masks built on the GPU, at PyTorch's 128 x 128
    blocks), on each kernel family, against the CPU backend's float64 forward on the same rounded
    inputs, with GQA and rows that see no key (the document mask's, past a short last document)."""
    _cuda()
    _family(monkeypatch, family, dtype, d)
    from flashattn.flex import block_mask_from_torch

    b, h, hkv, sq = 2, 4, 2, 700
    heads = h if kind == "per_head" else None
    doc = documents(rng, sq)

    def block_mask_on(device):  # the same mask built on either device
        if kind == "document":
            ids = doc.to(device)
            mask_mod = lambda b_, h_, q_, kv: (ids[q_] == ids[kv]) & (q_ >= kv)  # noqa: E731
        else:
            mask_mod = mask_mod_of(kind, rng, sq, sq)  # (these kinds draw nothing from rng)
        return flex.create_block_mask(mask_mod, b if kind == "per_head" else None, heads, sq, sq, device=device)

    q, k, v = (x.detach().to("cuda", dtype) for x in inputs(rng, b, h, hkv, sq, sq, d, torch.float32))
    lists = block_mask_from_torch(block_mask_on("cuda"), sq, sq)  # the lists, even where a window would serve
    out, lse = flashattn.flex_attention(q, k, v, block_mask=lists, enable_gqa=True, return_lse=True)
    assert out.device.type == "cuda" and out.dtype == dtype
    ref_out, ref_lse = flashattn.flex_attention(*(x.cpu().double() for x in (q, k, v)), block_mask=block_mask_on("cpu"),
                                                enable_gqa=True, return_lse=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close((out.cpu(), lse.cpu()), (ref_out, ref_lse), tol)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["causal", "document", "per_head"])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64)], ids=["bf16-d128", "fp16-d64"])
def test_cuda_backward_matches_the_cpu(rng, kind, dtype, d):
    """The CUDA backward under a block mask (the sm80 kernel through the lists' transpose, on
    Hopper too), with GQA and rows that see no key, against the CPU backend's float64 backward on
    the same rounded inputs and dout; in deterministic mode bitwise equal over reruns."""
    _cuda()
    from flashattn.flex import block_mask_from_torch

    b, h, hkv, sq = 2, 4, 2, 700
    doc = documents(rng, sq)

    def block_mask_on(device):
        if kind == "document":
            ids = doc.to(device)
            mask_mod = lambda b_, h_, q_, kv: (ids[q_] == ids[kv]) & (q_ >= kv)  # noqa: E731
        else:
            mask_mod = mask_mod_of(kind, rng, sq, sq)
        heads = h if kind == "per_head" else None
        return flex.create_block_mask(mask_mod, b if kind == "per_head" else None, heads, sq, sq, device=device)

    xs_cuda = [x.detach().to("cuda", dtype) for x in inputs(rng, b, h, hkv, sq, sq, d, torch.float32)]
    dout = torch.randn(b, h, sq, d, dtype=torch.float32).to(dtype)

    def grads(xs, mask):
        xs = [x.detach().requires_grad_() for x in xs]
        out = flashattn.flex_attention(*xs, block_mask=mask, enable_gqa=True)
        out.backward(dout.to(out.device, out.dtype))
        return [x.grad for x in xs]

    got = grads(xs_cuda, block_mask_from_torch(block_mask_on("cuda"), sq, sq))  # the lists, not a window
    want = grads([x.cpu().double() for x in xs_cuda], block_mask_on("cpu"))
    tol = 3e-2 if dtype == torch.bfloat16 else 6e-3
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err = (g.cpu().double() - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"{name}: max error {err}"

    # Deterministic mode: the key tiles take their turns at each query tile's dQ as the block mask says.
    mask = block_mask_from_torch(block_mask_on("cuda"), sq, sq, torch.device("cuda"), None)
    q, k, v = (x.transpose(1, 2) for x in xs_cuda)
    out, lse = flashattn.forward(q, k, v, block_mask=mask)
    first = flashattn.backward(dout.to("cuda").transpose(1, 2), q, k, v, out, lse, block_mask=mask, deterministic=True)
    for _ in range(3):
        again = flashattn.backward(dout.to("cuda").transpose(1, 2), q, k, v, out, lse, block_mask=mask,
                                   deterministic=True)
        assert all(torch.equal(a, b_) for a, b_ in zip(first, again))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["causal", "window"])
def test_cuda_window_masks_run_the_dense_kernels(rng, kind):
    """A PyTorch mask that is the library's window runs the dense kernels' window: out, LSE, dK and
    dV bitwise those of flashattn.forward / backward with that window, dQ as close as two runs of
    the backward's atomic adds are."""
    _cuda()
    sq, sk = 300, 700
    make, window = WINDOW_MASKS[kind]
    block_mask = flex.create_block_mask(make(sq, sk), None, None, sq, sk, device="cuda")
    q, k, v = (x.detach().to("cuda", torch.bfloat16).requires_grad_()
               for x in inputs(rng, 2, 4, 2, sq, sk, 128, torch.float32))
    dout = torch.randn(2, 4, sq, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flashattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kw = dict(window_size=window, softmax_scale=128**-0.5)
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
    want_out, want_lse = flashattn.forward(qt, kt, vt, **kw)
    want = [w.transpose(1, 2) for w in flashattn.backward(dout.transpose(1, 2), qt, kt, vt, want_out, want_lse, **kw)]
    assert torch.equal(out, want_out.transpose(1, 2)) and torch.equal(lse, want_lse)
    assert torch.equal(grads[1], want[1]) and torch.equal(grads[2], want[2])
    assert (grads[0].float() - want[0].float()).abs().max() <= 2**-7 * want[0].float().abs().max()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind,mask", [("softcap", "causal"), ("alibi_per_batch", "causal"), ("softcap_alibi", "causal"),
                                       ("none", "document"), ("alibi_per_batch", "document"), ("none", "prefix_lm"),
                                       ("softcap_alibi", "prefix_lm")])
def test_cuda_score_mods_and_forms_match_the_cpu(rng, kind, mask):
    """flashattn.score_mods' modifiers on CUDA tensors, under a causal PyTorch mask (run as a window),
    a document one (varlen calls) or a prefix-LM (two dense calls), with GQA, against the CPU
    backend's float64 forward and backward on the same rounded inputs."""
    _cuda()
    b, h, hkv, sq, sk, d = 2, 4, 2, 300, 500 if mask == "causal" else 300, 128
    score_mod = None if kind == "none" else catalogue_score_mod(kind, b, h, sq, sk)
    doc = documents(rng, sq)

    def grads(xs, device):
        ids = doc.to(device)
        mask_mod = {"causal": lambda b_, h_, q, kv: q + sk - sq >= kv,
                    "document": lambda b_, h_, q, kv: (ids[q] == ids[kv]) & (q >= kv),
                    "prefix_lm": lambda b_, h_, q, kv: (kv < 77) | (q >= kv)}[mask]
        block_mask = flex.create_block_mask(mask_mod, None, None, sq, sk, device=device)
        xs = [x.detach().to(device).requires_grad_() for x in xs]
        out = flashattn.flex_attention(*xs, block_mask=block_mask, score_mod=score_mod, enable_gqa=True)
        return [out.detach().cpu().double()] + [g.cpu().double() for g in
                                                 torch.autograd.grad(out, xs, dout.to(device, out.dtype))]

    xs = [x.detach().to(torch.bfloat16) for x in inputs(rng, b, h, hkv, sq, sk, d, torch.float32)]
    dout = torch.randn(b, h, sq, d).to(torch.bfloat16)
    got = grads(xs, "cuda")
    want = grads([x.double() for x in xs], "cpu")
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = (g - w).abs().max().item()
        assert err <= 3e-2 * max(1.0, w.abs().max().item()), f"{name}: max error {err}"


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_cuda_refusals_name_the_block_mask(rng):
    """What the CUDA kernels do not take yet is refused by name, before anything is written:
    blocks that are not whole kernel tiles (flashattn.BlockMask's; flex_attention regroups a
    PyTorch mask's small blocks)."""
    _cuda()
    q, k, v = (x.detach().to("cuda", torch.bfloat16).requires_grad_()
               for x in inputs(rng, 1, 2, 2, 256, 256, 128, torch.float32))
    from flashattn.flex import block_mask_from_torch

    mask_mod = lambda b, h, i, j: (i >= j) & (j % 3 != 1)  # noqa: E731 (not a window: run as lists)
    small = flex.create_block_mask(mask_mod, None, None, 256, 256, device="cuda", BLOCK_SIZE=(32, 32))
    with pytest.raises(Exception,
                       match=r"block_mask: block size \(32, 32\) must be a multiple of the CUDA forward kernel's"):
        flashattn.forward(*(x.detach().transpose(1, 2) for x in (q, k, v)),
                          block_mask=block_mask_from_torch(small, 256, 256))
    # flex_attention regroups PyTorch masks of small blocks into 128 x 128 ones: the large mask's result.
    large = flex.create_block_mask(mask_mod, None, None, 256, 256, device="cuda")
    with torch.no_grad():
        assert torch.equal(flashattn.flex_attention(q, k, v, block_mask=small),
                           flashattn.flex_attention(q, k, v, block_mask=large))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_lists_checked_by_the_kernel(rng, monkeypatch, family):
    """index_check="device" (the default) leaves a GPU block mask's lists to the kernel (each
    family's): good lists give the host-checked call's result bitwise; a key block listed twice
    gives its query tile's rows NaN (and no other row), and is raised later, naming the entry, by
    the next device-checked call or flashattn.check_device_errors(), once."""
    _cuda()
    _family(monkeypatch, family, torch.bfloat16, 64)
    from flashattn.flex import block_mask_from_torch

    q, k, v = (x.detach().to("cuda", torch.bfloat16).transpose(1, 2)
               for x in inputs(rng, 1, 2, 2, 256, 256, 64, torch.float32))  # [b, s, h, d] views
    causal = block_mask_from_torch(flex.create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256,
                                                          device="cuda"), 256, 256)
    flashattn.check_device_errors()
    out, lse = flashattn.forward(q, k, v, block_mask=causal)
    ref_out, ref_lse = flashattn.forward(q, k, v, block_mask=causal, index_check="host")
    flashattn.check_device_errors()  # nothing recorded
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)

    # Query block 1 lists key block 1 as partial (the diagonal) and, here, as full too.
    full_indices = causal.full_kv_indices.clone()
    full_indices[..., 1, 0] = 1
    twice = flashattn.BlockMask(causal.kv_num_blocks, causal.kv_indices, causal.full_kv_num_blocks, full_indices,
                                causal.bits, causal.bits_block, causal.block_size)
    out, lse = flashattn.forward(q, k, v, block_mask=twice)
    torch.cuda.synchronize()
    assert torch.isnan(out[:, 128:]).all() and torch.isnan(lse[:, :, 128:]).all()
    assert torch.equal(out[:, :128], ref_out[:, :128]) and torch.equal(lse[:, :, :128], ref_lse[:, :, :128])
    with pytest.raises(ValueError, match=r"block_mask: key block 1 listed twice at \(batch 0, head \d, query block 1\)"):
        flashattn.forward(q, k, v, block_mask=causal)
    flashattn.check_device_errors()  # raised once, then cleared

    # A count past the key blocks: query block 0's rows NaN, the others as before.
    counts = causal.kv_num_blocks.clone()
    counts[..., 0] = 5
    too_many = flashattn.BlockMask(counts, causal.kv_indices, causal.full_kv_num_blocks, causal.full_kv_indices,
                                   causal.bits, causal.bits_block, causal.block_size)
    out, lse = flashattn.forward(q, k, v, block_mask=too_many)
    torch.cuda.synchronize()
    assert torch.isnan(out[:, :128]).all() and torch.isnan(lse[:, :, :128]).all()
    assert torch.equal(out[:, 128:], ref_out[:, 128:]) and torch.equal(lse[:, :, 128:], ref_lse[:, :, 128:])
    with pytest.raises(ValueError, match=r"block_mask: kv_num_blocks 5 at \(batch 0, head \d, query block 0\) "
                                         r"outside \[0, 2\]"):
        flashattn.check_device_errors()
