"""ctypes binding of the FA1 loop-order teaching library (src/cuda/teaching/fa1_order.h), for the
loop-order and IO benchmarks: the teaching kernels are not part of the library or its Python
package (a CMake build's flashattn_fa1_teaching), so this is their only binding. Variants, by
q_groups:
  fa1        1: FlashAttention-1 as published (one CTA per (batch, head), outer loop over K/V
             tiles, O / m / l of every query tile through HBM once per K/V tile);
  fa1_split  one query tile per CTA, still FA1's loop order and HBM round trip: FA2's
             parallelism, FA1's traffic;
  fa2_order  0: the same kernel code with O / m / l in registers across the key loop (FA2's loop
             order and parallelism; no workspace).
"""
import ctypes
import os

import torch

VARIANTS = ("fa1", "fa1_split", "fa2_order")
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}


class Fa1Library:
    def __init__(self, path):
        self.lib = ctypes.CDLL(os.path.abspath(path))
        self.lib.fa1_workspace_bytes.restype = ctypes.c_size_t
        self.lib.fa1_workspace_bytes.argtypes = [ctypes.c_int] * 4
        self.lib.fa1_tile_sizes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        self.lib.fa1_forward.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [
            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

    def tile_sizes(self, head_dim):
        m, n = ctypes.c_int(), ctypes.c_int()
        if self.lib.fa1_tile_sizes(head_dim, ctypes.byref(m), ctypes.byref(n)) != 0:
            raise RuntimeError(f"fa1_tile_sizes: head_dim {head_dim} not supported")
        return m.value, n.value

    def q_groups(self, variant, seqlen, head_dim):
        return {"fa1": 1, "fa1_split": seqlen // self.tile_sizes(head_dim)[0], "fa2_order": 0}[variant]

    def forward_call(self, variant, q, k, v, out, lse, causal):
        """A no-argument function running one forward of `variant` on [b, s, h, d] tensors (its
        workspace allocated here, once)."""
        batch, seqlen, heads, head_dim = q.shape
        groups = self.q_groups(variant, seqlen, head_dim)
        workspace = None
        if groups != 0:
            nbytes = self.lib.fa1_workspace_bytes(batch, seqlen, heads, head_dim)
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
        error = ctypes.create_string_buffer(512)
        stream = torch.cuda.current_stream().cuda_stream
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                None if workspace is None else workspace.data_ptr(), batch, seqlen, heads, head_dim,
                DTYPE_CODES[q.dtype], int(causal), groups, stream, error, len(error))
        keep = (q, k, v, out, lse, workspace)  # alive as long as the closure

        def run():
            if self.lib.fa1_forward(*args) != 0:
                raise RuntimeError(f"fa1_forward ({variant}): {error.value.decode()}")
            return keep[3]

        return run
