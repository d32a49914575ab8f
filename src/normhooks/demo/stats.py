r"""The demo's statistics: t intervals over seeds, paired differences, and the verdict rule.

Every configuration runs once per seed, and two configurations of one experiment that share a
seed share their initialization (where the models match) and their batch order, so a claim
is judged on the **paired** differences :math:`d_i = b_i - a_i` over seeds :math:`i`. With
:math:`n` seeds, mean :math:`\bar d` and sample standard deviation :math:`s`, the 95 %
interval is Student's

.. math::
    \bar d \pm t_{0.975,\, n-1}\, s / \sqrt{n}.

:func:`verdict` is the rule, fixed here: *reproduced* when the interval excludes zero on the
side the claim predicts, *contradicted* when it excludes zero on the other side, and
*inconclusive* otherwise (including fewer than two seeds and non-finite values).

References:
    Student (W. S. Gosset), "The probable error of a mean", Biometrika 6 (1908).
    NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, "Critical values of
    the Student's t distribution" (the table below, to four decimals).
    M. Abramowitz and I. A. Stegun, Handbook of Mathematical Functions (1964), 26.7.5 (the
    expansion used beyond 30 degrees of freedom).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LEVEL",
    "Direction",
    "Interval",
    "Outcome",
    "interval",
    "paired_interval",
    "t_quantile",
    "verdict",
]

# Two-sided 95 % intervals throughout.
LEVEL = 0.95

Direction = Literal["higher", "lower"]
Outcome = Literal["reproduced", "contradicted", "inconclusive"]

# t_{0.975, df} for df = 1..30 (the NIST/SEMATECH table; scipy.stats.t.ppf agrees to 1e-4).
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
# The standard normal's 0.975 quantile.
_Z975 = 1.959963984540054


def t_quantile(df: int) -> float:
    r"""The 0.975 quantile of Student's t with ``df`` degrees of freedom.

    From the table for ``df <= 30``; above, Abramowitz and Stegun's expansion 26.7.5 in
    :math:`1/\nu`, whose error there is below 1e-6.

    Example:
        >>> t_quantile(7), round(t_quantile(1000), 4)
        (2.3646, 1.9623)
    """
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an integer >= 1, got df={df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its 95 % t interval.

    ``low`` and ``high`` are ``-inf`` and ``inf`` for a single value, and ``nan`` (with the
    mean) when a value is not finite, such as the loss of a diverged run.
    """

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def interval(values: Sequence[float]) -> Interval:
    r"""The mean of ``values`` and its 95 % t interval, :math:`\bar x \pm t\, s/\sqrt n`.

    Example:
        >>> i = interval([1.0, 2.0, 3.0])
        >>> i.mean, round(i.low, 4), round(i.high, 4)
        (2.0, -0.4842, 4.4842)
    """
    n = len(values)
    if n == 0:
        raise ValueError("values must hold at least one number, got none")
    if not all(math.isfinite(v) for v in values):
        return Interval(math.nan, math.nan, math.nan, n)
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf, n)
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = t_quantile(n - 1) * math.sqrt(variance / n)
    return Interval(mean, mean - half, mean + half, n)


def paired_interval(a: Sequence[float], b: Sequence[float]) -> Interval:
    """The interval of the mean paired difference ``b[i] - a[i]`` (seed ``i`` in both).

    Example:
        >>> d = paired_interval([0.90, 0.92, 0.91], [0.93, 0.94, 0.95])
        >>> round(d.mean, 6), round(d.low, 4), round(d.high, 4)
        (0.03, 0.0052, 0.0548)
    """
    if len(a) != len(b):
        raise ValueError(f"a and b must pair one value per seed, got {len(a)} and {len(b)} values")
    return interval([y - x for x, y in zip(a, b, strict=True)])


def verdict(difference: Interval, direction: Direction) -> Outcome:
    """The rule: does the interval of the claimed difference exclude zero, and on which side?

    Args:
        difference: the interval of ``claimed side - other side``, paired over seeds.
        direction: ``"higher"`` if the claim predicts a positive difference, ``"lower"`` if
            negative.

    Returns:
        ``"reproduced"`` if the whole interval lies on the predicted side of zero,
        ``"contradicted"`` if it lies wholly on the other side, else ``"inconclusive"``
        (an interval that touches zero, or a ``nan`` one).

    Example:
        >>> verdict(Interval(0.02, 0.01, 0.03, 8), "higher")
        'reproduced'
        >>> verdict(Interval(0.02, 0.01, 0.03, 8), "lower")
        'contradicted'
        >>> verdict(Interval(0.02, -0.01, 0.05, 8), "higher")
        'inconclusive'
    """
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower', got direction={direction!r}")
    if math.isnan(difference.low) or math.isnan(difference.high):
        return "inconclusive"
    sign = 1.0 if direction == "higher" else -1.0
    low, high = sorted((sign * difference.low, sign * difference.high))
    if low > 0:
        return "reproduced"
    if high < 0:
        return "contradicted"
    return "inconclusive"
