"""Chooses what the kernel sources get when they `import nki, nki.isa as nisa, nki.language as nl`.

V4FLASH_NKI=auto (default): the real `nki` package (Neuron SDK) when it imports, else the CPU simulator
`nki_sim` registered under those module names. V4FLASH_NKI=sim forces the simulator (it then replaces a
real `nki` in sys.modules for this process); V4FLASH_NKI=real fails unless the real package is present.
The PyPI placeholder `nki` (which raises ImportError "WRONG PACKAGE") counts as absent.
"""

import os
import sys

ENV = "V4FLASH_NKI"


def _select() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower()
    if mode not in ("auto", "sim", "real"):
        raise ValueError(f"{ENV} must be auto, sim or real, not {mode!r}")
    loaded = sys.modules.get("nki")
    if loaded is not None and getattr(loaded, "IS_SIMULATOR", False):
        if mode == "real":
            raise ImportError(f"{ENV}=real but the simulator is already installed as `nki`")
        return "sim"
    if mode != "sim":
        try:
            import nki  # noqa: F401
            import nki.isa  # noqa: F401
            import nki.language  # noqa: F401
            if hasattr(nki, "jit"):
                return "real"
            reason = "the installed `nki` has no jit"
        except ImportError as e:
            reason = str(e)
        if mode == "real":
            raise ImportError(f"{ENV}=real but the Neuron `nki` package is unusable: {reason}")
    import nki_sim

    nki_sim.install()
    return "sim"


IMPL = _select()
USING_SIMULATOR = IMPL == "sim"
