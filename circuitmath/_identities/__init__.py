"""Identity families. Importing this package registers every identity, in book order."""

from . import layer_norm  # noqa: F401
