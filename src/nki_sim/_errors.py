"""Exceptions raised by the simulator."""


class SimError(Exception):
    """A kernel did something the NKI toolchain or the Trainium2 hardware rejects (or that the simulator
    cannot prove safe, such as reading memory that was never written)."""


# The real package raises nki.isa.NkiValidationError for hardware-constraint violations.
NkiValidationError = SimError
