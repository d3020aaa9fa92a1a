"""Run NumPy's BLAS single-threaded while a kernel is simulated.

The simulator issues many small GEMMs (at most 128 x 128 x 512); OpenBLAS's thread pool makes those
several times slower than one thread (much worse on a busy machine). The thread count is set through the
library's own API for the duration of a launch and restored afterwards; if NumPy's BLAS is not OpenBLAS or
its symbols cannot be found, nothing is changed.
"""

import contextlib
import ctypes

_api = None  # (get, set) or False when unavailable


def _find():
    global _api
    if _api is not None:
        return _api
    _api = False
    try:
        import numpy  # noqa: F401  (makes sure the library is loaded)
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return _api
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
            get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype = ctypes.c_int
                put.argtypes = [ctypes.c_int]
                _api = (get, put)
                return _api
    return _api


@contextlib.contextmanager
def single_thread():
    api = _find()
    if not api:
        yield
        return
    get, put = api
    before = get()
    put(1)
    try:
        yield
    finally:
        put(before)
