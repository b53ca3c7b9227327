"""Datasets that ship with Starling (no download): the ones ``starling train`` uses."""

from typing import Tuple

import numpy as np

from . import _native

__all__ = ["digits"]


def digits() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 1797 8x8 digit images (scikit-learn's), scaled to [0, 1], split 80/20 with the
    fixed shuffle ``starling train --model mlp`` uses.

    Returns ``(train_x, train_y, test_x, test_y)``: float32 arrays of shape ``(n, 64)`` and
    int64 label arrays of shape ``(n,)``.
    """
    train_x, train_y, test_x, test_y = _native.digits()
    as_images = lambda b: np.frombuffer(b, dtype="<f4").reshape(-1, 64).copy()  # noqa: E731
    return (
        as_images(train_x),
        np.asarray(train_y, dtype=np.int64),
        as_images(test_x),
        np.asarray(test_y, dtype=np.int64),
    )
