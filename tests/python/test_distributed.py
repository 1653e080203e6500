"""Context parallelism (flashattn.distributed) in several processes on CPU tensors with gloo:
ring and Ulysses attention, zigzag and contiguous layouts, causal and not, world sizes 2, 3 and
4, forward and gradients against one process's attention of the whole sequence:
- float32 with a learnable sink and GQA, within the tolerance rule with one process's float32
  result as the rule's baseline (the reference: the whole sequence in float64);
- bfloat16 within the tolerance rule against the float64 reference and the bfloat16 naive;
- float64 with softcap, with sliding windows narrower and wider than a shard, and with packed
  documents against flash_attn_varlen_func, within 1e-6 (the LSE that joins the blocks is
  float32);
the hybrid (Ulysses within groups of 2, the ring across them) in 4 processes; a rank with
invalid arguments makes every rank raise instead of waiting; and the example
(examples/context_parallel.py) trains one step under torchrun."""
from __future__ import annotations

import datetime
import os
import pathlib
import socket
import subprocess
import sys
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
dist = torch.distributed
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

import reference  # noqa: E402
from tolerance import atol_for, check_close, max_abs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(dtype, seed, b=2, s=48, h=4, hkv=2, d=16):
    """q, k, v, dout of a whole sequence, and a sink; the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
    dout = torch.randn(b, s, h, d, generator=g).to(dtype)
    sink = (torch.rand(h, generator=g) * 3 - 1).float()
    return q, k, v, dout, sink


def _whole(q, k, v, dout, sink, causal, softcap=0.0, window=(-1, -1)):
    """One process's attention of the whole sequence and its gradients (d sink included)."""
    import flashattn

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    s = sink.detach().clone().requires_grad_() if sink is not None else None
    out = flashattn.flash_attn_func(*leaves, causal=causal, softcap=softcap, window_size=window, learnable_sink=s)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves], (s.grad if s is not None else None)


def _sharded(fn, q, k, v, dout, sink, causal, layout, softcap=0.0, window=(-1, -1)):
    """fn's result on this rank's shards, gathered back: out, (dq, dk, dv), d sink summed."""
    import flashattn.distributed as cp

    shards = [cp.shard(x.detach(), layout=layout).requires_grad_() for x in (q, k, v)]
    s = sink.detach().clone().requires_grad_() if sink is not None else None
    out = fn(*shards, causal=causal, layout=layout, softcap=softcap, window_size=window, learnable_sink=s)
    out.backward(cp.shard(dout, layout=layout))
    dsink = None
    if s is not None:
        dsink = s.grad.clone()
        dist.all_reduce(dsink)
    return (cp.unshard(out.detach(), layout=layout), [cp.unshard(x.grad, layout=layout) for x in shards], dsink)


def _np(t):
    return t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()


def _check_rule(name, ours, exact, naive, factor, dtype):
    check_close(name, _np(ours), exact, naive, factor, atol_for(dtype, max_abs(exact)))


def _cases(rank, world):
    import flashattn.distributed as cp

    failures = []
    for fn in (cp.ring_attention, cp.ulysses_attention):
        # Ulysses splits the heads over the ranks: GQA with 2 query heads a kv head, world kv heads.
        heads = dict(h=2 * world, hkv=world) if fn is cp.ulysses_attention else dict(h=4, hkv=2)
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                where = f"{fn.__name__} {layout}{' causal' if causal else ''} world {world}"
                try:
                    # float64, with softcap: within the float32 LSE's rounding of one process's result.
                    q, k, v, dout, sink = _inputs(torch.float64, 1, **heads)
                    want = _whole(q, k, v, dout, sink, causal, softcap=3.0)
                    got = _sharded(fn, q, k, v, dout, sink, causal, layout, softcap=3.0)
                    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), [got[0], *got[1], got[2]],
                                          [want[0], *want[1], want[2]]):
                        err = (a.double() - b.double()).abs().max().item()
                        bound = 1e-6 * max(1.0, b.abs().max().item())
                        assert err <= bound, f"float64 {name}: max error {err:.3g} > {bound:.3g}"
                    # float32 with a sink (the reference: the whole sequence in float64, on the
                    # float32 inputs; the naive: the whole sequence in float32, the same code).
                    q, k, v, dout, sink = _inputs(torch.float32, 2, **heads)
                    exact = _whole(q.double(), k.double(), v.double(), dout.double(), sink, causal)
                    naive = _whole(q, k, v, dout, sink, causal)
                    got = _sharded(fn, q, k, v, dout, sink, causal, layout)
                    for name, a, e, n, factor in zip(("out", "dq", "dk", "dv", "dsink"), [got[0], *got[1], got[2]],
                                                     [exact[0], *exact[1], exact[2]],
                                                     [naive[0], *naive[1], naive[2]], (2, 3, 3, 3, 3)):
                        _check_rule(f"float32 {name}", a, _np(e), _np(n), factor, "float32")
                    # bfloat16 within the rule of the numpy reference and naive.
                    q, k, v, dout, _ = _inputs(torch.bfloat16, 3, **heads)
                    got = _sharded(fn, q, k, v, dout, None, causal, layout)
                    qn, kn, vn, dn = (_np(x).astype(reference.F64) for x in (q, k, v, dout))
                    out_ref, _ = reference.forward(qn, kn, vn, causal=causal)
                    grads_ref = reference.backward(dn, qn, kn, vn, causal=causal)
                    import ml_dtypes

                    bf = [x.astype(ml_dtypes.bfloat16) for x in (qn, kn, vn, dn)]
                    out_naive, _ = reference.naive_forward(*bf[:3], causal=causal)
                    grads_naive = reference.naive_backward(bf[3], *bf[:3], causal=causal)
                    _check_rule("bfloat16 out", got[0], out_ref, out_naive, 2, "bfloat16")
                    scale = max_abs(*grads_ref)
                    for name, a, e, n in zip(("dq", "dk", "dv"), got[1], grads_ref, grads_naive):
                        check_close(f"bfloat16 {name}", _np(a), e, n, 3, atol_for("bfloat16", scale))
                    # Sliding windows, narrower and wider than a shard (causal: left only).
                    for window in ((5, -1 if causal else 3), (13, -1 if causal else 20)):
                        q, k, v, dout, sink = _inputs(torch.float64, 6, **heads)
                        want = _whole(q, k, v, dout, sink, causal, window=window)
                        got = _sharded(fn, q, k, v, dout, sink, causal, layout, window=window)
                        for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), [got[0], *got[1], got[2]],
                                              [want[0], *want[1], want[2]]):
                            err = (a.double() - b.double()).abs().max().item()
                            bound = 1e-6 * max(1.0, b.abs().max().item())
                            assert err <= bound, f"window {window} {name}: max error {err:.3g} > {bound:.3g}"
                    _check_documents(fn, q, k, v, dout, causal, layout, world)  # as flash_attn_varlen_func's
                except Exception:  # reported by the test, with the case
                    failures.append(f"{where}: {traceback.format_exc(limit=3)}")
    if world == 4:  # the hybrid: Ulysses within "nodes" {0, 1}, {2, 3}, the ring across them
        try:
            _check_hybrid(rank)
        except Exception:
            failures.append(f"hybrid: {traceback.format_exc(limit=3)}")
    # A rank with invalid arguments: every rank raises, naming it, and nobody waits.
    q, k, v, _, _ = _inputs(torch.float32, 4)
    qs, ks, vs = (cp.shard(x, layout="zigzag") for x in (q, k, v))
    if rank == world - 1:
        ks = ks[..., :8]  # a head_dim that does not match q's
    try:
        cp.ring_attention(qs, ks, vs, causal=True)
        failures.append(f"rank {rank}: no error for another rank's bad arguments")
    except ValueError as e:
        expected = "k / v: shapes" if rank == world - 1 else "another rank's arguments are invalid"
        if expected not in str(e):
            failures.append(f"rank {rank}: unexpected message {e}")
    # Ranks that disagree on the documents: every rank raises, none computes a wrong result.
    q1, k1, v1 = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v))
    total = q1.shape[1]
    cu = torch.tensor([0, 10 if rank == 0 else 20, total], dtype=torch.int32)
    try:
        cp.ring_attention(*(cp.shard(x, layout="zigzag") for x in (q1, k1, v1)), causal=True, cu_seqlens=cu)
        failures.append(f"rank {rank}: no error for documents that differ between ranks")
    except ValueError as e:
        if "documents differ" not in str(e):
            failures.append(f"rank {rank}: unexpected message {e}")
    return failures


def _check_documents(fn, q, k, v, dout, causal, layout, world):
    """Packed documents (batch 1): fn with cu_seqlens against one process's
    flash_attn_varlen_func, documents longer and shorter than a chunk, one of a single token."""
    import flashattn
    import flashattn.distributed as cp

    n = q.shape[1] * q.shape[0]  # the batch entries laid end to end: one packed sequence
    q, k, v, dout = (x.reshape(1, n, *x.shape[2:]) for x in (q, k, v, dout))
    lengths = [1, 17, 5, n - 1 - 17 - 5 - 30, 30]
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32)
    leaves = [x[0].detach().clone().requires_grad_() for x in (q, k, v)]
    want = flashattn.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=causal)
    want.backward(dout[0])
    shards = [cp.shard(x.detach(), layout=layout).requires_grad_() for x in (q, k, v)]
    out = fn(*shards, causal=causal, layout=layout, cu_seqlens=cu)
    out.backward(cp.shard(dout, layout=layout))
    got = [cp.unshard(out.detach(), layout=layout)[0]] + [cp.unshard(x.grad, layout=layout)[0] for x in shards]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [want.detach()] + [x.grad for x in leaves]):
        err = (a - b).abs().max().item()
        assert err <= 1e-6 * max(1.0, b.abs().max().item()), f"documents {name}: max error {err:.3g}"


def _check_hybrid(rank):
    import flashattn.distributed as cp

    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]  # every rank makes every group
    node, ring = groups[rank // 2], groups[2 + rank % 2]
    q, k, v, dout, _ = _inputs(torch.float64, 5, h=4, hkv=2)
    want = _whole(q, k, v, dout, None, True)
    local = [cp.shard(cp.shard(x, ring), node, layout="contiguous").requires_grad_() for x in (q, k, v)]
    heads = [cp.seq_to_heads(x, node) for x in local]
    out = cp.heads_to_seq(cp.ring_attention(*heads, group=ring, causal=True), node)
    out.backward(cp.shard(cp.shard(dout, ring), node, layout="contiguous"))
    for name, a, b in zip(("out", "dq", "dk", "dv"), [out.detach(), *[x.grad for x in local]], [want[0], *want[1]]):
        ref = cp.shard(cp.shard(b, ring), node, layout="contiguous")
        err = (a - ref).abs().max().item()
        assert err <= 1e-6 * max(1.0, ref.abs().max().item()), f"hybrid {name}: max error {err:.3g}"


def _worker(rank, world, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        queue.put((rank, _cases(rank, world)))
    except Exception:
        queue.put((rank, [traceback.format_exc()]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_equals_one_process(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    failures = [f"rank {r}: {f}" for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)


def test_example_trains_one_step():
    example = ROOT / "examples" / "context_parallel.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), str(example)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loss" in run.stdout and "ring == ulysses" in run.stdout, run.stdout[-2000:]
