"""Identity families. Importing this package registers every identity, in book order."""

from . import layer_norm  # noqa: F401
from . import centring  # noqa: F401
from . import norms  # noqa: F401
from . import shortformer  # noqa: F401
from . import attention_biases  # noqa: F401
from . import reparametrise  # noqa: F401
from . import rotation  # noqa: F401
from . import pipeline  # noqa: F401
from . import notation  # noqa: F401
from . import attention  # noqa: F401
from . import paths  # noqa: F401
from . import composition  # noqa: F401
