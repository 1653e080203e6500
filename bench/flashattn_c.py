"""A minimal ctypes view of libflashattn's C ABI (include/flashattn/flashattn.h) for the
benchmarks: it lets bench/gpu_forward.py call our kernels on torch tensors in the same process
as PyTorch's own attention backends. Forward only; the Python package (issue 4) replaces it.

The structs mirror flashattn.h field by field; check_layout() compares their sizes with the
values the header implies so a drift fails loudly instead of passing garbage.
"""
import ctypes
import os

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


class RunContext(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_void_p), ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t)]


def check_layout():
    # sizeof() of the C structs on LP64, printed by a C program compiled against flashattn.h.
    sizes = {Tensor: 88, Options: 160, ForwardArgs: 440, RunContext: 24}
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

    def version(self):
        return self.lib.fa_version().decode()

    def options(self, causal=False):
        opt = Options()
        self.lib.fa_options_default(ctypes.byref(opt))
        opt.causal = causal
        return opt

    def forward_call(self, q, k, v, out, lse, options, stream):
        """Returns a no-argument function that runs the forward: the structs are built once so
        a timed loop measures the library, not ctypes marshalling."""
        args = ForwardArgs(torch_view(q), torch_view(k), torch_view(v), torch_view(out), torch_view(lse))
        ctx = RunContext(stream, None, 0)
        refs = (args, options, ctx, q, k, v, out, lse)  # keep the tensors alive with the closure

        def run():
            status = self.lib.fa_forward(ctypes.byref(refs[0]), ctypes.byref(refs[1]), ctypes.byref(refs[2]))
            if status != 0:
                raise RuntimeError(f"fa_forward: {self.lib.fa_last_error().decode()}")

        return run


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
