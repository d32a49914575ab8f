"""normhooks: GradientLARS, weight standardization and weight normalization for PyTorch."""

from normhooks.lars import GradientLARS, lars_, lars_param_groups

__all__ = ["GradientLARS", "lars_", "lars_param_groups"]
__version__ = "0.1.0"
