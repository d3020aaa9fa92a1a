"""The simulator's speed caches (nki_sim._tensor: views and fully-written regions per storage, reshape
geometries) change no verdict: read-before-write is still caught region by region, across dtype views and
after a cache overflow, a failing reshape still fails, and values read back are the values written."""

import numpy as np
import pytest

import nki_sim
from nki_sim import SimError
from nki_sim import _tensor as T
from nki_sim import isa as nisa
from nki_sim import language as nl

jit = nki_sim.jit


def _launch(body, *arrays):
    return jit(body)(*arrays)


def _filled(x, rows):
    """A [128, 4] fp32 SBUF tile with rows 0:rows copied from x (the rest never written)."""
    t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:rows], src=x[0:rows])
    return t


def test_read_before_write_is_caught_per_region_after_reads_of_written_ones():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)

    def body(x):
        t = _filled(x, 2)
        o = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        for _ in range(3):  # the written region, read again and again (the cached verdict)
            nisa.tensor_copy(dst=o[0:2], src=t[0:2])
        nisa.tensor_copy(dst=o[0:3], src=t[0:3])  # row 2 was never written

    with pytest.raises(SimError, match="never-written"):
        _launch(body, x)

    def later(x):  # a region that becomes written later reads fine, as does an overlapping sub-view
        t = _filled(x, 2)
        o = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o[0:2], src=t[0:2])
        nisa.dma_copy(dst=t[2:3], src=x[2:3])
        nisa.tensor_copy(dst=o[0:3], src=t[0:3])
        nisa.tensor_copy(dst=o[0:3, 1:3], src=t[0:3, 1:3])  # another geometry over written rows
        out = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o[0:3])
        return out

    np.testing.assert_array_equal(_launch(later, x), x[0:3])


def test_written_regions_hold_across_dtype_views_and_broadcasts():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)

    def body(x):
        t = _filled(x, 4)
        i = nl.ndarray((128, 4), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i[0:4], src=t[0:4].view(nl.int32))  # same elements, another dtype: written
        b = nl.ndarray((128, 4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b[0:4], src=t[0:4].reshape((4, 4, 1)).broadcast(2, 3))
        out = nl.ndarray((4, 12), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b[0:4].reshape((4, 12)))
        return out

    got = _launch(body, x)
    np.testing.assert_array_equal(got, np.repeat(x, 3, axis=1))

    def bcast_dst(x):
        t = _filled(x, 4)
        b = nl.ndarray((128, 4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b[0:4, :, 0:1].broadcast(2, 3), src=t[0:4].reshape((4, 4, 1)).broadcast(2, 3))

    with pytest.raises(SimError, match="broadcast view"):
        _launch(bcast_dst, x)


def test_cache_overflow_keeps_detection_and_values(monkeypatch):
    monkeypatch.setattr(T, "_CACHE_MAX", 3)
    x = np.arange(512, dtype=np.float32).reshape(128, 4)

    def body(x):
        t = _filled(x, 100)
        o = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        for r in range(0, 100, 10):  # many geometries: the caches of t and o are emptied several times
            nisa.dma_copy(dst=o[r:r + 10], src=t[r:r + 10])
        assert len(t._st.vcache) <= 3 and len(o._st.ok) <= 3
        out = nl.ndarray((100, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o[0:100])
        return out

    np.testing.assert_array_equal(_launch(body, x), x[:100])

    def stale(x):
        t = _filled(x, 100)
        o = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        for r in range(0, 100, 10):
            nisa.dma_copy(dst=o[r:r + 10], src=t[r:r + 10])
        nisa.dma_copy(dst=o[0:101], src=t[0:101])  # row 100 of t was never written

    with pytest.raises(SimError, match="never-written"):
        _launch(stale, x)


def test_failing_reshape_fails_every_time_and_good_ones_match_numpy():
    def body():
        t = nl.ndarray((8, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        for _ in range(2):
            v = t[:, 0:4].reshape((8, 2, 2))
            ref = np.empty((8, 6), np.float32)[:, 0:4].reshape(8, 2, 2)
            assert v.shape == ref.shape and v.strides == tuple(s // 4 for s in ref.strides)
        for _ in range(2):
            with pytest.raises(SimError, match="needs a copy"):
                t[:, 0:4].reshape((32,))

    _launch(body)
