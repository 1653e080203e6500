"""Arrays of any framework, as the extension sees them: which framework an input belongs to, how to
allocate an output next to it (with that framework's allocator, on its device), which CUDA stream
the caller is on, and how each array crosses into C++ (DLPack views, no copy).

Supported: numpy (ml_dtypes bfloat16 included), PyTorch (CPU and CUDA), CuPy, JAX (CPU and GPU).
Outputs come back as the framework of q.
"""
from __future__ import annotations

import numpy as np


class Framework:
    """numpy: the default, and the base of the others' host-side logic."""

    xp = np  # the array module of this framework's arrays (its pad, ascontiguousarray)
    array_type = np.ndarray

    # ml_dtypes' types, which have no DLPack type, as flashattn's DType enumerators.
    descriptor_dtypes = {"bfloat16": 1, "float8_e4m3fn": 5, "float8_e5m2": 6}

    def to_ext(self, a):
        dtype = self.descriptor_dtypes.get(a.dtype.name) if isinstance(a, np.ndarray) else None
        if dtype is not None:
            # A descriptor tuple (python/src/module.cpp) with strides in elements, holding the
            # array (possibly a temporary copy) alive.
            size = a.itemsize
            if any(s % size for s in a.strides):
                raise ValueError(f"{a.dtype.name} array with strides {a.strides} bytes: not whole elements")
            return (a.__array_interface__["data"][0], dtype, 0, 0, a.shape, tuple(s // size for s in a.strides), a)
        return a  # anything else: the extension imports it, or says which argument it cannot

    def is_float8(self, a) -> bool:
        """Whether a holds FP8 values (FP8 inputs: out is then 16-bit)."""
        return "float8" in str(getattr(a, "dtype", ""))

    def float8_out_dtype(self, like):
        """out's dtype for FP8 inputs: bfloat16 (pass out= for float16)."""
        import ml_dtypes

        return ml_dtypes.bfloat16

    def from_ext(self, a):
        return a

    def empty(self, like, shape, dtype=None):
        return np.empty(shape, dtype=like.dtype if dtype is None else dtype)

    def float32(self, like):
        return np.float32

    def int32_full(self, like, n, value):
        """An int32 vector of n copies of value on like's device (cache_seqlens given as an int)."""
        return np.full(n, value, np.int32)

    def workspace(self, like, nbytes):
        """nbytes of uninitialised scratch memory on like's device, from this framework's
        allocator (for CUDA arrays: stream-ordered with the stream the call runs on)."""
        return self.empty(like, (nbytes,), np.uint8)

    def workspace_to_ext(self, a):
        """A workspace as the extension takes it: (data_ptr, bytes), or the array (DLPack)."""
        return a

    def device_workspace(self, like, nbytes):
        """workspace() where like is in GPU memory, else None (for scratch only the GPU uses)."""
        return self.workspace(like, nbytes) if self.on_cuda(like) else None

    def on_cuda(self, like) -> bool:
        """Whether like is in GPU memory (where the CUDA kernels, not the CPU backend, run)."""
        return False

    def last_stride(self, a):
        """The stride of a's last dimension in elements; 1 where it does not matter (a dimension
        of at most one element) or a is not this framework's array (the library judges it)."""
        if not isinstance(a, self.array_type) or a.ndim == 0 or a.shape[-1] <= 1 or a.strides[-1] == a.itemsize:
            return 1
        stride, size = a.strides[-1], a.itemsize  # bytes
        return stride // size if stride % size == 0 else stride / size

    def unit_last_stride(self, a):
        """a, or a contiguous copy where its last dimension is strided: the library reads rows of
        consecutive elements, and flash_attn copies such inputs too."""
        return a if self.last_stride(a) == 1 else self.contiguous(a)

    def contiguous(self, a):
        return self.xp.ascontiguousarray(a)

    def pad_last(self, a, n):
        """a with n zeros appended to its last dimension (a new array)."""
        return self.xp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n)])

    def copy_into(self, dst, src):
        """Writes src's values into the caller's array dst (same shape)."""
        dst[...] = src

    def stream(self, like) -> int:
        return 0

    def finish(self, like):
        """Called after the library returned: nothing to do where the caller's stream orders
        later work after ours."""


class TorchFramework(Framework):
    def __init__(self, torch):
        self.torch = torch
        # flashattn's DType enumerators (include/flashattn/flashattn.hpp)
        self.dtypes = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3, torch.int32: 4}
        for name, dtype in (("float8_e4m3fn", 5), ("float8_e5m2", 6)):  # FP8 inputs, where torch has them
            if hasattr(torch, name):
                self.dtypes[getattr(torch, name)] = dtype
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.raw_stream = raw_stream if raw_stream is not None else (
            lambda index: torch.cuda.current_stream(index).cuda_stream)

    def to_ext(self, a):
        """A descriptor tuple (data_ptr, DType, DeviceType, device index, shape, strides): the
        extension reads tensors this way, as DLPack export of a CUDA tensor records and waits on
        an event. Its 7th entry holds the tensor alive until the call returns: it may be a
        temporary (a contiguous copy, a resolved lazy view). Dtypes and devices the library does
        not take go through DLPack, whose import reports them."""
        dtype = self.dtypes.get(a.dtype)
        cuda = a.is_cuda
        if dtype is None or not (cuda or a.is_cpu):
            return a.detach()
        if a.is_neg():  # a lazily negated view, whose memory holds -a: a resolved copy
            a = a.resolve_neg()
        return (a.data_ptr(), dtype, 1 if cuda else 0, a.get_device() if cuda else 0, a.shape, a.stride(), a)

    def empty(self, like, shape, dtype=None):
        # The cheapest allocations PyTorch offers (measured: empty_like 4 us, new_empty 6 us,
        # torch.empty(shape, dtype=, device=) 10 us); contiguous, as the custom ops' fakes say.
        if dtype is None and shape == like.shape:
            return self.torch.empty_like(like, memory_format=self.torch.contiguous_format)
        return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)

    def float32(self, like):
        return self.torch.float32

    def float8_out_dtype(self, like):
        return self.torch.bfloat16

    def int32_full(self, like, n, value):
        return like.new_full((n,), value, dtype=self.torch.int32)

    def workspace(self, like, nbytes):
        # PyTorch's caching allocator, on like's device and its current stream (the call's):
        # blocks are reused only by later work on that stream, so the workspace may be freed as
        # soon as the call has been enqueued.
        return like.new_empty((nbytes,), dtype=self.torch.uint8)

    def workspace_to_ext(self, a):
        return (a.data_ptr(), a.numel())  # not DLPack: its export of a CUDA tensor waits on an event

    def on_cuda(self, like) -> bool:
        return like.is_cuda

    def last_stride(self, a):
        # is_contiguous() first: one cheap call settles the common case (this runs per input).
        if not isinstance(a, self.torch.Tensor) or a.is_contiguous() or a.dim() == 0 or a.shape[-1] <= 1:
            return 1
        return a.stride(-1)

    def contiguous(self, a):
        return a.contiguous()

    def pad_last(self, a, n):
        # Differentiable (autograd slices the gradient back) and traceable by torch.compile.
        return self.torch.nn.functional.pad(a, (0, n))

    def copy_into(self, dst, src):
        dst.copy_(src)

    def stream(self, like) -> int:
        return self.raw_stream(like.get_device()) if like.is_cuda else 0


class CupyFramework(Framework):
    def __init__(self, cupy):
        self.cupy = cupy
        self.xp = cupy
        self.array_type = cupy.ndarray

    def empty(self, like, shape, dtype=None):
        with like.device:
            return self.cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)

    def float32(self, like):
        return self.cupy.float32

    def int32_full(self, like, n, value):
        with like.device:
            return self.cupy.full(n, value, self.cupy.int32)

    def on_cuda(self, like) -> bool:
        return True  # CuPy arrays live in GPU memory

    def contiguous(self, a):
        with a.device:
            return super().contiguous(a)

    def pad_last(self, a, n):
        with a.device:
            return super().pad_last(a, n)

    def copy_into(self, dst, src):
        with dst.device:
            dst[...] = src

    def stream(self, like) -> int:
        with like.device:
            return self.cupy.cuda.get_current_stream().ptr


class JaxFramework(Framework):
    """JAX arrays are immutable and JAX exposes no stream: outputs are buffers the extension
    allocates (host or device memory, freed with the JAX array that takes them over through
    DLPack); inputs are made ready first, our kernels run on the default stream, and the call
    waits for them before JAX may read the results."""

    def __init__(self, jax):
        import jax.numpy

        self.jax = jax
        self.xp = jax.numpy
        self.array_type = ()  # JAX arrays have no strides to fix: last_stride is 1 for all

    def to_ext(self, a):
        if isinstance(a, self.jax.Array):
            a.block_until_ready()
        return a

    def empty(self, like, shape, dtype=None):
        from . import _ext

        device = next(iter(like.devices()))
        cuda = device.platform == "gpu"
        dtype = np.dtype(like.dtype if dtype is None else dtype)
        return _ext.empty(list(shape), dtype.name, 2 if cuda else 1, _cuda_index(device) if cuda else 0)

    def from_ext(self, a):
        return self.jax.dlpack.from_dlpack(a)

    def on_cuda(self, like) -> bool:
        return next(iter(like.devices())).platform == "gpu"

    def float32(self, like):
        return np.float32

    def int32_full(self, like, n, value):
        return self.jax.device_put(np.full(n, value, np.int32), next(iter(like.devices())))

    def finish(self, like):
        from . import _ext

        device = next(iter(like.devices()))
        if device.platform == "gpu":
            _ext.cuda_synchronize(_cuda_index(device))


def _cuda_index(jax_device) -> int:
    index = getattr(jax_device, "local_hardware_id", None)
    return jax_device.id if index is None else index


_NUMPY = Framework()
_frameworks = {}


def framework_of(a) -> Framework:
    """The framework whose arrays `a` is, from its type's module (importing nothing new)."""
    if isinstance(a, np.ndarray):
        return _NUMPY
    module = type(a).__module__.split(".")[0]
    if module not in _frameworks:
        if module == "torch":
            import torch

            _frameworks[module] = TorchFramework(torch)
        elif module == "cupy":
            import cupy

            _frameworks[module] = CupyFramework(cupy)
        elif module in ("jax", "jaxlib"):
            import jax

            _frameworks[module] = JaxFramework(jax)
        else:
            raise TypeError(f"q: arrays of type {type(a).__module__}.{type(a).__name__} are not supported "
                            "(numpy, torch, cupy or jax)")
    return _frameworks[module]
