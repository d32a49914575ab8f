"""The old path of :mod:`normhooks._parametrize.takeover`: the same module object.

Models that took over torch's weight norm, pickled before the package split, name its
state-dict hooks by this path.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from normhooks._parametrize.takeover import *  # noqa: F403
else:
    from normhooks._parametrize import takeover

    sys.modules[__name__] = takeover
