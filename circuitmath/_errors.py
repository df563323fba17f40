"""Errors that name what went wrong."""

from __future__ import annotations

__all__ = ["CircuitMathError", "StateDictError", "PreconditionError", "AlreadyAppliedError"]


class CircuitMathError(Exception):
    """Base class of every error circuitmath raises on purpose."""


class StateDictError(CircuitMathError, ValueError):
    """A state dict (or the file it came from) does not match its config: nothing was computed."""


class PreconditionError(CircuitMathError, ValueError):
    """A transform refused a model it cannot rewrite exactly.

    ``identity`` is the registered identity whose precondition fails, ``precondition`` names it,
    and ``detail`` says what in this model breaks it.
    """

    def __init__(self, identity: str, precondition: str, detail: str):
        self.identity = identity
        self.precondition = precondition
        self.detail = detail
        super().__init__(f"{identity}: precondition '{precondition}' does not hold: {detail}")


class AlreadyAppliedError(PreconditionError):
    """The transform is already recorded in ``cfg.applied``, so it is not run again.

    For a fold a second application would fold the weights into themselves and change the
    model; for the centrings, the value-bias fold, the key-bias removal and the refactor it
    would change nothing. Either way asking twice is a mistake in the caller's pipeline.
    """

    def __init__(self, identity: str):
        super().__init__(
            identity,
            "not already applied",
            f"cfg.applied already records '{identity}': these weights went through it once, and a"
            " second application is refused rather than repeated",
        )
