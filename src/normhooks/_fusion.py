"""Where pickles written before the speed code moved into :mod:`normhooks._kernels` find it.

A model converted by ``apply_weight_norm`` or ``apply_weight_standardization`` carries the
fused scope's hooks, and ``torch.save`` of the whole model names their classes by module
path; those written while the scope lived here name ``normhooks._fusion``. Nothing else
imports this module.
"""

from normhooks._kernels._scope import Fusion as Fusion
from normhooks._kernels._scope import _Close as _Close
from normhooks._kernels._scope import _Open as _Open

__all__: list[str] = []
