"""Identity families. Importing this package registers every identity, in book order.

:func:`identities` and :func:`get_identity` list what is registered; they live here, above the
families, so that the registry itself imports no family (no import cycle).
"""

import warnings

from .._config import FORMER_NAMES
from .._registry import Identity, registered
from . import layer_norm  # noqa: F401
from . import centering  # noqa: F401
from . import norms  # noqa: F401
from . import shortformer  # noqa: F401
from . import attention_biases  # noqa: F401
from . import reparametrise  # noqa: F401
from . import rotation  # noqa: F401
from . import permutations  # noqa: F401
from . import experts  # noqa: F401
from . import quantisation  # noqa: F401
from . import scales  # noqa: F401
from . import rotary  # noqa: F401
from . import pipeline  # noqa: F401
from . import notation  # noqa: F401
from . import attention  # noqa: F401
from . import paths  # noqa: F401
from . import composition  # noqa: F401
from .._errors import UnknownNameError

__all__ = ["identities", "get_identity"]


def identities() -> tuple[Identity, ...]:
    """Every registered identity, in registration order."""
    return tuple(registered().values())


def get_identity(name: str) -> Identity:
    """The registered identity called ``name``, or whose public transform is ``circuitmath.<name>``;
    :class:`~circuitmath.UnknownNameError` (a ``KeyError``) listing the known names if none.

    A former name (``"layer_norm_fold"``, now ``"fold_layer_norm"``) still finds its identity,
    with a :class:`DeprecationWarning`."""
    known = registered()
    if name in FORMER_NAMES:
        warnings.warn(f"identity {name!r} is now called {FORMER_NAMES[name]!r}", DeprecationWarning, stacklevel=2)
        name = FORMER_NAMES[name]
    if name in known:
        return known[name]
    by_function = [i for i in known.values() if i.function == name]
    if by_function:
        return by_function[0]  # the first registered: an identity that shares another's transform comes later
    raise UnknownNameError(f"no identity named {name!r}; known: {sorted(known)}")
