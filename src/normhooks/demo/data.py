"""The demo's data: scikit-learn's bundled digits, or a user's ``.npz`` file, split and scaled.

Both sources go through the same checks and the same split: a permutation drawn from a fixed
seed (``SPLIT_SEED``, independent of ``--seed``, so every run tests on the same images), a
quarter of the samples held out, and inputs scaled per channel with the training set's mean
and standard deviation.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from normhooks.demo.errors import DemoError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["SPLIT_SEED", "TEST_FRACTION", "Dataset", "load_digits", "load_npz", "split"]

SPLIT_SEED = 0
# digits-hard's distortions: one fixed draw, independent of --seed and of the split.
DISTORTION_SEED = 2017
MAX_ROTATION_DEG = 15.0
MAX_SCALE = 0.1
MAX_SHEAR = 0.2
MAX_SHIFT = 0.5
NOISE = 0.1
TEST_FRACTION = 0.25
# The smallest data set whose split leaves at least two test and several training samples.
_MIN_SAMPLES = 10


@dataclass(frozen=True)
class Dataset:
    """A train/test split of images ``[N, C, H, W]`` (float32) and class ids ``[N]`` (int64).

    Attributes:
        source: where the data came from, for the report.
        train_x: training inputs, scaled per channel to mean 0 and standard deviation 1.
        train_y: training class ids.
        test_x: test inputs, scaled with the training set's statistics.
        test_y: test class ids.
        num_classes: one more than the largest class id.
    """

    source: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.train_x.shape[2]), int(self.train_x.shape[3])

    def to(self, device: torch.device) -> Dataset:
        """The same split with every tensor on ``device``."""
        return Dataset(
            self.source,
            self.train_x.to(device),
            self.train_y.to(device),
            self.test_x.to(device),
            self.test_y.to(device),
            self.num_classes,
        )

    def first_train(self, count: int) -> Dataset:
        """The split with only the first ``count`` training samples (the test set is kept)."""
        return Dataset(
            self.source,
            self.train_x[:count],
            self.train_y[:count],
            self.test_x,
            self.test_y,
            self.num_classes,
        )


def load_digits() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes) as ``[N, 1, 8, 8]``."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits  # type: ignore[import-untyped]

    digits = sklearn_digits()
    images = np.asarray(digits.images, dtype=np.float32)[:, None]
    return images, np.asarray(digits.target, dtype=np.int64)


def load_digits_hard() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The bundled digits, each warped by its own fixed random affine map and noised.

    A harder variant on which the demo's models stay below the accuracy ceiling: every image
    gets a rotation, a scale, a shear and a shift drawn once from ``DISTORTION_SEED`` (the
    same on every run and machine), is resampled bilinearly (zeros outside the frame), and
    gets fixed Gaussian pixel noise. The labels are unchanged.
    """
    images, labels = load_digits()
    return distort(images, seed=DISTORTION_SEED), labels


def distort(images: npt.NDArray[np.float32], *, seed: int) -> npt.NDArray[np.float32]:
    """Warps each image ``[N, C, H, W]`` by a random affine map and adds Gaussian noise.

    Each image's map sends output pixel ``p`` (coordinates centred on the image) to input
    point ``A^{-1} (p - t)`` with ``A = R(angle) S(scale) H(shear)``; the parameters are
    uniform in ``±MAX_ROTATION_DEG``, ``1 ± MAX_SCALE``, ``±MAX_SHEAR`` and ``±MAX_SHIFT``
    pixels, and the noise's standard deviation is ``NOISE`` times the data's largest value.

    Example:
        >>> import numpy as np
        >>> x = np.zeros((3, 1, 8, 8), dtype=np.float32)
        >>> x[:, :, 2:6, 3:5] = 16.0
        >>> a, b = distort(x, seed=1), distort(x, seed=1)
        >>> a.shape, a.dtype, bool((a == b).all()), bool((a != x).any())
        ((3, 1, 8, 8), dtype('float32'), True, True)
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    n, _, height, width = images.shape
    angle = np.deg2rad(rng.uniform(-MAX_ROTATION_DEG, MAX_ROTATION_DEG, n))
    scale = rng.uniform(1 - MAX_SCALE, 1 + MAX_SCALE, n)
    shear = rng.uniform(-MAX_SHEAR, MAX_SHEAR, n)
    shift = rng.uniform(-MAX_SHIFT, MAX_SHIFT, (n, 2))
    cos, sin = np.cos(angle), np.sin(angle)
    # A = R S H with H = [[1, shear], [0, 1]]; rows of A per image.
    a = np.stack(
        [
            np.stack([cos * scale, cos * scale * shear - sin * scale], axis=-1),
            np.stack([sin * scale, sin * scale * shear + cos * scale], axis=-1),
        ],
        axis=-2,
    )
    inverse = np.linalg.inv(a)
    rows, cols = np.meshgrid(
        np.arange(height) - (height - 1) / 2, np.arange(width) - (width - 1) / 2, indexing="ij"
    )
    out = np.stack([cols.ravel(), rows.ravel()])[None] - shift[:, :, None]
    source = inverse @ out
    x = source[:, 0] + (width - 1) / 2
    y = source[:, 1] + (height - 1) / 2
    warped = _bilinear(images, x, y)
    noise = rng.normal(0.0, NOISE * float(images.max()), warped.shape)
    return (warped + noise).astype(np.float32)


def _bilinear(
    images: npt.NDArray[np.float32], x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Samples ``images`` at points ``(x, y)`` (``[N, H*W]`` each), zero outside the frame."""
    import numpy as np

    n, channels, height, width = images.shape
    padded = np.zeros((n, channels, height + 2, width + 2))
    padded[:, :, 1:-1, 1:-1] = images
    # In the padded frame; a point beyond it reads the zero border.
    x = np.clip(x + 1, 0, width + 1)
    y = np.clip(y + 1, 0, height + 1)
    x0 = np.minimum(np.floor(x), width).astype(np.int64)
    y0 = np.minimum(np.floor(y), height).astype(np.int64)
    x1, y1 = x0 + 1, y0 + 1
    fx, fy = (x - x0)[:, None], (y - y0)[:, None]
    index = np.arange(n)[:, None]

    def at(yy: npt.NDArray[np.int64], xx: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        # The two index arrays come first in the result: [N, H*W, C] -> [N, C, H*W].
        sampled: npt.NDArray[np.float64] = padded[index, :, yy, xx]
        channels_first: npt.NDArray[np.float64] = sampled.transpose(0, 2, 1)
        return channels_first

    value = (
        at(y0, x0) * (1 - fx) * (1 - fy)
        + at(y0, x1) * fx * (1 - fy)
        + at(y1, x0) * (1 - fx) * fy
        + at(y1, x1) * fx * fy
    )
    return value.reshape(n, channels, height, width)


def load_npz(path: Path) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Reads and checks arrays ``x`` ([N, C, H, W] or [N, H, W]) and ``y`` ([N]) from ``path``.

    Raises:
        DemoError: the file is missing or unreadable, an array is missing or ill-shaped, or
            the labels are not class ids ``0..K-1`` for each of the ``N`` samples.
    """
    import numpy as np

    where = f"--data {path}"
    if not path.exists():
        raise DemoError(f"{where}: no such file")
    if not path.is_file():
        raise DemoError(f"{where}: not a file")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise DemoError(f"{where}: cannot read it as a .npz archive ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DemoError(f"{where}: not a .npz archive, but a single array (numpy.savez writes one)")
    with archive:
        missing = [key for key in ("x", "y") if key not in archive.files]
        if missing:
            found = ", ".join(repr(key) for key in archive.files) or "none"
            raise DemoError(
                f"{where}: needs arrays 'x' and 'y'; {' and '.join(map(repr, missing))} "
                f"missing (arrays found: {found})"
            )
        try:
            x, y = archive["x"], archive["y"]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise DemoError(f"{where}: cannot read arrays 'x' and 'y' ({error})") from None
    return _checked_images(x, where), _checked_labels(y, len(x), where)


def _checked_images(x: npt.NDArray[np.generic], where: str) -> npt.NDArray[np.float32]:
    import numpy as np

    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or min(x.shape) == 0:
        raise DemoError(
            f"{where}: x must be shaped [N, C, H, W] or [N, H, W] with no empty axis, "
            f"got shape {tuple(x.shape)}"
        )
    if x.dtype.kind not in "biuf":
        raise DemoError(f"{where}: x must hold real numbers, got dtype {x.dtype}")
    images = x.astype(np.float32)
    if not np.isfinite(images).all():
        raise DemoError(f"{where}: x has values that are not finite in float32 (nan or inf)")
    if len(images) < _MIN_SAMPLES:
        raise DemoError(
            f"{where}: needs at least {_MIN_SAMPLES} samples to split into train and test, "
            f"got {len(images)}"
        )
    return images


def _checked_labels(y: npt.NDArray[np.generic], samples: int, where: str) -> npt.NDArray[np.int64]:
    import numpy as np

    if y.ndim != 1:
        raise DemoError(f"{where}: y must be shaped [N], got shape {tuple(y.shape)}")
    if len(y) != samples:
        raise DemoError(f"{where}: x has {samples} samples but y has {len(y)} labels")
    if y.dtype.kind not in "iu":
        raise DemoError(f"{where}: y must hold integer class ids, got dtype {y.dtype}")
    labels = y.astype(np.int64)
    if labels.min() < 0:
        raise DemoError(
            f"{where}: y must hold class ids 0..K-1, got a negative one ({labels.min()})"
        )
    if labels.max() >= samples:
        raise DemoError(
            f"{where}: y must hold class ids 0..K-1 with K at most the {samples} samples, "
            f"got class id {labels.max()}"
        )
    if len(np.unique(labels)) < 2:
        raise DemoError(f"{where}: y must hold at least 2 classes, got only class {labels[0]}")
    return labels


def split(x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], *, source: str) -> Dataset:
    """Splits checked arrays into train and test with ``SPLIT_SEED`` and scales the inputs.

    Example:
        >>> import numpy as np
        >>> x = np.arange(40, dtype=np.float32).reshape(10, 1, 2, 2)
        >>> data = split(x, np.arange(10) % 2, source="example")
        >>> len(data.train_y), len(data.test_y), data.num_classes
        (8, 2, 2)
        >>> round(float(data.train_x.mean()), 6), round(float(data.train_x.std(unbiased=False)), 3)
        (0.0, 1.0)
    """
    images = torch.from_numpy(x).float()
    labels = torch.from_numpy(y).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = max(2, math.floor(len(labels) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    mean = images[train].mean(dim=(0, 2, 3), keepdim=True)
    std = images[train].std(dim=(0, 2, 3), keepdim=True, unbiased=False).clamp_min(1e-6)
    return Dataset(
        source=source,
        train_x=(images[train] - mean) / std,
        train_y=labels[train],
        test_x=(images[test] - mean) / std,
        test_y=labels[test],
        num_classes=int(labels.max()) + 1,
    )
