"""A minimal ctypes view of libflashattn's C ABI (include/flashattn/flashattn.h) for the
benchmarks: it lets bench/gpu_forward.py and gpu_backward.py call our kernels on torch tensors in
the same process as PyTorch's own attention backends, with nothing but the C call in a timed
loop (the structs are built once). Dense and varlen forward, dense backward; forward against a
KV cache.

The structs mirror flashattn.h field by field; check_layout() compares their sizes with the
values the header implies so a drift fails loudly instead of passing garbage.
"""
import ctypes
import os
import sys

MAX_DIMS = 4
DTYPE = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int32": 4}
DEVICE_CPU, DEVICE_CUDA = 0, 1


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


class Options(ctypes.Structure):
    _fields_ = [
        ("causal", ctypes.c_bool),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("softmax_scale", ctypes.c_double),
        ("softcap", ctypes.c_float),
        ("alibi_slopes", Tensor),
        ("dropout_p", ctypes.c_float),
        ("dropout_seed", ctypes.c_uint64),
        ("dropout_offset", ctypes.c_uint64),
        ("deterministic", ctypes.c_bool),
        ("precise", ctypes.c_bool),
    ]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("lse", Tensor)]


class BackwardArgs(ctypes.Structure):
    _fields_ = [("dout", Tensor), ("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("lse", Tensor),
                ("dq", Tensor), ("dk", Tensor), ("dv", Tensor)]


class KvCacheArgs(ctypes.Structure):
    _fields_ = [("q", Tensor), ("k_cache", Tensor), ("v_cache", Tensor), ("k_new", Tensor), ("v_new", Tensor),
                ("cache_seqlens", Tensor), ("cache_batch_idx", Tensor), ("cache_leftpad", Tensor),
                ("block_table", Tensor), ("rotary_cos", Tensor), ("rotary_sin", Tensor),
                ("rotary_interleaved", ctypes.c_bool), ("num_splits", ctypes.c_int64), ("out", Tensor),
                ("lse", Tensor), ("index_check", ctypes.c_int32)]

class Varlen(ctypes.Structure):
    _fields_ = [("cu_seqlens_q", Tensor), ("cu_seqlens_k", Tensor), ("seqused_k", Tensor),
                ("max_seqlen_q", ctypes.c_int64), ("max_seqlen_k", ctypes.c_int64), ("block_table", Tensor),
                ("index_check", ctypes.c_int32)]


INDEX_CHECK = {"host": 0, "device": 1}  # FA_INDEX_CHECK_HOST / FA_INDEX_CHECK_DEVICE


class RunContext(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_void_p), ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t)]


def check_layout():
    # sizeof() of the C structs on LP64, printed by a C program compiled against flashattn.h.
    sizes = {Tensor: 88, Options: 160, ForwardArgs: 440, BackwardArgs: 792, KvCacheArgs: 1168, RunContext: 24,
             Varlen: 368}
    for struct, size in sizes.items():
        assert ctypes.sizeof(struct) == size, (struct.__name__, ctypes.sizeof(struct), size)


class Library:
    def __init__(self, path):
        check_layout()
        self.lib = ctypes.CDLL(os.path.abspath(path))
        self.lib.fa_version.restype = ctypes.c_char_p
        self.lib.fa_last_error.restype = ctypes.c_char_p
        self.lib.fa_cuda_compiled.restype = ctypes.c_bool
        self.lib.fa_options_default.argtypes = [ctypes.POINTER(Options)]
        self.lib.fa_forward.argtypes = [ctypes.POINTER(ForwardArgs), ctypes.POINTER(Options),
                                        ctypes.POINTER(RunContext)]
        self.lib.fa_forward.restype = ctypes.c_int
        self.lib.fa_backward.argtypes = [ctypes.POINTER(BackwardArgs), ctypes.POINTER(Options),
                                         ctypes.POINTER(RunContext)]
        self.lib.fa_backward.restype = ctypes.c_int
        self.lib.fa_forward_workspace_size.argtypes = [ctypes.POINTER(ForwardArgs), ctypes.POINTER(Options),
                                                       ctypes.POINTER(ctypes.c_size_t)]
        self.lib.fa_forward_workspace_size.restype = ctypes.c_int
        self.lib.fa_backward_workspace_size.argtypes = [ctypes.POINTER(BackwardArgs), ctypes.POINTER(Options),
                                                        ctypes.POINTER(ctypes.c_size_t)]
        self.lib.fa_backward_workspace_size.restype = ctypes.c_int
        self.lib.fa_forward_varlen.argtypes = [ctypes.POINTER(ForwardArgs), ctypes.POINTER(Varlen),
                                               ctypes.POINTER(Options), ctypes.POINTER(RunContext)]
        self.lib.fa_forward_varlen.restype = ctypes.c_int
        self.lib.fa_forward_varlen_workspace_size.argtypes = [ctypes.POINTER(ForwardArgs), ctypes.POINTER(Varlen),
                                                              ctypes.POINTER(Options), ctypes.POINTER(ctypes.c_size_t)]
        self.lib.fa_forward_varlen_workspace_size.restype = ctypes.c_int
        self.lib.fa_forward_kvcache.argtypes = [ctypes.POINTER(KvCacheArgs), ctypes.POINTER(Options),
                                                ctypes.POINTER(RunContext)]
        self.lib.fa_forward_kvcache.restype = ctypes.c_int
        self.lib.fa_forward_kvcache_workspace_size.argtypes = [ctypes.POINTER(KvCacheArgs), ctypes.POINTER(Options),
                                                               ctypes.POINTER(ctypes.c_size_t)]
        self.lib.fa_forward_kvcache_workspace_size.restype = ctypes.c_int

    def version(self):
        return self.lib.fa_version().decode()

    def options(self, causal=False, deterministic=False):
        opt = Options()
        self.lib.fa_options_default(ctypes.byref(opt))
        opt.causal = causal
        opt.deterministic = deterministic
        return opt

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.fa_last_error().decode()}")

    def forward_call(self, q, k, v, out, lse, options, stream):
        """Returns a no-argument function that runs the forward: the structs are built once so
        a timed loop measures the library, not ctypes marshalling. Its workspace (the queried
        size: optional, but masked calls on Hopper balance their tiles with it) is allocated here
        once."""
        import torch

        args = ForwardArgs(torch_view(q), torch_view(k), torch_view(v), torch_view(out), torch_view(lse))
        nbytes = ctypes.c_size_t()
        self.check(self.lib.fa_forward_workspace_size(ctypes.byref(args), ctypes.byref(options), ctypes.byref(nbytes)),
                   "fa_forward_workspace_size")
        workspace = torch.empty(nbytes.value, dtype=torch.uint8, device=q.device) if nbytes.value else None
        ctx = RunContext(stream, None, 0) if workspace is None else RunContext(stream, workspace.data_ptr(),
                                                                               workspace.numel())
        return self._call(self.lib.fa_forward, "fa_forward", args, options, ctx, (q, k, v, out, lse, workspace))

    def forward_varlen_call(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            options, stream, block_table=None):
        """forward_call for a varlen batch: q / out [total_q, h, d], k / v [total_k, hkv, d], lse
        [h, total_q], cu_seqlens int32 [batch + 1] (on the device, as a training loop holds them).
        With block_table (int32 [batch, max_blocks]) k / v are paged [num_blocks, page_size, hkv, d]."""
        import torch

        args = ForwardArgs(torch_view(q), torch_view(k), torch_view(v), torch_view(out), torch_view(lse))
        varlen = Varlen()
        varlen.cu_seqlens_q, varlen.cu_seqlens_k = torch_view(cu_seqlens_q), torch_view(cu_seqlens_k)
        varlen.max_seqlen_q, varlen.max_seqlen_k = max_seqlen_q, max_seqlen_k
        if block_table is not None:
            varlen.block_table = torch_view(block_table)
        nbytes = ctypes.c_size_t()
        self.check(self.lib.fa_forward_varlen_workspace_size(ctypes.byref(args), ctypes.byref(varlen),
                                                             ctypes.byref(options), ctypes.byref(nbytes)),
                   "fa_forward_varlen_workspace_size")
        workspace = torch.empty(nbytes.value, dtype=torch.uint8, device=q.device) if nbytes.value else None
        ctx = RunContext(stream, None if workspace is None else workspace.data_ptr(), nbytes.value)
        tensors = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, workspace)
        refs = (args, varlen, options, ctx, tensors)  # kept alive with the closure

        def run():
            self.check(self.lib.fa_forward_varlen(ctypes.byref(refs[0]), ctypes.byref(refs[1]), ctypes.byref(refs[2]),
                                                  ctypes.byref(refs[3])), "fa_forward_varlen")

        return run

    def backward_workspace_size(self, dout, q, k, v, out, lse, dq, dk, dv, options):
        """Bytes of device scratch memory the backward needs (validates the arguments)."""
        nbytes = ctypes.c_size_t()
        self.check(self.lib.fa_backward_workspace_size(ctypes.byref(backward_args(dout, q, k, v, out, lse, dq, dk, dv)),
                                                       ctypes.byref(options), ctypes.byref(nbytes)),
                   "fa_backward_workspace_size")
        return nbytes.value

    def backward_call(self, dout, q, k, v, out, lse, dq, dk, dv, options, stream, workspace):
        """forward_call's backward; workspace: None or a uint8 device tensor of at least
        backward_workspace_size bytes, used only by the work each call enqueues on stream."""
        args = backward_args(dout, q, k, v, out, lse, dq, dk, dv)
        ctx = RunContext(stream, None, 0) if workspace is None else RunContext(stream, workspace.data_ptr(),
                                                                               workspace.numel())
        return self._call(self.lib.fa_backward, "fa_backward", args, options, ctx,
                          (dout, q, k, v, out, lse, dq, dk, dv, workspace))

    def kvcache_call(self, q, k_cache, v_cache, out, lse, options, stream, block_table=None, num_splits=0,
                     index_check="host"):
        """forward_call for decoding against a KV cache (no new tokens, every cache full, or paged
        through block_table, its entries checked on the "host" or the "device"): returns (run,
        workspace), the workspace a uint8 device tensor of the queried size or None, allocated
        here once."""
        import torch

        args = KvCacheArgs()
        args.q, args.k_cache, args.v_cache = torch_view(q), torch_view(k_cache), torch_view(v_cache)
        args.out, args.lse = torch_view(out), torch_view(lse)
        if block_table is not None:
            args.block_table = torch_view(block_table)
        args.rotary_interleaved = True
        args.num_splits = num_splits
        args.index_check = INDEX_CHECK[index_check]
        nbytes = ctypes.c_size_t()
        self.check(self.lib.fa_forward_kvcache_workspace_size(ctypes.byref(args), ctypes.byref(options),
                                                              ctypes.byref(nbytes)), "fa_forward_kvcache_workspace_size")
        workspace = torch.empty(nbytes.value, dtype=torch.uint8, device=q.device) if nbytes.value else None
        ctx = RunContext(stream, None if workspace is None else workspace.data_ptr(), nbytes.value)
        run = self._call(self.lib.fa_forward_kvcache, "fa_forward_kvcache", args, options, ctx,
                         (q, k_cache, v_cache, out, lse, block_table, workspace))
        return run, workspace

    def _call(self, fn, name, args, options, ctx, tensors):
        refs = (args, options, ctx, tensors)  # keep the structs and tensors alive with the closure

        def run():
            self.check(fn(ctypes.byref(refs[0]), ctypes.byref(refs[1]), ctypes.byref(refs[2])), name)

        return run


def cuda_library(path):
    """The library at path, for the GPU benchmarks: exits with a message if it has no CUDA backend."""
    lib = Library(path)
    if not lib.lib.fa_cuda_compiled():
        sys.exit(f"{path} was built without the CUDA backend")
    return lib


def backward_args(dout, q, k, v, out, lse, dq, dk, dv):
    return BackwardArgs(*(torch_view(t) for t in (dout, q, k, v, out, lse, dq, dk, dv)))


def torch_view(t):
    """fa_tensor describing a torch tensor (no copy)."""
    view = Tensor()
    view.data = t.data_ptr()
    view.dtype = DTYPE[str(t.dtype).removeprefix("torch.")]
    view.device_type = DEVICE_CUDA if t.is_cuda else DEVICE_CPU
    view.device_index = (t.device.index or 0) if t.is_cuda else 0
    view.ndim = t.dim()
    for i in range(t.dim()):
        view.shape[i] = t.shape[i]
        view.strides[i] = t.stride(i)
    return view
