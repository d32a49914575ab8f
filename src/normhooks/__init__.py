"""normhooks: GradientLARS, adaptive gradient clipping, a trust ratio, gradient centralization,
weight standardization and weight normalization for PyTorch."""

from normhooks._kernels import kernels_enabled, set_kernels_enabled
from normhooks.agc import AdaptiveGradientClipping, agc_, agc_param_groups
from normhooks.data_dependent_init import data_dependent_init
from normhooks.gradient_centralization import GradientCentralization, centralize_gradients_
from normhooks.hypersphere import Hypersphere
from normhooks.lars import GradientLARS, lars_, lars_param_groups
from normhooks.spectral_norm import (
    SpectralNorm,
    apply_spectral_norm,
    remove_spectral_norm,
    spectral_norm,
)
from normhooks.trust_ratio import TrustRatio
from normhooks.update_rms import UpdateRMS
from normhooks.weight_norm import (
    WeightNorm,
    apply_weight_norm,
    convert_with_weight_normalization,
    remove_weight_norm,
    weight_norm,
)
from normhooks.weight_standardization import (
    ScaledWeightStandardization,
    WeightStandardization,
    apply_weight_standardization,
    remove_weight_standardization,
    standardize_weight,
    weight_standardization,
)

__all__ = [
    "AdaptiveGradientClipping",
    "GradientCentralization",
    "GradientLARS",
    "Hypersphere",
    "ScaledWeightStandardization",
    "SpectralNorm",
    "TrustRatio",
    "UpdateRMS",
    "WeightNorm",
    "WeightStandardization",
    "agc_",
    "agc_param_groups",
    "apply_spectral_norm",
    "apply_weight_norm",
    "apply_weight_standardization",
    "centralize_gradients_",
    "convert_with_weight_normalization",
    "data_dependent_init",
    "kernels_enabled",
    "lars_",
    "lars_param_groups",
    "remove_spectral_norm",
    "remove_weight_norm",
    "remove_weight_standardization",
    "set_kernels_enabled",
    "spectral_norm",
    "standardize_weight",
    "weight_norm",
    "weight_standardization",
]
__version__ = "0.1.0"
