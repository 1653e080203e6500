"""Score modifiers in FlexAttention's form that flashattn runs in its own kernels.

Each is a callable score_mod(score, b, h, q_idx, kv_idx) -> score, so PyTorch's flex_attention
runs it as it runs any other; flashattn.flex_attention recognises it and applies the library's
own modifier inside its kernels instead (no Python per element), forward and backward:

    softcap(cap)                  cap * tanh(score / cap)
    alibi(slopes)                 score - slopes[h] * |q_idx + kv_len - q_len - kv_idx|
                                  (slopes [heads], or [batch, heads]: slopes[b, h])
    chain(softcap(c), alibi(s))   one after the other, in the kernels' order: softcap, then ALiBi

`score` is the scaled score (q . k * scale), as FlexAttention passes it. ALiBi is aligned at the
bottom right, as flash_attn's alibi_slopes are: the callable needs the lengths for that
(alibi(slopes, seqlen_q, seqlen_kv)) where they differ. The slopes are constants: the kernels
compute no gradient for them. Any other score_mod is refused by flashattn.flex_attention by name.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor


class ScoreMod:
    """A score_mod flashattn runs natively: the softcap (0: none) and the ALiBi slopes (None: none)
    it applies, in that order, and the key-minus-query offset its ALiBi distances assume."""

    def __init__(self, softcap: float = 0.0, slopes: Optional[Tensor] = None, offset: int = 0):
        self.softcap = softcap
        self.slopes = slopes
        self.offset = offset
        # The cap as a literal of the function's code, not an attribute read: torch.compile (which
        # PyTorch's flex_attention runs, eager too) makes a float it reads symbolic once it has
        # seen two values, and flex_attention rejects a symbolic float among score_mod's inputs.
        self._cap = eval(f"lambda score: {softcap!r} * torch.tanh(score / {softcap!r})",  # noqa: S307
                         {"torch": torch}) if softcap else None

    def __call__(self, score, b, h, q_idx, kv_idx):
        if self._cap is not None:
            score = self._cap(score)
        if self.slopes is not None:
            slope = self.slopes[h] if self.slopes.dim() == 1 else self.slopes[b, h]
            score = score - slope * (q_idx + self.offset - kv_idx).abs()
        return score

    def __repr__(self):
        parts = [f"softcap={self.softcap}"] if self.softcap else []
        if self.slopes is not None:
            parts.append(f"alibi slopes {tuple(self.slopes.shape)}, offset {self.offset}")
        return f"flashattn.score_mods.ScoreMod({', '.join(parts) or 'identity'})"


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap); cap > 0 and finite."""
    cap = float(cap)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap: cap must be positive and finite, got {cap}")
    return ScoreMod(softcap=cap)


def alibi(slopes: Tensor, seqlen_q: Optional[int] = None, seqlen_kv: Optional[int] = None) -> ScoreMod:
    """score - slopes[h] * |q_idx + seqlen_kv - seqlen_q - kv_idx| (slopes[b, h] for [batch, heads]
    slopes); the lengths default to equal ones."""
    if not isinstance(slopes, Tensor) or slopes.dim() not in (1, 2) or not slopes.is_floating_point():
        raise ValueError("alibi: slopes must be a floating-point tensor of [heads] or [batch, heads]")
    if (seqlen_q is None) != (seqlen_kv is None):
        raise ValueError("alibi: give both seqlen_q and seqlen_kv, or neither")
    return ScoreMod(slopes=slopes, offset=0 if seqlen_q is None else int(seqlen_kv) - int(seqlen_q))


def chain(*mods: ScoreMod) -> ScoreMod:
    """The modifiers applied one after the other; the kernels' order only (at most one softcap,
    before at most one ALiBi)."""
    out = ScoreMod()
    for mod in mods:
        if not isinstance(mod, ScoreMod):
            raise TypeError(f"chain: {mod!r} is not one of flashattn.score_mods' modifiers")
        if mod.softcap and (out.softcap or out.slopes is not None):
            raise ValueError("chain: a softcap after another softcap or after ALiBi: the kernels apply one "
                             "softcap, before ALiBi")
        if mod.slopes is not None and out.slopes is not None:
            raise ValueError("chain: two ALiBi modifiers: the kernels apply one")
        out = ScoreMod(out.softcap or mod.softcap, out.slopes if mod.slopes is None else mod.slopes,
                       out.offset if mod.slopes is None else mod.offset)
    return out


def native(score_mod, seqlen_q: int, seqlen_kv: int, device) -> Tuple[float, Optional[Tensor]]:
    """(softcap, alibi_slopes as float32 on `device`) for the library's call of score_mod, or
    the error that says why it cannot run natively."""
    if not isinstance(score_mod, ScoreMod):
        raise NotImplementedError("score_mod: flashattn.flex_attention runs flashattn.score_mods' modifiers "
                                  "(softcap, alibi, chain); other callables are not supported yet")
    slopes = score_mod.slopes
    if slopes is None:
        return score_mod.softcap, None
    if slopes.requires_grad:
        raise NotImplementedError("score_mod: ALiBi slopes that require grad: the kernels take them as constants")
    if score_mod.offset != seqlen_kv - seqlen_q:
        raise ValueError(f"score_mod: alibi built for seqlen_kv - seqlen_q = {score_mod.offset}, the call has "
                         f"{seqlen_kv} - {seqlen_q}: pass alibi(slopes, seqlen_q, seqlen_kv)")
    return score_mod.softcap, slopes.detach().to(device=device, dtype=torch.float32).contiguous()
