"""flashattn imported before or after each array library it supports (PyTorch, CuPy, JAX, numpy),
each order in a fresh interpreter whose exit status must be 0, then one call on that library's
arrays; and the extension's exported symbols, which decide whether it can disturb the libraries
loaded after it.

Imported first, an extension that exported a statically linked libstdc++ (some GCC installations
link it so) bound the C++ runtime's unique symbols for the whole process, and `import torch`,
`import cupy` and `import jax` then crashed inside their own C++ code. Libraries not installed
here are skipped, with the reason shown."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

import flashattn

# One small call on each library's arrays, after both imports (CPU arrays where the library has
# them, so the test runs on machines without a GPU; CuPy's live on the GPU: fp16, head dim 64).
_CALLS = {
    "numpy": "import numpy as np; q = np.ones((1, 4, 2, 8), np.float32); flashattn.forward(q, q, q)",
    "torch": "q = torch.ones(1, 4, 2, 8); flashattn.flash_attn_func(q, q, q)",
    "torch.nn": "q = torch.ones(1, 4, 2, 8); flashattn.flash_attn_func(q, q, q)",
    "cupy": "q = cupy.ones((1, 4, 2, 64), cupy.float16); flashattn.forward(q, q, q)",
    "jax": "q = jax.device_put(jax.numpy.ones((1, 4, 2, 8)), jax.devices('cpu')[0]); flashattn.forward(q, q, q)",
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module.split(".")[0]) is not None


@pytest.mark.parametrize("first", ["flashattn", "other"])
@pytest.mark.parametrize("library", list(_CALLS))
def test_import_order(library, first):
    if not _installed(library):
        pytest.skip(f"{library.split('.')[0]} is not installed here")
    if library == "cupy" and not flashattn.cuda_compiled():
        pytest.skip("CuPy arrays live on the GPU: this build has no CUDA backend")
    imports = ["flashattn", library] if first == "flashattn" else [library, "flashattn"]
    root = library.split(".")[0]
    code = "; ".join(f"import {m}" for m in imports) + (f"; import {root}" if root != library else "")
    code += "; " + _CALLS[library]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"`python -c '{code}'` exited {done.returncode}:\n{done.stderr[-3000:]}"


def test_extension_exports_only_its_init_function():
    """Nothing but PyInit__ext is exported: no symbol of the extension (its own code, nanobind,
    a statically linked C++ runtime) can bind to another library's references."""
    nm = shutil.which("nm")
    if sys.platform != "linux" or nm is None:
        pytest.skip("checked on Linux with binutils' nm")
    path = flashattn._ext.__file__
    listed = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True)
    exported = sorted(line.split()[-1] for line in listed.stdout.splitlines() if line.strip())
    assert exported == ["PyInit__ext"], f"{path} exports {len(exported)} symbols: {exported[:20]}"
