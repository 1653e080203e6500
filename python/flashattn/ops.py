"""Array-agnostic forward and backward: numpy (ml_dtypes bfloat16 too), PyTorch, CuPy and JAX arrays
in, the same framework's arrays out, on the inputs' device and (CUDA) the caller's current stream.

Layouts (docs/ARCHITECTURE.md): dense q [batch, seqlen_q, heads, head_dim], k / v
[batch, seqlen_k, heads_kv, head_dim], lse float32 [batch, heads, seqlen_q]; with cu_seqlens_*
(int32 prefix sums, [batch + 1]) q / k / v are [total, heads, head_dim] and lse is
[heads, total_q]. v may have a head_dim of its own (CPU arrays), which out, dout and dv then
have. Every argument is checked by the library before any memory is touched.
"""
from __future__ import annotations

import operator
import secrets
from typing import Optional, Tuple, Union

from . import _ext
from ._arrays import framework_of
from ._docs import Array, documented
from .block_mask import BlockMask

# forward's and backward's shared arguments.
_LAYOUT_ARGS = """        cu_seqlens_q: int32 [batch + 1], or None. Varlen: prefix sums of the query lengths
            (sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]); q, k, v are then
            [total, heads(_kv), head_dim]. Given with cu_seqlens_k.
        cu_seqlens_k: int32 [batch + 1], or None. The same for k / v.
        max_seqlen_q: int, or None. The longest query sequence (None: computed from
            cu_seqlens_q, which reads it on the host).
        max_seqlen_k: int, or None. The same for the keys.
        seqused_k: int32 [batch], or None. Varlen: only the first seqused_k[b] keys of sequence b
            are used.
        index_check: "device" (default) or "host": where the values of GPU cu_seqlens_q /
            cu_seqlens_k / seqused_k (and block_table), and a GPU block_mask's lists, are
            checked; see below.
        block_mask: a flashattn.BlockMask, or None. A block-sparse mask (FlexAttention's form;
            dense calls; flashattn.BlockMask says where it runs), restricting what the other mask
            options allow: the backward must get the forward's."""

# forward's and backward's index_check, after their Raises.
_VARLEN_INDEX_CHECK = """
    index_check (varlen on a GPU): "device" (default) checks the lengths on the GPU, so the call
    never waits for the device and a CUDA graph can capture it; pass max_seqlen_q / max_seqlen_k
    (the device check fails when a sequence is longer). A call whose lengths break a rule writes
    NaN to all of its outputs and touches nothing outside the arrays; the first bad entry is
    raised as a ValueError naming it -- like an error of an asynchronous CUDA launch, later than
    the call that caused it: by the next call with index_check="device" on that device, before it
    writes anything, or by flashattn.check_device_errors(), which waits for the device first.
    "host": a strict check before anything is written (the lengths are copied to the host, which
    waits for the stream once per call), raising at the call itself. Host arrays are checked on
    the host either way. A GPU block_mask's lists (forward) likewise: "device" leaves them to the
    kernel, which gives a query tile whose lists break a rule NaN in its out and lse rows and
    records the entry (up to 32768 key blocks; longer lists are checked on the host)."""


def _index_check(index_check) -> bool:
    """True for "device", False for "host"."""
    if index_check not in ("host", "device"):
        raise ValueError(f'index_check: {index_check!r} is neither "host" nor "device"')
    return index_check == "device"
_OPTIONS = """{softmax_scale}
{mask_args}
{score_args}
{dropout_p}"""


# The library treats window sides of 2^62 or more as unbounded (core::kUnboundedWindow); larger
# Python ints are clamped to it here only because they would not fit the extension's int64.
_UNBOUNDED_WINDOW = 1 << 62


def _window(window_size):
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None
    sides = []
    for side in (left, right):
        try:
            side = operator.index(side)  # ints (numpy's too); never a silently truncated float
        except TypeError:
            raise TypeError(f"window_size: expected integers (left, right), got {window_size!r}") from None
        sides.append(min(side, _UNBOUNDED_WINDOW))  # below -1: the library names it
    return sides[0], sides[1]


def _seed(dropout_p, seed, needs_seed):
    if dropout_p and seed is None:
        if needs_seed:
            raise ValueError("seed: the backward pass with dropout_p > 0 needs the forward's seed")
        return secrets.randbits(63)
    if seed is None:
        return 0
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed: expected an integer, got {type(seed).__name__}") from None
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: {seed} is outside [0, 2**64)")
    return seed


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
    if a is None:
        return None
    if isinstance(a, (list, tuple)):
        raise TypeError(f"{name}: expected an int32 array of q's framework and device, got a {type(a).__name__}")
    dtype = str(getattr(a, "dtype", "int32"))  # no dtype (not an array): the extension judges it
    if dtype not in _INT32:
        dtype = dtype.removeprefix("torch.")
        raise TypeError(f"{name}: dtype {dtype} must be int32 (int32 expected, got {dtype})")
    return _input(fw, a)


def head_dim_padding(fw, q, *others, always=False) -> int:
    """The zero columns to append to the head_dim that q and `others` share (q and k; v, out and
    dout, whose head_dim may differ from q's) so that the CUDA kernels, which read rows of 16
    bytes, take it (they need head_dim % 8 == 0; flash_attn pads too): 0 for none. CPU arrays
    take any head_dim and are never padded unless `always` (tests run the padded path on the CPU
    with it). Not padded either: head_dims beyond 256 or differing between q and `others`
    (None entries are skipped), which the library then reports as the caller gave them."""
    d = q.shape[-1]
    if d % 8 == 0 or d > 256 or any(a is not None and a.shape[-1] != d for a in others):
        return 0
    if fw.is_float8(q) or any(fw.is_float8(a) for a in others if a is not None):
        return 0  # FP8 runs on the CPU backend alone: the CUDA backend refuses it by name
    return 8 - d % 8 if always or fw.on_cuda(q) else 0


def head_dim_paddings(fw, q, k, v, *v_like) -> Tuple[int, int]:
    """(pad, pad_v): head_dim_padding of q with k, and of v with v_like (out, dout). On CUDA,
    whose kernels take equal head dims only, a pair that padding would leave unequal is not padded,
    so that the library's refusal names the head dims the caller gave (a pair that padding makes
    equal, e.g. 100 and 104, runs)."""
    pad, pad_v = head_dim_padding(fw, q, k), head_dim_padding(fw, v, *v_like)
    if (pad or pad_v) and q.shape[-1] + pad != v.shape[-1] + pad_v and fw.on_cuda(q):
        return 0, 0
    return pad, pad_v


def _padded(fw, a, n):
    """a with n zero columns appended to its head_dim (a new array), or a itself for n = 0."""
    return fw.pad_last(a, n) if n else a


def _out_shape(q, v):
    """out's (and dout's) shape: q's with v's head_dim."""
    return (*q.shape[:-1], v.shape[-1])


def _scale(softmax_scale, d):
    """softmax_scale, or its default 1 / sqrt(d) for the caller's head_dim d (explicit: a padded
    call's head_dim is larger). None and 0 mean the default."""
    return softmax_scale if softmax_scale else d ** -0.5


def _check_given(fw, given, like, name, shape=None):
    """Checks an output array the caller gave for a padded call, which the library never sees
    (it writes a padded temporary, copied into `given` afterwards): `shape` (default like's) and
    like's dtype, and a contiguous last dimension, as the library would require."""
    if given is None:
        return
    shape = tuple(like.shape) if shape is None else tuple(shape)
    if tuple(given.shape) != shape:
        raise ValueError(f"{name}: shape {list(given.shape)} != expected {list(shape)}")
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


@documented("""Attention forward on any array library: returns (out, lse) as arrays of q's
    framework, on its device and (CUDA) the caller's current stream; nothing is differentiable
    here (flashattn.torch and flash_attn_func are).

{layout_notes}
    Dropout draws its keep-mask from `seed`: pass the same seed to backward.

    Args:
        q: [batch, seqlen_q, heads, head_dim] (varlen: [total_q, heads, head_dim]); fp16 or bf16
            (the CPU also takes fp32, fp64).
        k: [batch, seqlen_k, heads_kv, head_dim] (varlen: [total_k, heads_kv, head_dim]; with
            block_table a paged cache [num_blocks, page_size, heads_kv, head_dim]); q's dtype.
        v: like k, with a head_dim of its own allowed (CPU arrays; multi-head latent
            attention's 192 / 128), which out then has.
""" + _LAYOUT_ARGS + """
""" + _OPTIONS + """
        seed: int, or None. The dropout keep-mask's seed (None: a fresh one each call).
        out: an array shaped like q with v's head_dim, q's dtype, to write the output into, or
            None (a new one).
        lse: a float32 array to write the LSE into ([batch, heads, seqlen_q]; varlen
            [heads, total_q]), or None (a new one).
        block_table: int32 [batch, max_blocks_per_sequence], or None. With cu_seqlens_*: k / v
            are paged caches, key j of sequence b being row j % page_size of block
            block_table[b, j // page_size] (cu_seqlens_k then only gives the lengths).
{fp8_descale}

    Returns:
        (out, lse): out shaped like q with v's head_dim; lse float32 [batch, heads, seqlen_q]
        (varlen: [heads, total_q]).
{lse}

{raises}
""" + _VARLEN_INDEX_CHECK + """
    """)
def forward(q: Array, k: Array, v: Array, *, cu_seqlens_q: Optional[Array] = None,
            cu_seqlens_k: Optional[Array] = None, max_seqlen_q: Optional[int] = None,
            max_seqlen_k: Optional[int] = None, seqused_k: Optional[Array] = None,
            softmax_scale: Optional[float] = None, causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
            softcap: float = 0.0, alibi_slopes: Optional[Array] = None, dropout_p: float = 0.0,
            seed: Optional[int] = None, out: Optional[Array] = None, lse: Optional[Array] = None,
            block_table: Optional[Array] = None, index_check: str = "device",
            learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
            block_mask: Optional[BlockMask] = None, q_descale: Optional[Array] = None,
            k_descale: Optional[Array] = None, v_descale: Optional[Array] = None) -> Tuple[Array, Array]:
    return run_forward(framework_of(q), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                       max_seqlen_k, softmax_scale, causal, _window(window_size), softcap, alibi_slopes, dropout_p,
                       seed, block_table, _index_check(index_check), learnable_sink, sink_tokens, block_mask,
                       _descale(q_descale, k_descale, v_descale))


def _descale(*factors):
    """FP8 inputs' descale factors as the extension takes them: None when none is given."""
    return None if all(f is None for f in factors) else factors


def _block_mask(fw, block_mask):
    """A BlockMask (or None) as the extension takes it."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a flashattn.BlockMask, got a {type(block_mask).__name__} "
                        "(flashattn.flex_attention converts PyTorch's)")
    return block_mask._ext(fw, _index)


def run_forward(fw, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, seed, block_table=None,
                device_index_check=True, learnable_sink=None, sink_tokens=0, block_mask=None, descale=None):
    """forward's work with positional arguments and the framework known: the path of every
    caller (flashattn.torch's eager calls come here directly; keywords cost microseconds)."""
    pad, pad_v = head_dim_paddings(fw, q, k, v)  # v's head_dim may be its own
    if pad or pad_v:
        _check_given(fw, out, q, "out", _out_shape(q, v))
        padded_out, lse = run_forward(fw, _padded(fw, q, pad), _padded(fw, k, pad), _padded(fw, v, pad_v), None, lse,
                                      cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                      _scale(softmax_scale, q.shape[-1]), causal, window, softcap, alibi_slopes,
                                      dropout_p, seed, block_table, device_index_check, learnable_sink, sink_tokens,
                                      block_mask, descale)
        return _unpadded(fw, padded_out, v.shape[-1], out), lse
    if out is None:  # FP8 inputs give a 16-bit out (bfloat16 unless the caller passes one)
        out = fw.empty(q, _out_shape(q, v), fw.float8_out_dtype(q) if fw.is_float8(q) else None)
    if lse is None:
        shape = q.shape
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if len(shape) == 3 and varlen:
            lse = fw.empty(q, (shape[1], shape[0]), fw.float32(q))
        elif len(shape) == 4 and not varlen:
            lse = fw.empty(q, (shape[0], shape[2], shape[1]), fw.float32(q))
        # else: q's shape is wrong, which the library reports
    # The extension's argument order (python/src/module.cpp), shared with its workspace query.
    args = (_input(fw, q), _input(fw, k), _input(fw, v), fw.to_ext(out), _optional(fw, lse),
            _index(fw, cu_seqlens_q, "cu_seqlens_q"), _index(fw, cu_seqlens_k, "cu_seqlens_k"),
            _index(fw, seqused_k, "seqused_k"), _max_seqlen(max_seqlen_q, cu_seqlens_q),
            _max_seqlen(max_seqlen_k, cu_seqlens_k), 0.0 if softmax_scale is None else float(softmax_scale),
            bool(causal), window[0], window[1], int(sink_tokens), float(softcap), _input(fw, alibi_slopes),
            _input(fw, learnable_sink), float(dropout_p), _seed(dropout_p, seed, False), 0,
            _index(fw, block_table, "block_table"), bool(device_index_check), _block_mask(fw, block_mask),
            None if descale is None else tuple(_input(fw, f) for f in descale))
    # The forward's workspace: for varlen calls what the library asks (on a GPU with the lengths
    # checked there, their checked copies); else optional, the tile counter with which masked
    # calls on Hopper balance their uneven tiles, allocated (a few microseconds) only for those.
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        nbytes = _ext.forward_workspace_size(*args)
    else:
        masked = causal or window[0] >= 0 or window[1] >= 0
        nbytes = _ext.FORWARD_WORKSPACE_BYTES if masked else 0
    workspace = fw.device_workspace(q, nbytes) if nbytes else None
    _ext.forward(*args, None if workspace is None else fw.workspace_to_ext(workspace), fw.stream(q))
    fw.finish(q)
    return fw.from_ext(out), (None if lse is None else fw.from_ext(lse))


@documented("""Attention backward from the forward's out and lse: returns (dq, dk, dv) as arrays of
    q's framework, shaped like q, k, v (v's head_dim may differ from q's: out and dout have it).

    The options must be the forward's (with dropout, its seed): they define the attention being
    differentiated. GQA: dk / dv sum the gradients of the query heads that share a kv head.

{layout_notes}

    Args:
        dout: the gradient of the loss with respect to out; like out.
        q: the forward's q.
        k: the forward's k (dense or varlen; not paged).
        v: the forward's v.
        out: the forward's out.
        lse: the forward's lse (float32).
""" + _LAYOUT_ARGS + """
""" + _OPTIONS + """
        seed: int, or None. The forward's dropout seed (required when dropout_p > 0).
{deterministic}
        dq: an array like q to write dq into, or None (a new one).
        dk: an array like k to write dk into, or None.
        dv: an array like v to write dv into, or None.
        learnable_sink: the forward's learnable_sink, or None.
        dsink: with learnable_sink, a float32 [heads] array to write its gradient into, or
            None (a new one).

    Returns:
        (dq, dk, dv), shaped and typed like q, k, v; with learnable_sink, (dq, dk, dv, dsink),
        dsink float32 [heads] (summed over the batch).

{raises}
""" + _VARLEN_INDEX_CHECK + """
    """)
def backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
             cu_seqlens_q: Optional[Array] = None, cu_seqlens_k: Optional[Array] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             seqused_k: Optional[Array] = None, softmax_scale: Optional[float] = None, causal: bool = False,
             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Array] = None,
             dropout_p: float = 0.0, seed: Optional[int] = None, deterministic: bool = False,
             dq: Optional[Array] = None, dk: Optional[Array] = None,
             dv: Optional[Array] = None, index_check: str = "device", learnable_sink: Optional[Array] = None,
             dsink: Optional[Array] = None, sink_tokens: int = 0,
             block_mask: Optional[BlockMask] = None) -> Tuple[Array, ...]:
    for name, a in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if a is None:  # (the extension's signature dump would not say which)
            raise ValueError(f"{name}: required by the backward pass (out and lse are the forward's)")
    fw = framework_of(q)
    pad, pad_v = head_dim_paddings(fw, q, k, v, dout, out)  # v's head_dim may be its own
    given = (dq, dk, dv)
    if pad or pad_v:  # gradients into padded temporaries, cut back (and copied into given arrays) below
        widths = (q.shape[-1], k.shape[-1], v.shape[-1])
        for name, g, like in zip(("dq", "dk", "dv"), given, (q, k, v)):
            _check_given(fw, g, like, name)
        softmax_scale = _scale(softmax_scale, q.shape[-1])
        q, k = (_padded(fw, x, pad) for x in (q, k))
        dout, v, out = (_padded(fw, x, pad_v) for x in (dout, v, out))
        dq = dk = dv = None
    dq = fw.empty(q, q.shape) if dq is None else dq
    dk = fw.empty(k, k.shape) if dk is None else dk
    dv = fw.empty(v, v.shape) if dv is None else dv
    if dsink is not None and learnable_sink is None:
        raise ValueError("dsink: given without a learnable_sink")
    if learnable_sink is not None and dsink is None and len(learnable_sink.shape) == 1:
        dsink = fw.empty(learnable_sink, learnable_sink.shape, fw.float32(learnable_sink))
    left, right = _window(window_size)
    to_ext = fw.to_ext
    # The extension's argument order (python/src/module.cpp), shared with its workspace query.
    args = (_input(fw, dout), _input(fw, q), _input(fw, k), _input(fw, v), _input(fw, out), _input(fw, lse),
            to_ext(dq), to_ext(dk), to_ext(dv), _optional(fw, dsink), _index(fw, cu_seqlens_q, "cu_seqlens_q"),
            _index(fw, cu_seqlens_k, "cu_seqlens_k"), _index(fw, seqused_k, "seqused_k"),
            _max_seqlen(max_seqlen_q, cu_seqlens_q), _max_seqlen(max_seqlen_k, cu_seqlens_k),
            0.0 if softmax_scale is None else float(softmax_scale), bool(causal), left, right, int(sink_tokens),
            float(softcap), _input(fw, alibi_slopes), _input(fw, learnable_sink), float(dropout_p), _seed(dropout_p,
            seed, True), 0,
            bool(deterministic), _index_check(index_check), _block_mask(fw, block_mask))
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
    if pad or pad_v:
        grads = tuple(_unpadded(fw, g, width, g_given) for g, width, g_given in zip(grads, widths, given))
    return grads if learnable_sink is None else (*grads, fw.from_ext(dsink))


@documented("""Attention against a KV cache (decoding), optionally appending new keys and values to
    it first: returns (out, lse) as arrays of q's framework. The keyword form of
    flash_attn_with_kvcache, whose docstring details the arguments; here also out / lse to
    write into.

    For sequence b, k[b] / v[b] (when given) are written into k_cache / v_cache in place at
    positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (rotated first when
    rotary_cos / rotary_sin are given), then q[b] attends to positions [cache_leftpad[b],
    cache_seqlens[b] + seqlen_new) of cache row cache_batch_idx[b]. CUDA caches whose head_dim is
    not a multiple of 8 run on zero-padded copies of both caches (copied back after an append):
    O(cache size) extra memory traffic per call.

{layout_notes}

    Args:
        q: [batch, seqlen_q, heads, head_dim]; fp16 or bf16 (the CPU also takes fp32, fp64).
        k_cache: [batch_cache, seqlen_cache, heads_kv, head_dim], or with block_table
            [num_blocks, page_size, heads_kv, head_dim]; written in place when k / v are given.
        v_cache: like k_cache, with a head_dim of its own allowed (CPU arrays; e.g. a view of
            k_cache's first 512 columns for multi-head latent attention's absorbed decode).
        k: [batch, seqlen_new, heads_kv, head_dim], or None: new keys to append.
        v: like k.
        cache_seqlens: int or int32 [batch]: tokens already cached per sequence.
        cache_batch_idx: int32 [batch], or None: each sequence's cache row (default b).
        cache_leftpad: int32 [batch], or None: each sequence's first valid position (0).
        block_table: int32 [batch, max_blocks_per_sequence], or None: paged caches, position j
            of sequence b being row j % page_size of block block_table[b, j // page_size].
        rotary_cos: [seqlen_ro, rotary_dim / 2] (float32 or q's dtype), or None: rotary
            embedding of k and q (see flash_attn_with_kvcache).
        rotary_sin: like rotary_cos.
        rotary_interleaved: bool. True: pairs (0, 1), (2, 3), ...; False: (i, i + rotary_dim / 2).
{softmax_scale}
{mask_args}
{score_args}
        num_splits: int >= 0. Splits of the keys for the GPU's split-KV decode (0: a heuristic).
        out: an array like q to write the output into, or None.
        lse: a float32 [batch, heads, seqlen_q] array to write the LSE into, or None.
        index_check: see below.
{fp8_cache_descale}

    Returns:
        (out, lse): out like q; lse float32 [batch, heads, seqlen_q].
{lse}

{raises}

    index_check: where the index values (cache_seqlens, cache_leftpad, cache_batch_idx,
    block_table) of GPU arrays are checked; host arrays are checked on the host either way.
    "device" (default): by the GPU kernels as they read them, so the call never waits for the
    device and a CUDA graph can capture it. A sequence with a bad entry gets NaN in its out and
    lse rows (its new tokens may or may not be appended) and nothing outside the arrays is
    touched; the first bad entry found is recorded and raised as a ValueError naming it -- like
    an error of an asynchronous CUDA launch, later than the call that caused it: by the next
    call with index_check="device" on that device, before it writes anything, or by
    flashattn.check_device_errors(), which waits for the device first. "host": a strict check
    before anything is written (GPU indices are copied to the host, which waits for the stream
    once per call and keeps the call out of CUDA graphs), raising at the call itself.
    """)
def forward_kvcache(q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
                    v: Optional[Array] = None, *, cache_seqlens: Union[int, Array, None] = None,
                    cache_batch_idx: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
                    block_table: Optional[Array] = None, rotary_cos: Optional[Array] = None,
                    rotary_sin: Optional[Array] = None, rotary_interleaved: bool = True,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Array] = None, num_splits: int = 0, out: Optional[Array] = None,
                    lse: Optional[Array] = None, index_check: str = "device",
                    learnable_sink: Optional[Array] = None, sink_tokens: int = 0,
                    k_descale: Optional[Array] = None, v_descale: Optional[Array] = None) -> Tuple[Array, Array]:
    device_index_check = _index_check(index_check)
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
    if out is None:  # q's shape with v_cache's head_dim (multi-head latent attention: 576 / 512)
        out = fw.empty(q, _out_shape(q, v_cache) if len(v_cache.shape) == len(q.shape) else q.shape)
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
            left, right, int(sink_tokens), float(softcap), _input(fw, alibi_slopes), _input(fw, learnable_sink),
            device_index_check, None if _descale(k_descale, v_descale) is None
            else (_input(fw, k_descale), _input(fw, v_descale)))
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
