"""The old path of :mod:`normhooks._parametrize.optimizer_watch`: the same module object.

The watch keeps its state in module globals, so this path is that module itself, not a copy
of its names.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from normhooks._parametrize.optimizer_watch import *  # noqa: F403
else:
    from normhooks._parametrize import optimizer_watch

    sys.modules[__name__] = optimizer_watch
