#!/usr/bin/env python3
"""The benchmark suite (GPU machine): flashattn against every attention implementation available in
the same process, on the grids users compare libraries by, with the machine's ceilings measured in
the same run. bench/report.py turns its output into charts and a Markdown report.

Implementations: ours (the Python package, bench/_ours.py); PyTorch SDPA's backends FLASH
(FlashAttention-2), CUDNN, EFFICIENT (xFormers' memory-efficient kernel) and MATH (unfused:
S and P materialised); FlexAttention under torch.compile; and the flash_attn package (FA2) and
FlashAttention-4 (flash_attn.cute) where installed. One that cannot run a config (not installed,
unsupported shape, out of memory) gets its first error line in the results instead of a time.

Parts:
- prefill: seqlen 512..16k at 16k tokens per call, heads = 2048 / d, d in {64, 128, 256}, causal
  and not, bf16 and fp16; directions fwd, bwd (from a saved forward), fwd_bwd. FLOPs as in
  docs/PERFORMANCE.md: forward 4 * b * h * s^2 * d, halved for causal; bwd 2.5x, fwd+bwd 3.5x.
- decode: one query token against a K/V context of 1k..128k tokens, batch 1..128, d 128, 32 query
  heads with 32 (MHA) or 8 (GQA) K/V heads, bf16; reported as TB/s of K/V read (2 * b * ctx *
  h_kv * d * 2 bytes over the call's time) and as a fraction of the device copy's bandwidth
  measured in the same run. Configs whose K/V cache exceeds --decode-max-gib are left out.
- memory: peak extra device memory against seqlen (1k..64k, batch 1, 16 heads, d 128, bf16) of
  standard attention (S and P materialised, in PyTorch) and ours, forward and forward + backward:
  O(N^2) against O(N), and where standard attention runs out of memory.
- ceilings: the bf16 GEMM (8192^3) and the device copy (512 MiB), same timer.

Timing (bench/_timing.py): CUDA events, L2 flushed and a GPU spin before every call, warm-up, 0.2 s
of the same calls before timing (power-capped clock settled), median of the repeats, in interleaved
rounds of rotating order (3; 1 with --quick), median of the round medians. The spin (LEAD_CYCLES)
is why host time is never timed: a decode call's GPU work is 10-20 us, less than the host side of a
call through the Python package (or through PyTorch's autograd), and without the spin the GPU
would reach the start event and wait for the host to queue the call; with it the call is queued
long before, for every implementation alike. Our outputs are allocated once per config (as a
framework's caller would reuse them), passed as out= / lse= / dq= / dk= / dv=.

  scripts/bench.sh DIR [--quick] [--parts prefill,decode,memory]      (installs the package, then this and the report)
  python3 bench/suite.py --out DIR [--quick] [--parts prefill,decode,memory]   (with flashattn importable)

Writes DIR/suite.json (everything, with the machine's description) and DIR/suite.csv (one line per
timed implementation), and prints each config's line while a progress bar counts configs.
--quick (under 3 minutes on an H100): bf16, d 128, seqlen 2k and 8k; decode batch 1 and 32 at 4k
and 64k; memory at 1k, 8k and 64k.
"""
import argparse
import csv
import json
import os
import sys
import time
import warnings

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # a machine without PyTorch: --list only
    torch = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ours  # noqa: E402
from _timing import (LEAD_CYCLES, ROUNDS, Timer, batch_heads, ceilings, environment, forward_flops,  # noqa: E402
                     time_interleaved)

FLOP_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
SDPA_PEERS = {"fa2": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
              "math": "MATH"}
IMPLEMENTATIONS = ("flashattn", *SDPA_PEERS, "flex", "flash_attn", "flash_attn_4")
LABELS = {"flashattn": "ours", "flashattn_page16": "ours, pages of 16", "flashattn_page256": "ours, pages of 256",
          "flashattn_page16_host": "ours, pages of 16, host-checked table", "flashattn_kvcache": "ours (decode kernels)",
          "fa2": "FA2 (SDPA)", "cudnn": "cuDNN", "efficient": "EFFICIENT", "math": "MATH",
          "flex": "FlexAttention", "flash_attn": "flash_attn", "flash_attn_4": "FA4"}
DECODE = {"head_dim": 128, "heads": 32, "kv_heads": (32, 8)}
DECODE_PAGES = (16, 256)  # page sizes of the paged-cache runs of ours
DECODE_COLUMNS = ("flashattn", "flashattn_page16", "flashattn_page256", "flashattn_page16_host", *SDPA_PEERS, "flex",
                  "flash_attn")
MEMORY_SHAPE = {"batch": 1, "heads": 16, "head_dim": 128}
MiB = 1 << 20


# ----------------------------------------------------------------------------- grids

def prefill_grid(dtypes, head_dims, seqlens):
    return [{"dtype": dt, "head_dim": d, "causal": causal, "seqlen": s}
            for dt in dtypes for d in head_dims for causal in (False, True) for s in seqlens]


def decode_grid(contexts, batches, max_gib):
    """(config, skipped): configs within the K/V budget, and those left out."""
    configs, skipped = [], []
    for kv_heads in DECODE["kv_heads"]:
        for batch in batches:
            for ctx in contexts:
                c = {"dtype": "bfloat16", "head_dim": DECODE["head_dim"], "heads": DECODE["heads"],
                     "kv_heads": kv_heads, "batch": batch, "context": ctx}
                (configs if kv_bytes(c) <= max_gib * (1 << 30) else skipped).append(c)
    return configs, skipped


def kv_bytes(c):
    return 2 * c["batch"] * c["context"] * c["kv_heads"] * c["head_dim"] * 2


# ----------------------------------------------------------------------------- implementations

class AutogradPeer:
    """A peer called through PyTorch autograd. attend(q, k, v) takes and returns [b, s, h, d]
    tensors (views are fine); it runs on leaves sharing q, k, v's memory, with dout as the output
    gradient."""

    def __init__(self, attend, q, k, v, dout):
        self.attend = attend
        self.leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        self.dout = dout
        self.saved = None

    def fwd(self):
        with torch.no_grad():
            return self.attend(*self.leaves)

    def fwd_bwd(self):
        return torch.autograd.grad(self.attend(*self.leaves), self.leaves, self.dout)

    def bwd(self):
        """The backward alone: the forward runs in the first (untimed, warm-up) call."""
        if self.saved is None:
            self.saved = self.attend(*self.leaves)
        return torch.autograd.grad(self.saved, self.leaves, self.dout, retain_graph=True)


def sdpa_attend(backend_name, causal, gqa, dropout_p=0.0):
    backend = getattr(SDPBackend, backend_name)

    def attend(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, enable_gqa=gqa, dropout_p=dropout_p)
        return out.transpose(1, 2)

    return attend


_compiled_flex = None


def flex_attend(causal, gqa, seqlen_q, seqlen_k):
    """FlexAttention compiled once per process (recompiled by torch per shape); causal through a
    block mask (bottom-right aligned, as ours)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _compiled_flex is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        shift = seqlen_k - seqlen_q
        block_mask = create_block_mask(lambda b, h, q, kv: q + shift >= kv, None, None, seqlen_q, seqlen_k)

    def attend(q, k, v):
        out = _compiled_flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                             enable_gqa=gqa)
        return out.transpose(1, 2)

    return attend


def package_attend(name, causal):
    """flash_attn's (or FlashAttention-4's) flash_attn_func on [b, s, h, d] tensors; ImportError
    where the package is not installed."""
    if name == "flash_attn":
        from flash_attn import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func

    def attend(q, k, v):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return attend


PEERS = tuple(name for name in IMPLEMENTATIONS if name != "flashattn")
selected_peers = PEERS  # --peers


def peer_attends(causal, gqa, seqlen_q, seqlen_k):
    """name -> attend function, or name -> error string where it cannot be built (the peers
    selected by --peers)."""
    attends = {name: sdpa_attend(backend, causal, gqa) for name, backend in SDPA_PEERS.items()
               if name in selected_peers}
    builders = {"flex": lambda: flex_attend(causal, gqa, seqlen_q, seqlen_k),
                "flash_attn": lambda: package_attend("flash_attn", causal),
                "flash_attn_4": lambda: package_attend("flash_attn_4", causal)}
    for name, build in builders.items():
        if name not in selected_peers:
            continue
        try:
            attends[name] = build()
        except ImportError as err:
            attends[name] = f"not installed ({err.name or err})"
        except Exception as err:  # noqa: BLE001 -- an API this torch lacks: reported, not fatal
            attends[name] = first_line(err)
    return attends


class Ours:
    """flashattn through the Python package (bench/_ours.py): fwd writes out / lse; bwd (when built
    with_backward) writes dq / dk / dv, which start as NaN so unwritten elements show. The outputs
    are allocated once, here, from PyTorch's allocator; the package takes each call's workspace
    from the same allocator. Built, it has run one forward (and one backward): a config this
    build cannot run raises RuntimeError here, and the backward starts from a forward's out / LSE."""

    def __init__(self, q, k, v, dout, causal, with_backward, deterministic=False, dropout_p=0.0):
        self.q, self.k, self.v, self.dout = q, k, v, dout
        self.causal, self.deterministic = causal, deterministic
        batch, seqlen, heads, _ = q.shape
        self.out = torch.full_like(q, float("nan"))
        self.lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
        seed = 1 if dropout_p > 0 else None  # the same keep-mask every call, forward and backward
        self.fwd = _ours.forward_call(q, k, v, self.out, self.lse, causal=causal, dropout_p=dropout_p, seed=seed)
        self.fwd()
        if with_backward:
            self.grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            self.bwd = _ours.backward_call(dout, q, k, v, self.out, self.lse, *self.grads, causal=causal,
                                           deterministic=deterministic, dropout_p=dropout_p, seed=seed)
            self.bwd()

    def fwd_bwd(self):
        self.fwd()
        self.bwd()

    def workspace_bytes(self):
        """The backward's workspace: what it requests from PyTorch's allocator beyond its
        preallocated gradients (the library's workspace query, exactly)."""
        return _ours.requested_bytes(self.bwd)

    def fresh_bwd(self):
        """One backward into gradients and a workspace allocated in the call (what a backward
        needs beyond its inputs)."""
        return _ours.package().backward(self.dout, self.q, self.k, self.v, self.out, self.lse, causal=self.causal,
                                        deterministic=self.deterministic)

    def fresh_fwd_bwd(self):
        """A forward and a backward into outputs, gradients and workspaces allocated in the calls
        (the memory part: everything the pair needs beyond its inputs)."""
        out, lse = self.fresh_fwd()
        grads = _ours.package().backward(self.dout, self.q, self.k, self.v, out, lse, causal=self.causal,
                                         deterministic=self.deterministic)
        return out, grads

    def fresh_fwd(self):
        return _ours.package().forward(self.q, self.k, self.v, causal=self.causal)


def guarded(fn):
    """fn, with any failure raised as a RuntimeError, which the timer records as the peer's error
    (a compiler's or a package's own exception types included)."""
    def run():
        try:
            return fn()
        except RuntimeError:
            raise
        except Exception as err:  # noqa: BLE001
            raise RuntimeError(f"{type(err).__name__}: {first_line(err)}") from err

    return run


def first_line(err):
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def random_tensors(dtype, shapes, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", dtype=dtype, generator=gen) for shape in shapes]


# ----------------------------------------------------------------------------- prefill

def bench_prefill(timer, config, directions, rounds):
    c = dict(config)
    batch, heads = batch_heads(c["head_dim"], c["seqlen"])
    c.update(batch=batch, heads=heads, errors={})
    shape = (batch, c["seqlen"], heads, c["head_dim"])
    q, k, v, dout = random_tensors(getattr(torch, c["dtype"]), [shape] * 4, hash(tuple(config.values())) & 0xFFFF)
    needs_backward = any(d != "fwd" for d in directions)
    fns = {d: {} for d in directions}
    ours = None
    try:
        ours = Ours(q, k, v, dout, c["causal"], needs_backward)
        for d in directions:
            fns[d]["flashattn"] = getattr(ours, d)
    except RuntimeError as err:
        c["errors"]["flashattn"] = first_line(err)
    for name, attend in peer_attends(c["causal"], False, c["seqlen"], c["seqlen"]).items():
        if isinstance(attend, str):
            c["errors"][name] = attend
            continue
        peer = AutogradPeer(attend, q, k, v, dout)
        for d in directions:
            fns[d][name] = guarded(getattr(peer, d))
    fwd_flops = forward_flops(batch, heads, c["seqlen"], c["seqlen"], c["head_dim"], c["causal"])
    for d in directions:
        c[d] = {"tflops": {}, "ms": {}}
        time_interleaved(timer, fns[d], FLOP_FACTORS[d] * fwd_flops, c[d], rounds)
    c["max_abs_diff_vs_fa2"] = check_vs_fa2(c, ours, q, k, v)
    return c


def check_vs_fa2(c, ours, q, k, v):
    """max |ours - SDPA FLASH| of the output after the timings (None where either cannot run)."""
    if ours is None or "fa2" in c["errors"]:
        return None
    try:
        ours.fwd()
        reference = sdpa_attend("FLASH_ATTENTION", c["causal"], False)(q, k, v)
    except RuntimeError:
        return None
    return (ours.out.float() - reference.float()).abs().max().item()


# ----------------------------------------------------------------------------- decode

def bench_decode(timer, config, copy_tbps, rounds):
    c = dict(config, errors={})
    b, h, hkv, d, ctx = c["batch"], c["heads"], c["kv_heads"], c["head_dim"], c["context"]
    gqa = hkv != h
    q, k, v = random_tensors(torch.bfloat16, [(b, 1, h, d), (b, ctx, hkv, d), (b, ctx, hkv, d)], ctx + b + hkv)
    fns = {}
    # Ours: the KV-cache decode kernels (forward_kvcache: the cache contiguous, then in shuffled
    # pages of 16 and 256 tokens); a build without them runs the prefill kernels (forward). The
    # paged calls check the table on the device (index_check="device": the asynchronous call a
    # decode loop makes); pages of 16 once more with the host check, whose copy of the table waits
    # on the stream. The contiguous cache has no index to check (index_check="host" copies nothing).
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(b, h, 1, device="cuda", dtype=torch.float32)
    try:
        fns["flashattn"] = _ours.kvcache_call(q, k, v, out, lse, index_check="host")
        fns["flashattn"]()
        for page in DECODE_PAGES:
            kp, vp, table = paged(k, v, page, ctx + page)
            fns[f"flashattn_page{page}"] = _ours.kvcache_call(q, kp, vp, out, lse, table, index_check="device")
            if page == DECODE_PAGES[0]:
                fns[f"flashattn_page{page}_host"] = _ours.kvcache_call(q, kp, vp, out, lse, table,
                                                                       index_check="host")
        for fn in fns.values():
            fn()  # (a call this build cannot make raises here)
    except RuntimeError as err:
        c["errors"]["flashattn_kvcache"] = first_line(err)
        try:
            fns["flashattn"] = Ours(q, k, v, None, False, False).fwd
        except RuntimeError as err2:
            c["errors"]["flashattn"] = first_line(err2)
    for name, attend in peer_attends(False, gqa, 1, ctx).items():
        if name == "math" and kv_bytes(c) > (4 << 30):
            c["errors"][name] = "left out: unfused, too slow at this size"
        elif isinstance(attend, str):
            c["errors"][name] = attend
        else:
            fns[name] = guarded(AutogradPeer(attend, q, k, v, None).fwd)
    c["fwd"] = {"tflops": {}, "ms": {}}
    time_interleaved(timer, fns, forward_flops(b, h, 1, ctx, d, False), c["fwd"], rounds)
    c["fwd"]["tbps"] = {name: kv_bytes(c) / ms / 1e9 for name, ms in c["fwd"]["ms"].items()}
    c["fwd"]["fraction_of_copy"] = {name: tbps / copy_tbps for name, tbps in c["fwd"]["tbps"].items()}
    del q, k, v, fns
    torch.cuda.empty_cache()
    return c


def paged(k, v, page, seed, shuffle=True):
    """k / v [b, s, hkv, d] as caches of `page`-token blocks in a shuffled order (in order with
    shuffle=False: the same memory as the contiguous cache), and the block_table [b, pages] that
    finds them."""
    b, s, hkv, d = k.shape
    pages = -(-s // page)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(b * pages, generator=generator) if shuffle else torch.arange(b * pages)
    table = order.to(torch.int32).view(b, pages).cuda()
    padded = pages * page
    blocks = []
    for t in (k, v):
        src = torch.zeros(b, padded, hkv, d, dtype=t.dtype, device=t.device)
        src[:, :s] = t
        dst = torch.empty(b * pages, page, hkv, d, dtype=t.dtype, device=t.device)
        dst[table.view(-1).long()] = src.view(b * pages, page, hkv, d)
        blocks.append(dst)
    return blocks[0], blocks[1], table


# ----------------------------------------------------------------------------- memory

def standard_attention(q, k, v):
    """Attention with S and P materialised (what FlashAttention avoids), on [b, s, h, d]."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.matmul(qt, kt.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, vt).transpose(1, 2)


def peak_extra_bytes(fn):
    """Peak bytes PyTorch's allocator handed out during fn() beyond what it held before (after one
    warm-up call); an out-of-memory error as its first line."""
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return peak
    except torch.OutOfMemoryError as err:
        return "out of memory: " + first_line(err)[:80]
    finally:
        torch.cuda.empty_cache()


def bench_memory(seqlen):
    b, h, d = MEMORY_SHAPE["batch"], MEMORY_SHAPE["heads"], MEMORY_SHAPE["head_dim"]
    q, k, v, dout = random_tensors(torch.bfloat16, [(b, seqlen, h, d)] * 4, seqlen)
    row = {"seqlen": seqlen, "bytes": {}}
    ours = Ours(q, k, v, dout, False, False)
    row["bytes"]["flashattn_fwd"] = peak_extra_bytes(ours.fresh_fwd)
    row["bytes"]["flashattn_fwd_bwd"] = peak_extra_bytes(ours.fresh_fwd_bwd)
    standard = AutogradPeer(standard_attention, q, k, v, dout)
    row["bytes"]["standard_fwd"] = peak_extra_bytes(standard.fwd)
    row["bytes"]["standard_fwd_bwd"] = peak_extra_bytes(standard.fwd_bwd)
    return row


# ----------------------------------------------------------------------------- output

def csv_rows(results):
    """One line per (part, config, direction, implementation) with a time or an error."""
    for part in ("prefill", "decode"):
        for c in results.get(part, []):
            for direction in FLOP_FACTORS:
                if direction not in c:
                    continue
                m = c[direction]
                for name in IMPLEMENTATIONS:
                    base = {"part": part, "dtype": c["dtype"], "head_dim": c["head_dim"],
                            "causal": c.get("causal", False), "seqlen": c.get("seqlen", 1),
                            "context": c.get("context", c.get("seqlen")), "batch": c["batch"], "heads": c["heads"],
                            "kv_heads": c.get("kv_heads", c["heads"]), "direction": direction, "impl": name}
                    error = m.get("errors", {}).get(name) or c["errors"].get(name)
                    yield {**base, "ms": m["ms"].get(name), "tflops": m["tflops"].get(name),
                           "tbps": m.get("tbps", {}).get(name), "error": error}


def write_outputs(out_dir, results):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "suite.json"), "w") as f:
        json.dump(results, f, indent=1)
    rows = list(csv_rows(results))
    if rows:
        with open(os.path.join(out_dir, "suite.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def progress(total):
    """tqdm's bar on stderr where installed, else a counter in each printed line."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, file=sys.stderr, unit="config", dynamic_ncols=True)
    except ImportError:
        return None


def say(bar, line):
    if bar is None:
        print(line, flush=True)
    else:
        bar.write(line)


def fmt_time(m, name, key="tflops", spec="7.1f"):
    value = m[key].get(name) if key in m else None
    return format(value, spec) if value is not None else "      -"


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for suite.json and suite.csv")
    parser.add_argument("--quick", action="store_true", help="a small grid of every part (under 3 minutes)")
    parser.add_argument("--parts", default="prefill,decode,memory")
    parser.add_argument("--directions", default="fwd,bwd,fwd_bwd")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--decode-contexts", default="1024,4096,16384,65536,131072")
    parser.add_argument("--decode-batches", default="1,8,32,128")
    parser.add_argument("--decode-max-gib", type=float, default=24.0, help="largest K/V cache of a decode config")
    parser.add_argument("--memory-seqlens", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="the peers to time (default all; e.g. cudnn,fa2 leaves out FlexAttention's compiles)")
    parser.add_argument("--rounds", type=int, default=None, help=f"timing rounds (default {ROUNDS}; 1 with --quick)")
    parser.add_argument("--list", action="store_true", help="print the configs, run nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = "bfloat16", "128", "2048,8192"
        args.decode_contexts, args.decode_batches, args.memory_seqlens = "4096,65536", "1,32", "1024,8192,65536"
    args.rounds = args.rounds or (1 if args.quick else ROUNDS)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parts = args.parts.split(",")
    args.prefill = prefill_grid(args.dtypes.split(","), ints(args.head_dims), ints(args.seqlens)) \
        if "prefill" in parts else []
    args.decode, args.decode_skipped = decode_grid(ints(args.decode_contexts), ints(args.decode_batches),
                                                   args.decode_max_gib) if "decode" in parts else ([], [])
    args.memory = ints(args.memory_seqlens) if "memory" in parts else []
    args.directions = args.directions.split(",")
    args.peers = [p for p in args.peers.split(",") if p]
    if set(args.peers) - set(PEERS):
        parser.error(f"--peers: unknown {sorted(set(args.peers) - set(PEERS))} (expected some of {list(PEERS)})")
    unknown = set(args.directions) - set(FLOP_FACTORS)
    if unknown:
        parser.error(f"--directions: unknown {sorted(unknown)} (expected some of {list(FLOP_FACTORS)})")
    if not args.list and not args.out:
        parser.error("--out is required (or --list)")
    return args


def main():
    args = parse_args()
    if args.list:
        for c in args.prefill:
            print("prefill", c)
        for c in args.decode:
            print("decode", c, f"K/V {kv_bytes(c) / (1 << 30):.2f} GiB")
        print("decode left out (K/V over --decode-max-gib):", len(args.decode_skipped))
        print("memory seqlens", args.memory)
        return 0
    if torch is None:
        sys.exit("PyTorch is needed to run the suite (--list works without it)")
    # SDPA explains at length each backend that declines a config; the suite records the error.
    warnings.filterwarnings("ignore", category=UserWarning)
    started = time.monotonic()
    global selected_peers
    selected_peers = tuple(args.peers)
    _ours.cuda_package()
    timer = Timer(min_reps=10, max_reps=100, target_s=0.1, settle_s=0.2, lead_cycles=LEAD_CYCLES)
    results = {"environment": environment(), "settings": {
        "rounds": args.rounds, "settle_s": timer.settle_s, "lead_cycles": LEAD_CYCLES, "quick": args.quick,
        "directions": args.directions, "decode_max_gib": args.decode_max_gib, "memory_shape": MEMORY_SHAPE,
        "decode_shape": DECODE}, "labels": LABELS}
    results["ceilings"] = ceilings(timer)
    print(f"{results['environment']['gpu']}: bf16 GEMM {results['ceilings']['bf16_gemm_tflops']:.0f} TFLOP/s, "
          f"copy {results['ceilings']['copy_tbps']:.2f} TB/s", flush=True)
    bar = progress(len(args.prefill) + len(args.decode) + len(args.memory))
    names = " ".join(f"{LABELS[n][:9]:>9}" for n in IMPLEMENTATIONS)

    results["prefill"] = []
    if args.prefill:
        say(bar, f"prefill TFLOP/s: {'config':28} {'dir':7} {names}")
    for config in args.prefill:
        c = bench_prefill(timer, config, args.directions, args.rounds)
        results["prefill"].append(c)
        write_outputs(args.out, results)  # what is measured survives a later failure
        label = f"{c['dtype']} d{c['head_dim']} {'causal' if c['causal'] else 'full'} {c['seqlen']}"
        for d in args.directions:
            say(bar, f"prefill TFLOP/s: {label:28} {d:7} "
                + " ".join(f"{fmt_time(c[d], n):>9}" for n in IMPLEMENTATIONS))
        bar and bar.update()

    results["decode"], results["decode_left_out"] = [], args.decode_skipped
    if args.decode:
        say(bar, f"decode TB/s:     {'config':28} " + " ".join(f"{LABELS[n][:9]:>9}" for n in DECODE_COLUMNS)
            + "  ours/cuDNN  ours/copy  page16/ours  page256/ours")
    for config in args.decode:
        c = bench_decode(timer, config, results["ceilings"]["copy_tbps"], args.rounds)
        results["decode"].append(c)
        write_outputs(args.out, results)
        label = f"b{c['batch']} ctx{c['context']} h{c['heads']}/{c['kv_heads']}"
        tbps = c["fwd"]["tbps"]
        ratio = lambda a, b: f"{tbps[a] / tbps[b]:.3f}" if a in tbps and b in tbps else "-"  # noqa: E731
        copy = f"{c['fwd']['fraction_of_copy']['flashattn']:.3f}" if "flashattn" in tbps else "-"
        say(bar, f"decode TB/s:     {label:28} "
            + " ".join(f"{fmt_time(c['fwd'], n, 'tbps', '7.2f'):>9}" for n in DECODE_COLUMNS)
            + f"  {ratio('flashattn', 'cudnn'):>10}  {copy:>9}  {ratio('flashattn_page16', 'flashattn'):>11}"
            + f"  {ratio('flashattn_page256', 'flashattn'):>12}")
        bar and bar.update()

    results["memory"] = []
    for seqlen in args.memory:
        results["memory"].append(bench_memory(seqlen))
        write_outputs(args.out, results)
        cells = ", ".join(f"{k} {v / MiB:.0f} MiB" if isinstance(v, int) else f"{k} {v[:13]}"
                          for k, v in results["memory"][-1]["bytes"].items())
        say(bar, f"memory seqlen {seqlen}: {cells}")
        bar and bar.update()
    if bar:
        bar.close()
    results["elapsed_s"] = time.monotonic() - started
    write_outputs(args.out, results)
    print(f"total: {results['elapsed_s']:.0f} s; {args.out}/suite.json, suite.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
