"""Arguments a Python caller can get wrong, each a ValueError / TypeError that names the argument
(never nanobind's signature dump, a silent truncation, or an error about something else), and
values at the edge of the valid range that must run: numpy arrays on the CPU backend."""
from __future__ import annotations

import numpy as np
import pytest

import flashattn


def _qkv(rng, b=1, s=24, h=2, d=16):
    return [rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(3)]


def test_huge_window_sides_are_unbounded(rng):
    q, k, v = _qkv(rng)
    want, want_lse = flashattn.forward(q, k, v, window_size=(-1, 0))
    for left in (2**62, 2**63, 2**64 + 5, np.int64(2**63 - 1)):
        out, lse = flashattn.forward(q, k, v, window_size=(left, 0))
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)
    out, _ = flashattn.forward(q, k, v, window_size=(3, 2**70))  # right side unbounded too
    np.testing.assert_array_equal(out, flashattn.forward(q, k, v, window_size=(3, -1))[0])


@pytest.mark.parametrize("window", [(1.5, 0), (0, 2.0), ("3", 0)])
def test_window_sides_must_be_integers(rng, window):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"window_size: expected integers"):
        flashattn.forward(q, k, v, window_size=window)


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
def test_seed_outside_uint64(rng, seed):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"seed: -?\d+ is outside \[0, 2\*\*64\)"):
        flashattn.forward(q, k, v, dropout_p=0.1, seed=seed)


def test_seed_must_be_an_integer(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="seed: expected an integer"):
        flashattn.forward(q, k, v, dropout_p=0.1, seed=1.5)


def test_largest_seed_runs(rng):
    q, k, v = _qkv(rng)
    a, _ = flashattn.forward(q, k, v, dropout_p=0.2, seed=2**64 - 1)
    b, _ = flashattn.forward(q, k, v, dropout_p=0.2, seed=2**64 - 1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("missing", ["dout", "out", "lse"])
def test_backward_names_a_missing_array(rng, missing):
    q, k, v = _qkv(rng)
    out, lse = flashattn.forward(q, k, v)
    arrays = {"dout": np.ones_like(out), "out": out, "lse": lse}
    arrays[missing] = None
    with pytest.raises(ValueError, match=f"{missing}: required by the backward pass"):
        flashattn.backward(arrays["dout"], q, k, v, arrays["out"], arrays["lse"])


def test_cu_seqlens_as_a_list(rng):
    q, k, v = (rng.standard_normal((10, 2, 16)).astype(np.float32) for _ in range(3))
    with pytest.raises(TypeError, match="cu_seqlens_q: expected an int32 array"):
        flashattn.forward(q, k, v, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=np.array([0, 4, 10], np.int32))


@pytest.mark.parametrize("call", ["forward", "backward"])
def test_varlen_index_check(rng, call):
    """index_check names its two values; host arrays are checked on the host whatever it asks, so a
    bad entry is an error at the call."""
    q, k, v = (rng.standard_normal((10, 2, 16)).astype(np.float32) for _ in range(3))
    bad = np.array([0, 6, 4], np.int32)
    good = np.array([0, 4, 10], np.int32)
    args = (q, k, v) if call == "forward" else (q, q, k, v, q, np.zeros((2, 10), np.float32))
    fn = getattr(flashattn, call)
    with pytest.raises(ValueError, match='index_check: \'gpu\' is neither "host" nor "device"'):
        fn(*args, cu_seqlens_q=good, cu_seqlens_k=good, index_check="gpu")
    with pytest.raises(ValueError, match=r"cu_seqlens_k: not monotone at entry 2 \(4 < 6\)"):
        fn(*args, cu_seqlens_q=good, cu_seqlens_k=bad, max_seqlen_q=6, max_seqlen_k=6, index_check="device")


def test_read_only_output_is_a_value_error(rng):
    q, k, v = _qkv(rng)
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: read-only array"):
        flashattn.forward(q, k, v, out=out)


@pytest.mark.parametrize("scale", [1e300, 3e38, 1e-300])
def test_scale_outside_fp32(rng, scale):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="softmax_scale: .* is not a normal fp32 number"):
        flashattn.forward(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("softcap", [3e38, 1.4e-45])
def test_softcap_outside_fp32(rng, softcap):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="softcap: .* out of fp32's normal range"):
        flashattn.forward(q, k, v, softcap=softcap)


def test_overlapping_output_rows(rng):
    """An out whose rows overlap (its sequence stride one head's width, over two heads) is refused
    before anything is written."""
    q, k, v = _qkv(rng)
    buf = np.full(q.size, 7.0, np.float32)
    out = np.lib.stride_tricks.as_strided(buf, q.shape, (q.strides[0], 16 * 4, 16 * 4, 4))
    with pytest.raises(ValueError, match="out: stride.*makes elements share memory"):
        flashattn.forward(q, k, v, out=out)
    assert (buf == 7.0).all()
