"""normhooks: GradientLARS, weight standardization and weight normalization for PyTorch."""

from normhooks.lars import GradientLARS, lars_, lars_param_groups
from normhooks.standardization import (
    ScaledWeightStandardization,
    WeightStandardization,
    apply_weight_standardization,
    remove_weight_standardization,
    standardize_weight,
    weight_standardization,
)

__all__ = [
    "GradientLARS",
    "ScaledWeightStandardization",
    "WeightStandardization",
    "apply_weight_standardization",
    "lars_",
    "lars_param_groups",
    "remove_weight_standardization",
    "standardize_weight",
    "weight_standardization",
]
__version__ = "0.1.0"
