"""flashattn's calls as the benchmarks time them: the Python package's flashattn.forward, backward and
forward_kvcache on torch tensors, in the same process as PyTorch's own attention backends.

Each *_call function returns a no-argument function that runs one call into outputs the caller
allocated once (out / lse, dq / dk / dv), so a timed loop allocates no outputs; the package still
takes a call's workspace (the masked forward's tile counter, the backward's fp32 dQ accumulator,
the decode kernels' split-KV partials) from PyTorch's caching allocator on every call, which is
host work only (no GPU work, nothing the timers see).

What the package adds to the library's own C++ call is host time: argument handling in Python and
the extension's conversions, tens of microseconds a call. The timers never see it as long as the
host runs ahead of the GPU: bench/_timing.Timer queues the calls without waiting for them, each
after an L2 flush (a 256 MiB memset) and, where the scripts ask for it (lead_cycles: the suite,
the backward, the decode benchmarks, whose calls can be shorter than their host side), after a
GPU spin that outlasts any call's host side.

A library error (ValueError, TypeError, NotImplementedError, MemoryError: the config is invalid
or not compiled into this build) is raised as a RuntimeError with the library's message, which the
benchmarks record as ours' error for that config and go on.

Runs on CPU tensors too (the CPU backend), which bench/cpu_vs_torch.py times.
"""
import sys

try:
    import flashattn
except ImportError:  # a machine without the package: the scripts' --help and --list only
    flashattn = None

LIBRARY_ERRORS = (ValueError, TypeError, NotImplementedError, MemoryError)


def package():
    """flashattn, or an exit with the way to get it."""
    if flashattn is None:
        sys.exit("the flashattn package is not importable: install it (scripts/gpu_package.sh, or pip install .) "
                 "or put its folder on PYTHONPATH")
    return flashattn


def cuda_package():
    """flashattn for the GPU benchmarks: exits with a message without a GPU or a CUDA backend."""
    import torch

    fa = package()
    if not torch.cuda.is_available():
        sys.exit("the GPU benchmarks need a CUDA GPU")
    if not fa.cuda_compiled():
        sys.exit(f"flashattn at {fa.__file__} was built without the CUDA backend "
                 "(scripts/gpu_package.sh builds it with CUDA)")
    return fa


def checked(fn):
    """fn, with the library's errors raised as RuntimeError (see the module docstring)."""
    def run():
        try:
            return fn()
        except LIBRARY_ERRORS as err:
            raise RuntimeError(f"{type(err).__name__}: {err}") from err

    return run


def forward_call(q, k, v, out, lse, causal=False, dropout_p=0.0, seed=None):
    """One dense forward into out / lse (q [b, s, h, d], lse float32 [b, h, s])."""
    forward = package().forward
    return checked(lambda: forward(q, k, v, causal=causal, dropout_p=dropout_p, seed=seed, out=out, lse=lse))


def forward_varlen_call(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                        block_table=None, index_check="host"):
    """forward_call for a varlen batch: q / out [total_q, h, d], k / v [total_k, hkv, d], lse
    [h, total_q], cu_seqlens int32 [batch + 1] on the device (as a training loop holds them). With
    block_table (int32 [batch, max_blocks]) k / v are paged [num_blocks, page_size, hkv, d].
    index_check: "host" (the C ABI's default, which the varlen figures were measured with: the
    lengths copied to the host, the stream waited for, every call) or "device" (the package's
    default: checked by a kernel, no wait)."""
    forward = package().forward
    return checked(lambda: forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, out=out,
                                   lse=lse, block_table=block_table, index_check=index_check))


def backward_call(dout, q, k, v, out, lse, dq, dk, dv, causal=False, deterministic=False, dropout_p=0.0, seed=None):
    """One backward from the forward's out / lse into dq, dk, dv (dropout_p and seed: the forward's)."""
    backward = package().backward
    return checked(lambda: backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, dq=dq,
                                    dk=dk, dv=dv, dropout_p=dropout_p, seed=seed))


def kvcache_call(q, k_cache, v_cache, out, lse, block_table=None, num_splits=0, index_check="host"):
    """One decode step against a KV cache (no new tokens; every cache full, or paged through
    block_table, whose entries are checked on the "host" or the "device") into out / lse."""
    forward_kvcache = package().forward_kvcache
    return checked(lambda: forward_kvcache(q, k_cache, v_cache, block_table=block_table, num_splits=num_splits,
                                           out=out, lse=lse, index_check=index_check))


def requested_bytes(fn):
    """Device memory requested from PyTorch's allocator during fn() beyond what was held before,
    exactly as requested (before the allocator rounds it to its blocks), after one warm-up call.
    With the outputs preallocated that is the workspace the call takes: the library allocates
    no device memory of its own."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - before
