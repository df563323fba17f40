"""Errors that name what went wrong."""

from __future__ import annotations


__all__ = [
    "CircuitMathError",
    "InputError",
    "ConfigError",
    "UnknownNameError",
    "ArgumentTypeError",
    "StateDictError",
    "Precondition",
    "NOT_APPLIED",
    "PreconditionError",
    "AlreadyAppliedError",
    "OverflowedError",
]


class CircuitMathError(Exception):
    """Base class of every error circuitmath raises on purpose.

    Bad input of any kind (a file, a config, a state dict, an argument) raises a subclass whose
    message names the file and the key or field at fault; ``python -m circuitmath`` turns it
    into ``error: ...`` on stderr and exit status 2. Anything else escaping is a bug.
    """


class InputError(CircuitMathError, ValueError):
    """A file or an argument that cannot be used as given (missing, not a regular file, too
    large, not UTF-8, not JSON, an argument out of range): nothing was computed or written."""


class UnknownNameError(InputError, KeyError):
    """A name nothing is registered under (an identity, a zoo model); the message lists the known ones."""

    __str__ = Exception.__str__  # the message as written, not quoted as KeyError quotes it


class ArgumentTypeError(InputError, TypeError):
    """An argument of the wrong type (a keyword that takes True, False or None, say)."""


class ConfigError(InputError):
    """A :class:`~circuitmath.Config` (or the JSON it was read from) with a missing, unknown or
    ill-typed field; the message names every field at fault."""


class StateDictError(InputError):
    """A state dict (or the file it came from) does not match its config: nothing was computed."""


class Precondition(str):
    """A condition an identity needs, as one object the registry lists and the transform raises.

    Its string value is its short name (what :class:`PreconditionError` messages and the
    diagnosis's rows print); ``statement`` is the condition as a sentence (what the book lists).
    An identity's ``preconditions`` hold these objects, and a transform refuses a model with
    ``require(identity, PRECONDITION, holds, detail)`` naming one of them, so the error's
    ``precondition`` *is* a registered precondition (a test checks it).
    """

    statement: str

    def __new__(cls, name: str, statement: str | None = None) -> "Precondition":
        self = super().__new__(cls, name)
        self.statement = statement or name
        return self


#: Every transform's first precondition: it is not recorded in ``cfg.applied`` yet.
NOT_APPLIED = Precondition("not already applied")


class PreconditionError(CircuitMathError, ValueError):
    """A transform refused a model it cannot rewrite exactly.

    ``identity`` is the registered identity whose precondition fails, ``precondition`` is that
    :class:`Precondition` (one of the identity's registered ones; a plain string only from
    code outside the registry), and ``detail`` says what in this model breaks it.
    """

    def __init__(self, identity: str, precondition: Precondition | str, detail: str):
        self.identity = identity
        self.precondition = precondition
        self.detail = detail
        super().__init__(f"{identity}: precondition '{precondition}' does not hold: {detail}")


class AlreadyAppliedError(PreconditionError):
    """The transform is already recorded in ``cfg.applied``, so it is not run again.

    For a fold a second application would fold the weights into themselves and change the
    model; for the centerings, the value-bias fold, the key-bias removal and the refactor it
    would change nothing. Either way asking twice is a mistake in the caller's pipeline.
    """

    def __init__(self, identity: str):
        super().__init__(
            identity,
            NOT_APPLIED,
            f"cfg.applied already records '{identity}': these weights went through it once, and a"
            " second application is refused rather than repeated",
        )


class OverflowedError(StateDictError):
    """A rewrite of finite weights produced a NaN or an Inf (the dtype's range was exceeded):
    nothing is returned rather than a different model. The message says "overflow" and names the
    identity (or the pipeline) and the tensors whose entries are not finite."""
