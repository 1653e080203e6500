"""Array-agnostic forward and backward: numpy (ml_dtypes bfloat16 too), PyTorch, CuPy and JAX arrays
in, the same framework's arrays out, on the inputs' device and (CUDA) the caller's current stream.

Layouts (docs/ARCHITECTURE.md): dense q [batch, seqlen_q, heads, head_dim], k / v
[batch, seqlen_k, heads_kv, head_dim], lse float32 [batch, heads, seqlen_q]; with cu_seqlens_*
(int32 prefix sums, [batch + 1]) q / k / v are [total, heads, head_dim] and lse is
[heads, total_q]. Every argument is checked by the library before any memory is touched.
"""
from __future__ import annotations

import secrets

from . import _ext
from ._arrays import framework_of


def _window(window_size):
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None


def _seed(dropout_p, seed, needs_seed):
    if dropout_p and seed is None:
        if needs_seed:
            raise ValueError("seed: the backward pass with dropout_p > 0 needs the forward's seed")
        return secrets.randbits(63)
    return 0 if seed is None else int(seed)


def _max_seqlen(given, cu_seqlens):
    """max_seqlen_* as given, else the longest sequence of cu_seqlens_* (0 when dense)."""
    if given is not None:
        return int(given)
    if cu_seqlens is None or len(cu_seqlens) < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _optional(fw, a):
    """An output array (or None) as the extension takes it."""
    return None if a is None else fw.to_ext(a)


def _input(fw, a):
    """An input array (or None) as the extension takes it, its last dimension made contiguous
    (a copy) where it is strided, as flash_attn does."""
    return None if a is None else fw.to_ext(fw.unit_last_stride(a))


_INT32 = ("int32", "torch.int32")


def _index(fw, a, name):
    """An index input (cu_seqlens_*, seqused_k, cache_*, block_table): int32 or a TypeError
    naming the argument and its dtype (frameworks default to int64; the DLPack import would
    only say that the type is unsupported), then as _input."""
    dtype = str(getattr(a, "dtype", "int32"))  # no dtype (None, not an array): the extension judges it
    if dtype not in _INT32:
        dtype = dtype.removeprefix("torch.")
        raise TypeError(f"{name}: dtype {dtype} must be int32 (int32 expected, got {dtype})")
    return _input(fw, a)


def head_dim_padding(fw, q, *others, always=False) -> int:
    """The zero columns to append to head_dim so that the CUDA kernels, which read rows of 16
    bytes, take it (they need head_dim % 8 == 0; flash_attn pads too): 0 for none. CPU arrays
    take any head_dim and are never padded unless `always` (tests run the padded path on the CPU
    with it). Not padded either: head_dims beyond 256 or differing between q and `others`
    (None entries are skipped), which the library then reports as the caller gave them."""
    d = q.shape[-1]
    if d % 8 == 0 or d > 256 or any(a is not None and a.shape[-1] != d for a in others):
        return 0
    return 8 - d % 8 if always or fw.on_cuda(q) else 0


def _scale(softmax_scale, d):
    """softmax_scale, or its default 1 / sqrt(d) for the caller's head_dim d (explicit: a padded
    call's head_dim is larger). None and 0 mean the default."""
    return softmax_scale if softmax_scale else d ** -0.5


def _check_given(fw, given, like, name):
    """Checks an output array the caller gave for a padded call, which the library never sees
    (it writes a padded temporary, copied into `given` afterwards): like's shape and dtype, and a
    contiguous last dimension, as the library would require."""
    if given is None:
        return
    if tuple(given.shape) != tuple(like.shape):
        raise ValueError(f"{name}: shape {list(given.shape)} != expected {list(like.shape)}")
    if given.dtype != like.dtype:
        raise TypeError(f"{name}: dtype {given.dtype} != q dtype {like.dtype}")
    stride = fw.last_stride(given)
    if stride != 1:
        raise ValueError(f"{name}: head_dim stride {stride} must be 1 (the last dimension must be contiguous)")


def _unpadded(fw, padded, d, given):
    """A padded call's result cut back to head_dim d, written into the caller's array if given."""
    result = padded[..., :d]
    if given is None:
        return result
    fw.copy_into(given, result)
    return given


def forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, seed=None, out=None, lse=None, block_table=None):
    """Attention forward: returns (out, lse).

    softmax_scale defaults to 1 / sqrt(head_dim). Masks align bottom-right: query row i sees key
    j iff i + sk - sq - window_left <= j <= i + sk - sq + window_right (-1: unbounded side);
    causal sets window_right = 0. softcap > 0 applies softcap * tanh(s / softcap) to the scaled
    scores; alibi_slopes (float32 [heads] or [batch, heads]) subtracts slope * |i + sk - sq - j|.
    Dropout (dropout_p in [0, 1)) draws its keep-mask from `seed` (a fresh one when None): pass
    the same seed to backward. `out` / `lse` may be given to write into (arrays of q's framework).
    With cu_seqlens_*, block_table (int32 [batch, max_blocks]) makes k / v paged caches
    [num_blocks, page_size, heads_kv, d] (forward only): key j of sequence b is row
    j % page_size of block block_table[b, j // page_size]. On CUDA arrays dropout_p must be 0
    (NotImplementedError otherwise).
    """
    return run_forward(framework_of(q), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                       max_seqlen_k, softmax_scale, causal, _window(window_size), softcap, alibi_slopes, dropout_p,
                       seed, block_table)


def run_forward(fw, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, seed, block_table=None):
    """forward's work with positional arguments and the framework known: the path of every
    caller (flashattn.torch's eager calls come here directly; keywords cost microseconds)."""
    pad = head_dim_padding(fw, q, k, v)
    if pad:
        d = q.shape[-1]
        _check_given(fw, out, q, "out")
        padded_out, lse = run_forward(fw, *(fw.pad_last(x, pad) for x in (q, k, v)), None, lse, cu_seqlens_q,
                                      cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, _scale(softmax_scale, d),
                                      causal, window, softcap, alibi_slopes, dropout_p, seed, block_table)
        return _unpadded(fw, padded_out, d, out), lse
    if out is None:
        out = fw.empty(q, q.shape)
    if lse is None:
        shape = q.shape
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if len(shape) == 3 and varlen:
            lse = fw.empty(q, (shape[1], shape[0]), fw.float32(q))
        elif len(shape) == 4 and not varlen:
            lse = fw.empty(q, (shape[0], shape[2], shape[1]), fw.float32(q))
        # else: q's shape is wrong, which the library reports
    # The forward's optional workspace: the tile counter with which masked calls on Hopper
    # balance their uneven tiles. Allocated (a few microseconds) only for masked GPU calls.
    masked = causal or window[0] >= 0 or window[1] >= 0
    workspace = fw.device_workspace(q, _ext.FORWARD_WORKSPACE_BYTES) if masked else None
    # The extension's argument order (python/src/module.cpp).
    _ext.forward(_input(fw, q), _input(fw, k), _input(fw, v), fw.to_ext(out), _optional(fw, lse),
                 _index(fw, cu_seqlens_q, "cu_seqlens_q"), _index(fw, cu_seqlens_k, "cu_seqlens_k"),
                 _index(fw, seqused_k, "seqused_k"), _max_seqlen(max_seqlen_q, cu_seqlens_q),
                 _max_seqlen(max_seqlen_k, cu_seqlens_k), 0.0 if softmax_scale is None else float(softmax_scale),
                 bool(causal), window[0], window[1], float(softcap), _input(fw, alibi_slopes), float(dropout_p),
                 _seed(dropout_p, seed, False), 0, _index(fw, block_table, "block_table"),
                 None if workspace is None else fw.workspace_to_ext(workspace), fw.stream(q))
    fw.finish(q)
    return fw.from_ext(out), (None if lse is None else fw.from_ext(lse))


def backward(dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, deterministic=False, dq=None, dk=None,
             dv=None):
    """Attention backward from the forward's out and lse: returns (dq, dk, dv).

    The options must be the forward's (with dropout, its seed). deterministic=True fixes the
    accumulation order of dQ (bitwise-reproducible gradients; the CPU backend always is).
    """
    fw = framework_of(q)
    pad = head_dim_padding(fw, q, k, v, dout, out)
    given = (dq, dk, dv)
    if pad:  # gradients into padded temporaries, cut back (and copied into given arrays) below
        d = q.shape[-1]
        for name, g, like in zip(("dq", "dk", "dv"), given, (q, k, v)):
            _check_given(fw, g, like, name)
        softmax_scale = _scale(softmax_scale, d)
        dout, q, k, v, out = (fw.pad_last(x, pad) for x in (dout, q, k, v, out))
        dq = dk = dv = None
    dq = fw.empty(q, q.shape) if dq is None else dq
    dk = fw.empty(k, k.shape) if dk is None else dk
    dv = fw.empty(v, v.shape) if dv is None else dv
    left, right = _window(window_size)
    to_ext = fw.to_ext
    # The extension's argument order (python/src/module.cpp), shared with its workspace query.
    args = (_input(fw, dout), _input(fw, q), _input(fw, k), _input(fw, v), _input(fw, out), _input(fw, lse),
            to_ext(dq), to_ext(dk), to_ext(dv), _index(fw, cu_seqlens_q, "cu_seqlens_q"),
            _index(fw, cu_seqlens_k, "cu_seqlens_k"), _index(fw, seqused_k, "seqused_k"),
            _max_seqlen(max_seqlen_q, cu_seqlens_q), _max_seqlen(max_seqlen_k, cu_seqlens_k),
            0.0 if softmax_scale is None else float(softmax_scale), bool(causal), left, right, float(softcap),
            _input(fw, alibi_slopes), float(dropout_p), _seed(dropout_p, seed, True), 0, bool(deterministic))
    # Device scratch memory (the CUDA backend's; the CPU needs none) from the caller's framework,
    # on q's device. The library only enqueues work that uses it on the call's stream, so it may
    # be freed once the call returns: the framework's allocator is stream-ordered (PyTorch's and
    # CuPy's reuse a freed block only for later work on the same stream; JAX's buffers are freed
    # after finish() has waited for the device).
    nbytes = _ext.backward_workspace_size(*args)
    workspace = fw.workspace(q, nbytes) if nbytes else None
    _ext.backward(*args, None if workspace is None else fw.workspace_to_ext(workspace), fw.stream(q))
    fw.finish(q)
    grads = fw.from_ext(dq), fw.from_ext(dk), fw.from_ext(dv)
    return tuple(_unpadded(fw, g, d, g_given) for g, g_given in zip(grads, given)) if pad else grads


def forward_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                    cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    num_splits=0, out=None, lse=None, index_check="host"):
    """Attention against a KV cache (decoding): returns (out, lse).

    k_cache / v_cache are [batch_cache, seqlen_cache, heads_kv, d], or paged
    [num_blocks, page_size, heads_kv, d] with block_table (int32 [batch, max_blocks]). When k / v
    ([batch, seqlen_new, heads_kv, d]) are given they are written into the caches, in place, at
    positions cache_seqlens (an int or int32 [batch]) before q [batch, seqlen_q, heads, d] attends
    to positions [cache_leftpad, cache_seqlens + seqlen_new) of its sequence. rotary_cos /
    rotary_sin ([seqlen_ro, rotary_dim / 2]) rotate k and q (see flash_attn_with_kvcache).
    num_splits tunes the GPU's split-KV (0: auto).

    index_check: where the index values (cache_seqlens, cache_leftpad, cache_batch_idx,
    block_table) are checked. "host" (default): before anything is written, an error naming a bad
    entry; GPU indices are copied to the host for it, which waits for the stream. "device": by the
    GPU kernels as they read them, so the call never waits (CUDA graphs can capture it); a
    sequence with a bad entry gets NaN in its out and lse rows, and nothing outside the tensors is
    touched. Host arrays are checked on the host either way.
    """
    if index_check not in ("host", "device"):
        raise ValueError(f'index_check: {index_check!r} is neither "host" nor "device"')
    fw = framework_of(q)
    if isinstance(cache_seqlens, int):
        cache_seqlens = fw.int32_full(q, q.shape[0], cache_seqlens)
    # A head_dim the CUDA kernels cannot read runs on zero-padded copies of q, k / v and the
    # caches (whole caches: O(cache size) per call); appended rows reach the caller's caches
    # by copying the padded caches back. A rotary_dim beyond head_dim is not padded into range.
    too_wide = rotary_cos is not None and 2 * rotary_cos.shape[-1] > q.shape[-1]
    pad = 0 if too_wide else head_dim_padding(fw, q, k_cache, v_cache, k, v)
    if pad:
        d, given_out, caches = q.shape[-1], out, (k_cache, v_cache)
        _check_given(fw, out, q, "out")
        softmax_scale = _scale(softmax_scale, d)
        q, k_cache, v_cache = (fw.pad_last(x, pad) for x in (q, k_cache, v_cache))
        k, v = (None if x is None else fw.pad_last(x, pad) for x in (k, v))
        out = None
    if out is None:
        out = fw.empty(q, q.shape)
    if lse is None and len(q.shape) == 4:  # else q's shape is wrong, which the library reports
        lse = fw.empty(q, (q.shape[0], q.shape[2], q.shape[1]), fw.float32(q))
    left, right = _window(window_size)
    # The extension's argument order (python/src/module.cpp), shared with its workspace query. The
    # caches are the caller's storage (written in place when appending): passed as they are.
    args = (_input(fw, q), fw.to_ext(k_cache), fw.to_ext(v_cache), _input(fw, k), _input(fw, v),
            _index(fw, cache_seqlens, "cache_seqlens"), _index(fw, cache_batch_idx, "cache_batch_idx"),
            _index(fw, cache_leftpad, "cache_leftpad"), _index(fw, block_table, "block_table"),
            _input(fw, rotary_cos), _input(fw, rotary_sin), bool(rotary_interleaved), int(num_splits),
            fw.to_ext(out), _optional(fw, lse), 0.0 if softmax_scale is None else float(softmax_scale), bool(causal),
            left, right, float(softcap), _input(fw, alibi_slopes), index_check == "device")
    # The GPU's split-KV partials (none on the CPU), from the caller's allocator as in backward.
    nbytes = _ext.forward_kvcache_workspace_size(*args)
    workspace = fw.workspace(q, nbytes) if nbytes else None
    _ext.forward_kvcache(*args, None if workspace is None else fw.workspace_to_ext(workspace), fw.stream(q))
    fw.finish(q)
    out, lse = fw.from_ext(out), (None if lse is None else fw.from_ext(lse))
    if pad:
        if k is not None or v is not None:
            for cache, padded in zip(caches, (k_cache, v_cache)):
                fw.copy_into(cache, padded[..., :d])
        out = _unpadded(fw, out, d, given_out)
    return out, lse
