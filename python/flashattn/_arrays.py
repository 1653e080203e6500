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

    name = "numpy"
    # numpy cannot export ml_dtypes' bfloat16 through DLPack; such arrays cross as uint16 views
    # and the extension is told (its uint16_is_bf16 argument).
    uint16_is_bf16 = True

    def to_ext(self, a):
        if a.dtype.name == "bfloat16":
            return a.view(np.uint16)
        return a

    def from_ext(self, a):
        return a

    def empty(self, like, shape, dtype=None):
        return np.empty(shape, dtype=like.dtype if dtype is None else dtype)

    def float32(self, like):
        return np.float32

    def stream(self, like) -> int:
        return 0

    def finish(self, like):
        """Called after the library returned: nothing to do where the caller's stream orders
        later work after ours."""


class TorchFramework(Framework):
    name = "torch"
    uint16_is_bf16 = False

    def __init__(self, torch):
        self.torch = torch

    def to_ext(self, a):
        # DLPack refuses tensors that require grad; autograd is handled around the op.
        return a.detach() if a.requires_grad else a

    def empty(self, like, shape, dtype=None):
        return self.torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)

    def float32(self, like):
        return self.torch.float32

    def stream(self, like) -> int:
        if like.device.type != "cuda":
            return 0
        return self.torch.cuda.current_stream(like.device).cuda_stream


class CupyFramework(Framework):
    name = "cupy"
    uint16_is_bf16 = False

    def __init__(self, cupy):
        self.cupy = cupy

    def empty(self, like, shape, dtype=None):
        with like.device:
            return self.cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)

    def float32(self, like):
        return self.cupy.float32

    def stream(self, like) -> int:
        with like.device:
            return self.cupy.cuda.get_current_stream().ptr


class JaxFramework(Framework):
    """JAX arrays are immutable and JAX exposes no stream: outputs are buffers the extension
    allocates (host or device memory, freed with the JAX array that takes them over through
    DLPack); inputs are made ready first, our kernels run on the default stream, and the call
    waits for them before JAX may read the results."""

    name = "jax"
    uint16_is_bf16 = False

    def __init__(self, jax):
        self.jax = jax

    def to_ext(self, a):
        if isinstance(a, self.jax.Array):
            a.block_until_ready()
        return a

    def empty(self, like, shape, dtype=None):
        from . import _ext

        device = next(iter(like.devices()))
        cuda = device.platform == "gpu"
        dtype = np.dtype(like.dtype if dtype is None else dtype)
        return _ext.empty(list(shape), dtype.name, 2 if cuda else 1, device.id if cuda else 0)

    def from_ext(self, a):
        return self.jax.dlpack.from_dlpack(a)

    def float32(self, like):
        return np.float32

    def finish(self, like):
        from . import _ext

        device = next(iter(like.devices()))
        if device.platform == "gpu":
            _ext.cuda_synchronize(device.id)


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
