"""Every step hook normhooks ships, with its technique written out by hand in float64.

``KINDS`` is the one list of hooks: tests/test_hook_contract.py runs its behaviours over each,
and tests/distributed_worker.py trains each under FSDP2; a new hook is one entry here. Each
entry states its technique as one plain SGD step (``w <- w - lr * g``, no momentum) with the
hook: for a hook on the gradients, the step with the gradient the formula rewrites; for a hook
on the updates, the step's update rescaled. Nothing here calls normhooks' maths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from normhooks import (
    AdaptiveGradientClipping,
    GradientCentralization,
    GradientLARS,
    Hypersphere,
    TrustRatio,
    UpdateRMS,
    agc_,
    centralize_gradients_,
    lars_,
)


def lars_rate(
    w: Tensor,
    g: Tensor,
    lr: float,
    *,
    threshold: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-9,
    trust_coefficient: float = 1.0,
    clip: bool = False,
) -> float:
    """You et al. 2017 with Chen et al. 2018's threshold, as Chainer's GradientLARS."""
    w_norm, g_norm = w.double().norm().item(), g.double().norm().item()
    if w_norm <= threshold:
        return 1.0
    denominator = eps + g_norm + weight_decay * w_norm
    if denominator == 0:
        return 1.0
    rate = trust_coefficient * w_norm / denominator
    return min(rate / lr, 1.0) if clip else rate


def lars_gradient(w: Tensor, g: Tensor, lr: float, **settings: Any) -> Tensor:
    decay = settings.get("weight_decay", 0.0)
    return lars_rate(w, g, lr, **settings) * (g.double() + decay * w.double())


def agc_rows(
    w: Tensor, g: Tensor, *, clipping: float = 0.01, eps: float = 1e-3
) -> tuple[Tensor, list[float]]:
    """Brock et al. 2021: each row along dim 0 (the whole tensor below 2 dims) clipped to
    ``clipping * max(||W_i||, eps)``; the clipped gradient and each row's ratio."""
    w64, g64 = w.detach().double(), g.double()
    rows = 1 if w64.ndim < 2 else w64.shape[0]
    size = w64.numel() // rows if rows else 0
    w_rows, g_rows = w64.reshape(rows, size), g64.reshape(rows, size).clone()
    ratios = []
    for i in range(rows):
        w_norm = max(w_rows[i].norm().item(), eps)
        g_norm = g_rows[i].norm().item()
        ratios.append(g_norm / w_norm)
        if g_norm / w_norm > clipping:
            g_rows[i] *= clipping * w_norm / g_norm
    return g_rows.reshape(g.shape), ratios


def agc_gradient(w: Tensor, g: Tensor, lr: float, **settings: Any) -> Tensor:
    return agc_rows(w, g, **settings)[0]


def agc_value(w: Tensor, g: Tensor, lr: float, **settings: Any) -> float:
    return max(agc_rows(w, g, **settings)[1], default=0.0)


def guarded_ratio(
    w_norm: float,
    u_norm: float,
    *,
    threshold: float = 0.0,
    eps: float = 0.0,
    trust_coefficient: float = 1.0,
    clip: float | None = None,
) -> float:
    """You et al. 2019's ratio ``||w|| / (||u|| + eps)``, 1 where a norm is at its floor."""
    if w_norm <= threshold or u_norm == 0:
        return 1.0
    ratio = trust_coefficient * w_norm / (u_norm + eps)
    return ratio if clip is None else min(ratio, clip)


def trust_ratio(w: Tensor, u: Tensor, **settings: Any) -> float:
    return guarded_ratio(w.double().norm().item(), u.double().norm().item(), **settings)


def centralized(w: Tensor, g: Tensor, lr: float, *, conv_only: bool = False) -> Tensor:
    """Yong et al. 2020: the gradient of a tensor of 2 or more dims (4 or more with
    ``conv_only``) minus its mean over every dim but dim 0."""
    g64 = g.double()
    if g64.ndim < (4 if conv_only else 2):
        return g64
    return g64 - g64.mean(dim=tuple(range(1, g64.ndim)), keepdim=True)


def rms_ratio(w: Tensor, u: Tensor, *, rule: str, rms: float) -> float:
    """Adafactor's update clipping ``1 / max(1, RMS(u) / d)`` (``rule="clip"``) or the RMS
    matching ``d / RMS(u)`` (``"match"``) of Moonlight, 1 for a zero update."""
    u_rms = u.double().norm().item() / max(u.numel(), 1) ** 0.5
    if u_rms == 0:
        return 1.0
    return 1.0 / max(1.0, u_rms / rms) if rule == "clip" else rms / u_rms


def on_sphere(w: Tensor, *, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """nGPT's ``w / ||w||`` for each row (``dim=1``) or column (``dim=0``) of a tensor of 2 or
    more dims seen as a matrix of its dim 0 by the rest, the norm floored at ``eps``."""
    w64 = w.detach().double()
    if w64.ndim < 2:
        return w64
    matrix = w64.reshape(w64.shape[0], -1)
    norms = matrix.norm(dim=dim, keepdim=True).clamp(min=eps)
    return (matrix / norms).reshape(w64.shape)


@dataclass(frozen=True)
class Kind:
    """One hook: its class and functional form, its technique by hand, and what it exposes.

    ``gradient(w, g, lr, **settings)`` is the rewritten gradient of a hook on the gradients;
    ``ratio(w, g, **settings)`` the factor of a hook on the updates, which SGD's step
    ``-lr * g`` is multiplied by. ``override`` is a param-group key, its value and the
    setting it stands for; ``values`` the attribute of each group's values of the last step
    and ``value(w, g, lr, **settings)`` each parameter's. ``project(w, **settings)`` is what a
    hook that rewrites the parameters after the step makes of SGD's result ``w``.
    """

    hook: type[Any]
    functional: Callable[..., Tensor | None] | None
    gradient: Callable[..., Tensor] | None = None
    ratio: Callable[..., float] | None = None
    override: tuple[str, object, str] = ("", None, "")
    bad_override: tuple[str, object, str] = ("", None, "")
    values: str | None = None
    value: Callable[..., float] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    project: Callable[..., Tensor] | None = None

    @property
    def prefix(self) -> str:
        prefix: str = self.hook.prefix
        return prefix

    @property
    def on_updates(self) -> bool:
        return bool(self.hook.rewrites == "updates")

    def make(self, **settings: Any) -> Any:
        return self.hook(**(self.settings | settings))

    def stepped(self, w: Tensor, g: Tensor, lr: float, **settings: Any) -> Tensor:
        """``w`` after one SGD(lr) step with gradient ``g`` under the hook, in float64."""
        settings = self.settings | settings
        w64 = w.detach().double()
        if self.gradient is not None:
            return w64 - lr * self.gradient(w, g, lr, **settings)
        if self.project is not None:
            return self.project(w64 - lr * g.double(), **settings)
        assert self.ratio is not None
        return w64 - lr * self.ratio(w, g, **settings) * g.double()

    def expected_value(self, w: Tensor, g: Tensor, lr: float, **settings: Any) -> float:
        settings = self.settings | settings
        if self.value is not None:
            return self.value(w, g, lr, **settings)
        assert self.ratio is not None
        return self.ratio(w, g, **settings)


KINDS: dict[str, Kind] = {
    "lars": Kind(
        GradientLARS,
        lars_,
        gradient=lars_gradient,
        override=("lars_trust_coefficient", 0.5, "trust_coefficient"),
        bad_override=("lars_eps", -1.0, r"param group \d: lars_eps must be non-negative"),
        values="last_rates",
        value=lambda w, g, lr, **s: lars_rate(w, g, lr, **s),
    ),
    "agc": Kind(
        AdaptiveGradientClipping,
        agc_,
        gradient=agc_gradient,
        override=("agc_clipping", 0.02, "clipping"),
        bad_override=("agc_eps", -1.0, r"param group \d: agc_eps must be non-negative"),
        values="last_ratios",
        value=agc_value,
        # Clips some units of the test gradients and leaves others alone.
        settings={"clipping": 0.3},
    ),
    "trust": Kind(
        TrustRatio,
        None,
        ratio=trust_ratio,
        override=("trust_coefficient", 0.5, "trust_coefficient"),
        bad_override=("trust_clip", 0.0, r"param group \d: trust_clip must be positive"),
        values="last_ratios",
    ),
    "gc": Kind(
        GradientCentralization,
        centralize_gradients_,
        gradient=centralized,
        override=("gc_conv_only", True, "conv_only"),
        bad_override=("gc_conv_only", 1, r"param group \d: gc_conv_only must be a bool"),
    ),
    "sphere": Kind(
        Hypersphere,
        None,
        project=on_sphere,
        override=("sphere_dim", 0, "dim"),
        bad_override=("sphere_eps", 0.0, r"param group \d: sphere_eps must be positive"),
    ),
    "update_clip": Kind(
        UpdateRMS,
        None,
        ratio=rms_ratio,
        override=("update_rms", 0.5, "rms"),
        bad_override=("update_rule", "scale", r"param group \d: update_rule must be 'clip'"),
        values="last_ratios",
        # Clips some of the test updates (RMS about 0.3) and leaves others alone.
        settings={"rule": "clip", "rms": 0.3},
    ),
    "update_match": Kind(
        UpdateRMS,
        None,
        ratio=rms_ratio,
        override=("update_rms", 0.1, "rms"),
        bad_override=("update_rms", -1.0, r"param group \d: update_rms must be positive"),
        values="last_ratios",
        settings={"rule": "match", "rms": 0.2},
    ),
}
ON_GRADIENTS = {name: kind for name, kind in KINDS.items() if not kind.on_updates}
