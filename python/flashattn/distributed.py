"""Context parallelism on torch.distributed: one sequence's attention spread over the ranks of a
process group, exact (each rank's partial results merged through their LSE), differentiable.

    ring_attention(q, k, v, group=None, causal=False, layout="zigzag", ...)
        K / V blocks travel around a ring of ranks (isend / irecv, the next block's transfer
        issued before the current block's attention); the backward sends dK / dV round with them.
    ulysses_attention(q, k, v, group=None, causal=False, layout="zigzag", ...)
        an all-to-all turns sequence shards into head shards, each rank attends over the whole
        sequence for its heads, and a second all-to-all turns them back.
    shard(x, group=None, layout="zigzag", dim=1) / unshard(x, ...)
        a whole sequence's shard for this rank, and the whole sequence back from the shards.

Every rank passes its shard of the sequence dimension: q [batch, seqlen / world, heads,
head_dim], k / v [batch, seqlen / world, heads_kv, head_dim], in the layout named by `layout`:
"contiguous" (rank r holds tokens [r s, (r + 1) s)) or "zigzag" (the sequence cut into 2 world
chunks, rank r holding chunks r and 2 world - 1 - r, so that every rank has the same share of a
causal mask's work). The communication is torch.distributed's (NCCL for CUDA tensors, gloo for
CPU tensors); the attention of each block is flashattn's, on whatever device the tensors are.
The two strategies compose (docs/ARCHITECTURE.md, "Context parallelism"): with `node` the
group of a node's ranks and `ring` the group of the ranks with the same place in every node,
shard the sequence for the ring, then that shard contiguously over the node:

    q = shard(shard(q_whole, ring), node, layout="contiguous")        # likewise k, v
    out = heads_to_seq(ring_attention(seq_to_heads(q, node), seq_to_heads(k, node),
                                      seq_to_heads(v, node), group=ring, causal=True), node)
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from ._arrays import TorchFramework

_TORCH = TorchFramework(torch)
LAYOUTS = ("zigzag", "contiguous")


# ---- shards -------------------------------------------------------------------------------------

def _rank_world(group) -> Tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")


def _chunks_of(rank: int, world: int, layout: str) -> List[int]:
    """The chunks of the whole sequence a rank holds, in order: of `world` chunks (contiguous) or
    of 2 world (zigzag)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def shard(x: Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's shard of a whole sequence: x's dimension `dim` cut as `layout` says.

    Args:
        x: the whole sequence, the same on every rank (e.g. [batch, seqlen, heads, head_dim]).
        group: the process group (None: the default one).
        layout: "zigzag" or "contiguous" (see the module's docstring).
        dim: the sequence dimension.

    Returns:
        The shard (a new tensor; differentiable with respect to x).

    Raises:
        ValueError: a layout not known, or a sequence length the layout cannot cut evenly.
    """
    _check_layout(layout)
    rank, world = _rank_world(group)
    pieces = world if layout == "contiguous" else 2 * world
    if x.shape[dim] % pieces != 0:
        raise ValueError(f"x: seqlen {x.shape[dim]} (dim {dim}) is not a multiple of {pieces}, the chunks a "
                         f"{layout} layout over {world} ranks cuts it into")
    chunks = x.chunk(pieces, dim)
    return torch.cat([chunks[c] for c in _chunks_of(rank, world, layout)], dim)


def _reorder(x: Tensor, world: int, layout: str, dim: int, to_sequence: bool) -> Tensor:
    """The shards of every rank, concatenated in rank order, put in sequence order (to_sequence)
    or back."""
    if layout == "contiguous":
        return x
    order = [c for r in range(world) for c in _chunks_of(r, world, layout)]  # chunk held at each place
    parts = x.chunk(2 * world, dim)
    if to_sequence:
        place = {c: i for i, c in enumerate(order)}
        return torch.cat([parts[place[c]] for c in range(2 * world)], dim)
    return torch.cat([parts[c] for c in order], dim)


def unshard(x: Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard (an all-gather; not differentiable).

    Args:
        x: this rank's shard, shaped alike on every rank.
        group: the process group (None: the default one).
        layout: the layout the shards were cut in.
        dim: the sequence dimension.

    Returns:
        The whole sequence, on every rank.
    """
    _check_layout(layout)
    _, world = _rank_world(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return _reorder(torch.cat(gathered, dim), world, layout, dim, to_sequence=True)


# ---- the arguments every rank must agree on ------------------------------------------------------

def _agree(group, q: Tensor, problem: Optional[str], fields: Sequence[int], what: str) -> None:
    """Raises on every rank when any rank's arguments are invalid (`problem`, its message) or the
    ranks' `fields` differ, before any of them communicates a block: one rank's error must not
    leave the others waiting for it. One all-reduce of a few integers."""
    device = q.device if q.device.type == "cuda" else torch.device("cpu")
    values = [0 if problem is None else 1] + [int(f) for f in fields]
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    bad_somewhere, highest, lowest = t[0].item(), t[:n].tolist(), [-v for v in t[n:].tolist()]
    rank = dist.get_rank(group)
    if problem is not None:
        raise ValueError(f"{what}: rank {rank}: {problem}")
    if bad_somewhere:
        raise ValueError(f"{what}: another rank's arguments are invalid (its error names them)")
    if highest[1:] != lowest[1:]:
        raise ValueError(f"{what}: the ranks' shapes, options or documents differ (each rank passes its shard "
                         f"of one sequence, all with the same options)")


def _fields(problem, q: Tensor, k: Tensor, causal: bool, layout: str, window_size=(-1, -1),
            bounds: Optional[List[int]] = None) -> List[int]:
    """What every rank must pass alike (shapes, mask, layout, documents): fourteen integers, zeros
    on a rank whose arguments are invalid (its error is raised instead)."""
    if problem is not None:
        return [0] * 14
    documents = [len(bounds), sum((i + 1) * b for i, b in enumerate(bounds)) % (1 << 61)] if bounds else [0, 0]
    return [*q.shape, *k.shape, int(causal), LAYOUTS.index(layout), *window_size, *documents]


def _documents(cu_seqlens: Tensor, q: Tensor, window_size, world: int):
    """(bounds, None) for valid packed documents over the whole sequence, else (None, problem)."""
    if tuple(window_size) != (-1, -1):
        return None, "cu_seqlens: packed documents with a sliding window are not supported yet"
    if q.shape[0] != 1:
        return None, f"q: packed documents need batch 1 (the whole packed sequence), got {q.shape[0]}"
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        return None, f"cu_seqlens: expected int32 [documents + 1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
    bounds = [int(b) for b in cu_seqlens.tolist()]
    total = q.shape[1] * world
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b > a for b, a in zip(bounds, bounds[1:])):
        return None, (f"cu_seqlens: must rise from 0 to the whole sequence's {total} tokens, got "
                      f"{bounds[:4]}{'...' if len(bounds) > 4 else ''}{bounds[-1:] if len(bounds) > 4 else ''}")
    return [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]], None


def _check(q: Tensor, k: Tensor, v: Tensor, layout: str, alibi_slopes, dropout_p: float,
           window_size=(-1, -1)) -> Optional[str]:
    """This rank's argument errors, as one message (None: none)."""
    if layout not in LAYOUTS:
        return f"layout: {layout!r} is not one of {LAYOUTS}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q / k / v: expected [batch, seqlen, heads, head_dim] shards, got {q.dim()} / {k.dim()} / {v.dim()} dims"
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        return f"k / v: shapes {list(k.shape)} / {list(v.shape)} do not match q {list(q.shape)}"
    if q.shape[1] != k.shape[1]:
        return f"k: {k.shape[1]} tokens in the shard, q {q.shape[1]}: each rank holds the same tokens of q, k, v"
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        return f"q: a zigzag shard holds two chunks of equal length; {q.shape[1]} tokens is odd"
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        return f"window_size: {tuple(window_size)} must be two sides >= -1 (-1 = unbounded)"
    if alibi_slopes is not None:
        return "alibi_slopes: ALiBi is not supported by context parallelism yet"
    if dropout_p > 0:
        return "dropout_p: dropout is not supported by context parallelism yet"
    return None


# ---- ring attention -------------------------------------------------------------------------------

class _Ring:
    """Sends tensors to the next rank of the group and receives the previous rank's, asynchronously
    (torch.distributed's batched isend / irecv)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = _rank_world(group)
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def start(self, tensors: Sequence[Tensor]):
        sent = [t.contiguous() for t in tensors]  # kept alive until the transfer is done
        received = [torch.empty_like(t) for t in sent]
        p2p = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        p2p += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return dist.batch_isend_irecv(p2p), sent, received

    @staticmethod
    def finish(pending) -> List[Tensor]:
        requests, _, received = pending
        for r in requests:
            r.wait()
        return received


def _blocks(layout: str, causal: bool, rank: int, src: int, n: int):
    """The attention blocks of this rank's queries against the K / V shard of rank `src`, each
    (query slice, key slice, causal, window): n is the shard's length. Without a causal mask
    every pair is one full block; with it, the shard's own block is causal, and the others are
    the parts the mask leaves whole (contiguous: all of an earlier rank's keys, none of a later
    one's; zigzag: all queries against an earlier rank's first chunk, or the second chunk's
    queries against all of a later rank's keys)."""
    everything, whole = slice(0, n), (-1, -1)
    if not causal:
        return [(everything, everything, False, whole, None)]
    if src == rank:
        return [(everything, everything, True, whole, None)]
    if layout == "contiguous":
        return [(everything, everything, False, whole, None)] if src < rank else []
    half = n // 2
    if src < rank:
        return [(everything, slice(0, half), False, whole, None)]
    return [(slice(half, n), everything, False, whole, None)]


def _window_blocks(layout: str, window: Tuple[int, int], rank: int, src: int, n: int, world: int):
    """The blocks of a sliding window (window_left, window_right; -1 unbounded, causal folded in
    as window_right 0), one per pair of this rank's query chunk and src's key chunk, trimmed to
    the rows that see a key of the chunk and the keys some row sees. Trimmed so, the last row
    sees a key and the last key is seen, which makes the band a window of the block's own
    bottom-right alignment with sides >= 0: row i sees key j iff
    i + off - wl' <= j <= i + off + wr', off = keys - rows."""
    left, right = window
    chunk = n // len(_chunks_of(rank, world, layout))
    blocks = []
    for qi, qc in enumerate(_chunks_of(rank, world, layout)):
        for ki, kc in enumerate(_chunks_of(src, world, layout)):
            qo, ko = qc * chunk, kc * chunk  # the chunks' first tokens in the whole sequence
            # Rows p see keys t with p - left <= t <= p + right.
            r0 = max(0, ko - right - qo) if right >= 0 else 0
            r1 = min(chunk, ko + chunk - 1 + left - qo + 1) if left >= 0 else chunk
            if r1 <= r0:
                continue
            c0 = max(0, qo + r0 - left - ko) if left >= 0 else 0
            c1 = min(chunk, qo + r1 - 1 + right - ko + 1) if right >= 0 else chunk
            if c1 <= c0:
                continue
            rows, keys = r1 - r0, c1 - c0
            shift = (qo + r0) - (ko + c0) - (keys - rows)  # the band's offset from the block's diagonal
            wl = left - shift if left >= 0 else -1
            wr = right + shift if right >= 0 else -1
            blocks.append((slice(qi * chunk + r0, qi * chunk + r1), slice(ki * chunk + c0, ki * chunk + c1), False,
                           (wl, wr), None))
    return blocks


def _document_blocks(layout: str, causal: bool, bounds: List[int], rank: int, src: int, n: int, world: int, device):
    """The blocks of packed documents (bounds: the documents' first tokens and the end, in the
    whole sequence), one per pair of this rank's query chunk and src's key chunk. A chunk against
    itself is one varlen call over the pieces of the documents it holds (causal or not); against
    an earlier chunk, at most the document holding the query chunk's first token reaches it: its
    rows against its keys there, a full block; against a later chunk (not causal), the document
    holding the query chunk's last token, likewise."""
    chunk = n // len(_chunks_of(rank, world, layout))

    def doc_of(pos):  # (start, end) of the document holding position pos
        lo, hi = 0, len(bounds) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if bounds[mid] <= pos else (lo, mid)
        return bounds[lo], bounds[hi]

    blocks = []
    for qi, qc in enumerate(_chunks_of(rank, world, layout)):
        for ki, kc in enumerate(_chunks_of(src, world, layout)):
            qo, ko = qc * chunk, kc * chunk
            at_q, at_k = qi * chunk, ki * chunk
            if qc == kc:
                cuts = sorted({0, chunk} | {b - qo for b in bounds if qo < b < qo + chunk})
                cu = torch.tensor(cuts, dtype=torch.int32, device=device)
                blocks.append((slice(at_q, at_q + chunk), slice(at_k, at_k + chunk), causal, (-1, -1), cu))
            elif kc < qc:
                start, end = doc_of(qo)
                if start < ko + chunk:
                    rows, keys = min(end, qo + chunk) - qo, max(start, ko) - ko
                    blocks.append((slice(at_q, at_q + rows), slice(at_k + keys, at_k + chunk), False, (-1, -1), None))
            elif not causal:
                start, end = doc_of(qo + chunk - 1)
                if end > ko:
                    rows, keys = max(start, qo) - qo, min(end, ko + chunk) - ko
                    blocks.append((slice(at_q + rows, at_q + chunk), slice(at_k, at_k + keys), False, (-1, -1), None))
    return blocks


class _Options:
    def __init__(self, causal, window, softmax_scale, softcap, layout, deterministic, group, bounds=None,
                 device=None):
        self.causal, self.softmax_scale, self.softcap = causal, softmax_scale, softcap
        self.layout, self.deterministic, self.group = layout, deterministic, group
        self.bounds, self.device = bounds, device  # packed documents: their boundaries, or None
        # A sliding window (causal folded in as window_right 0), or None: the plain blocks.
        left, right = window
        self.window = None if (left, right) == (-1, -1) else (left, 0 if causal else right)

    def blocks(self, rank: int, src: int, n: int, world: int):
        if self.bounds is not None:
            return _document_blocks(self.layout, self.causal, self.bounds, rank, src, n, world, self.device)
        if self.window is None:
            return _blocks(self.layout, self.causal, rank, src, n)
        return _window_blocks(self.layout, self.window, rank, src, n, world)


def _merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """acc (out, lse) <- the exact merge of two partial softmaxes over disjoint keys, in place
    (acc_out [b, s, h, d] in the accumulator dtype, acc_lse [b, h, s]). A row empty on both
    sides stays 0 / -inf; a NaN stays NaN."""
    new = torch.logaddexp(acc_lse, lse)
    empty = torch.isneginf(new)
    w_acc = torch.where(empty, 0.0, torch.exp(acc_lse - new)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(empty, 0.0, torch.exp(lse - new)).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


def _acc_dtype(x: Tensor):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ring_forward(q, k, v, sink, o: _Options):
    ring = _Ring(o.group)
    b, n, h, d = q.shape
    acc_out = torch.zeros((b, n, h, d), dtype=_acc_dtype(q), device=q.device)
    # A learnable sink is a partial result of its own, out 0 and LSE sink[h], merged like the
    # blocks: it joins every row exactly once, whichever blocks the row has.
    acc_lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    if sink is not None:
        acc_lse.copy_(sink.detach().float().view(1, h, 1).expand(b, h, n))
    kv = [k, v]
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        pending = ring.start(kv) if step + 1 < ring.world else None  # the next block, under this one
        for rows, keys, causal, window, cu in o.blocks(ring.rank, src, n, ring.world):
            if cu is None:
                out, lse = ops.run_forward(_TORCH, q[:, rows], kv[0][:, keys], kv[1][:, keys], None, None, None, None,
                                           None, None, None, o.softmax_scale, causal, window, o.softcap, None, 0.0,
                                           None)
            else:  # the documents' pieces of one chunk: a varlen call ([tokens, h, d], LSE [h, tokens])
                out, lse = ops.run_forward(_TORCH, q[0, rows], kv[0][0, keys], kv[1][0, keys], None, None, cu, cu,
                                           None, n, n, o.softmax_scale, causal, window, o.softcap, None, 0.0, None)
                out, lse = out.unsqueeze(0), lse.unsqueeze(0)
            _merge(acc_out[:, rows], acc_lse[:, :, rows], out, lse)
        if pending is not None:
            kv = _Ring.finish(pending)
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(dout, q, k, v, out, lse, sink, o: _Options):
    ring = _Ring(o.group)
    n = q.shape[1]
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    dsink = None
    if sink is not None:  # -sum over this rank's rows of P_sink * D (core/variant.hpp)
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, n]
        p_sink = torch.exp(sink.detach().to(acc).view(1, -1, 1) - lse.to(acc))
        dsink = -(torch.where(p_sink == 0, 0.0, p_sink * delta)).sum((0, 2)).float()
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        pending = ring.start(kv) if step + 1 < ring.world else None
        for rows, keys, causal, window, cu in o.blocks(ring.rank, src, n, ring.world):
            # The whole forward's out and LSE: each block's P and D are those of the whole row.
            if cu is None:
                grads = ops.backward(dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows],
                                     lse[:, :, rows], softmax_scale=o.softmax_scale, causal=causal,
                                     window_size=window, softcap=o.softcap, deterministic=o.deterministic)
            else:
                grads = ops.backward(dout[0, rows], q[0, rows], kv[0][0, keys], kv[1][0, keys], out[0, rows],
                                     lse[0, :, rows], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                     max_seqlen_k=n, softmax_scale=o.softmax_scale, causal=causal,
                                     softcap=o.softcap, deterministic=o.deterministic)
                grads = [g.unsqueeze(0) for g in grads]
            dq[:, rows] += grads[0]
            dkv[0][:, keys] += grads[1]
            dkv[1][:, keys] += grads[2]
        # dK / dV of the block travel on with it: after the last step they are back at its owner.
        dkv = _Ring.finish(ring.start(dkv)) if ring.world > 1 else dkv
        if pending is not None:
            kv = _Ring.finish(pending)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsink


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, options):
        out, lse = _ring_forward(q, k, v, sink, options)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = _ring_backward(dout.contiguous(), q, k, v, out, lse, sink, ctx.options)
        return dq, dk, dv, dsink if sink is not None else None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False, layout: str = "zigzag",
                   softmax_scale: Optional[float] = None, softcap: float = 0.0,
                   learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
                   window_size: Tuple[int, int] = (-1, -1), alibi_slopes: Optional[Tensor] = None,
                   dropout_p: float = 0.0, return_lse: bool = False, cu_seqlens: Optional[Tensor] = None):
    """Attention of one sequence sharded over the ranks of `group`, by ring (differentiable).

    Each rank computes its queries against its own K / V shard, then against each other rank's
    as the shards travel around the ring; the partial outputs are merged exactly through their
    LSE. The backward passes dK / dV round with the shards. Every rank must call it with its
    shard of the same sequence and the same options.

    Args:
        q: this rank's query shard, [batch, seqlen / world, heads, head_dim].
        k: its key shard, [batch, seqlen / world, heads_kv, head_dim] (GQA / MQA allowed).
        v: like k.
        group: the process group (None: the default one).
        causal: bool. The causal mask of the whole sequence.
        layout: "zigzag" (default; balances a causal mask's work) or "contiguous".
        softmax_scale: float, or None (1 / sqrt(head_dim)).
        softcap: float. > 0: scores become softcap * tanh(score / softcap).
        learnable_sink: float32 [heads], or None: flashattn's learnable sink, counted once per
            row. Its gradient on each rank is that rank's rows' share; summed over the group
            (as data-parallel training sums any replicated parameter's), it is the whole one.
        deterministic: bool. Bitwise reproducible gradients.
        window_size: (window_left, window_right) of the whole sequence (-1: unbounded side); a
            ring step computes only the rows and keys the window joins.
        alibi_slopes, dropout_p: not supported yet (must be the defaults).
        return_lse: bool. Also return the LSE of this rank's rows (float32
            [batch, heads, seqlen / world]).
        cu_seqlens: int32 [documents + 1], or None. Packed documents: the whole sequence (batch
            1) holds documents back to back, document i being tokens [cu_seqlens[i],
            cu_seqlens[i + 1]) of it (the same on every rank; read on the host once a call), and
            a token attends only within its document (causally, with causal=True). Not with a
            sliding window.

    Returns:
        out, this rank's shard of the output (like q); with return_lse, (out, lse).

    Raises:
        ValueError: on every rank, when any rank's arguments are invalid (that rank's error
            names the argument) or the ranks' shapes or options differ, before any block is
            sent; the message of torch.distributed when the group fails.
    """
    problem = _check(q, k, v, layout, alibi_slopes, dropout_p, window_size)
    bounds = None
    if problem is None and cu_seqlens is not None:
        bounds, problem = _documents(cu_seqlens, q, window_size, dist.get_world_size(group))
    _agree(group, q, problem, _fields(problem, q, k, causal, layout, window_size, bounds), "ring_attention")
    options = _Options(bool(causal), tuple(window_size), softmax_scale, float(softcap), layout, bool(deterministic),
                       group, bounds, q.device)
    out, lse = _RingAttention.apply(q, k, v, learnable_sink, options)
    return (out, lse) if return_lse else out


# ---- Ulysses --------------------------------------------------------------------------------------

def _all_to_all(x: Tensor, group) -> Tensor:
    """x [world, ...] -> [world, ...]: slice i to rank i, slice i of the result from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """[b, n, h, d] sequence shards -> [b, world n, h / world, d] head shards (rank order)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _seq_to_heads(x, group, world)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group, ctx.world), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _heads_to_seq(x, group, world)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group, ctx.world), None, None


def _seq_to_heads(x, group, world):
    b, n, h, d = x.shape
    parts = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4)  # [world, b, n, h/w, d]
    got = _all_to_all(parts, group)  # got[r]: rank r's tokens of this rank's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def _heads_to_seq(x, group, world):
    b, total, hw, d = x.shape
    n = total // world
    parts = x.reshape(b, world, n, hw, d).permute(1, 0, 2, 3, 4)  # [world, b, n, h/w, d]
    got = _all_to_all(parts, group)  # got[r]: this rank's tokens of rank r's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, world * hw, d)


def seq_to_heads(x: Tensor, group=None) -> Tensor:
    """Sequence shards of every head -> every rank's sequence shards of this rank's heads: an
    all-to-all over `group` (differentiable; heads_to_seq is its inverse).

    Args:
        x: [batch, n, heads, head_dim], this rank's n tokens; heads a multiple of the group's size.
        group: the process group (None: the default one).

    Returns:
        [batch, world n, heads / world, head_dim]: the group's tokens in rank order, for heads
        [rank heads / world, (rank + 1) heads / world).
    """
    return _SeqToHeads.apply(x, group, dist.get_world_size(group))


def heads_to_seq(x: Tensor, group=None) -> Tensor:
    """The inverse of seq_to_heads: [batch, world n, heads / world, head_dim] ->
    [batch, n, heads, head_dim] (differentiable)."""
    return _HeadsToSeq.apply(x, group, dist.get_world_size(group))


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False, layout: str = "zigzag",
                      softmax_scale: Optional[float] = None, softcap: float = 0.0,
                      learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
                      window_size: Tuple[int, int] = (-1, -1), alibi_slopes: Optional[Tensor] = None,
                      dropout_p: float = 0.0, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Attention of one sequence sharded over the ranks of `group`, by an all-to-all over heads
    (DeepSpeed-Ulysses; differentiable): each rank attends over the whole sequence for
    heads / world of the heads. heads and heads_kv must be multiples of the group's size.

    Args:
        q, k, v: this rank's shards, as ring_attention's.
        group: the process group (None: the default one).
        causal: bool. The causal mask of the whole sequence.
        layout: the shards' layout, "zigzag" or "contiguous".
        softmax_scale: float, or None (1 / sqrt(head_dim)).
        softcap: float. > 0: scores become softcap * tanh(score / softcap).
        learnable_sink: float32 [heads], or None. Its gradient is this rank's heads' (the
            others' entries 0); summed over the group it is the whole one.
        deterministic: bool. Bitwise reproducible gradients.
        window_size: (window_left, window_right) of the whole sequence (-1: unbounded side); a
            ring step computes only the rows and keys the window joins.
        alibi_slopes, dropout_p: not supported yet (must be the defaults).
        cu_seqlens: int32 [documents + 1], or None: packed documents, as ring_attention's.

    Returns:
        This rank's shard of the output, like q.

    Raises:
        ValueError: as ring_attention's, and for heads not a multiple of the group's size.
    """
    from . import torch as fa_torch

    rank, world = _rank_world(group)
    problem = _check(q, k, v, layout, alibi_slopes, dropout_p, window_size)
    if problem is None and (q.shape[2] % world != 0 or k.shape[2] % world != 0):
        problem = (f"q / k: heads {q.shape[2]} / {k.shape[2]} must be multiples of the group's {world} ranks "
                   f"(Ulysses gives each rank heads / world of them)")
    bounds = None
    if problem is None and cu_seqlens is not None:
        bounds, problem = _documents(cu_seqlens, q, window_size, world)
    _agree(group, q, problem, _fields(problem, q, k, causal, layout, window_size, bounds), "ulysses_attention")
    qh, kh, vh = (_reorder(_SeqToHeads.apply(x, group, world), world, layout, 1, True) for x in (q, k, v))
    sink = None
    if learnable_sink is not None:
        per = q.shape[2] // world
        sink = learnable_sink[rank * per:(rank + 1) * per]
    options = dict(causal=causal, window_size=tuple(window_size), softmax_scale=softmax_scale, softcap=softcap,
                   deterministic=deterministic, learnable_sink=sink)
    if bounds is None:
        out = fa_torch.attention(qh, kh, vh, **options)
    else:  # the whole packed sequence of these heads: one varlen call
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        out = fa_torch.attention(qh[0], kh[0], vh[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                 max_seqlen_k=longest, **options).unsqueeze(0)
    return _HeadsToSeq.apply(_reorder(out, world, layout, 1, False), group, world)


__all__ = ["ring_attention", "ulysses_attention", "seq_to_heads", "heads_to_seq", "shard", "unshard", "LAYOUTS"]
