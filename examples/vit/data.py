"""Data for the ViT example: scikit-learn's bundled 8x8 digits (no download), synthetic images, or your
arrays."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """The 1,797 handwritten digits shipped inside scikit-learn, as (N, 8, 8, 1) floats in [0, 1].

    >>> d = load_digits()
    >>> d["train_images"].shape, d["test_images"].shape, int(d["train_labels"].max())
    ((1437, 8, 8, 1), (360, 8, 8, 1), 9)
    """
    from sklearn.datasets import load_digits as sk_digits

    raw = sk_digits()
    return from_arrays((raw.images / 16.0)[..., None], raw.target, test_fraction=test_fraction, seed=seed)


def synthetic(
    n: int, image_size: int, channels: int, num_classes: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random images of any size (for throughput runs), labels from a fixed random projection."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, image_size, image_size, channels)).astype(np.float32)
    return {
        "train_images": images,
        "train_labels": rng.integers(0, num_classes, n).astype(np.int32),
        "test_images": images[:0],
        "test_labels": np.zeros(0, np.int32),
    }


def from_arrays(
    images: np.ndarray, labels: np.ndarray, test_fraction: float = 0.1, seed: int = 0
) -> dict[str, np.ndarray]:
    """Your own data (numpy, or converted from TFDS / grain): (N, H, W, C) images and (N,) labels.

    >>> d = from_arrays(np.zeros((10, 4, 4, 3)), np.arange(10) % 2)
    >>> d["train_images"].shape, d["test_images"].shape
    ((9, 4, 4, 3), (1, 4, 4, 3))
    """
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = math.ceil(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    images, labels = np.asarray(images, np.float32), np.asarray(labels, np.int32)
    return {
        "train_images": images[train],
        "train_labels": labels[train],
        "test_images": images[test],
        "test_labels": labels[test],
    }


def train_batches(
    data: dict[str, np.ndarray], batch_size: int, seed: int = 0, augment: bool = False
) -> Callable[[int], dict[str, np.ndarray]]:
    """``step -> this process's rows of the global batch``: the same batch for a step in every run and resume.

    ``augment`` shifts each image by up to one pixel each way (zero fill).
    """
    n = len(data["train_labels"])

    def batch(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((seed, step))
        idx = rng.choice(n, size=batch_size, replace=False)
        shifts = rng.integers(-1, 2, size=(batch_size, 2))
        per = batch_size // jax.process_count()
        rows = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
        images = data["train_images"][idx[rows]]
        if augment:
            images = np.stack([_shift(im, dy, dx) for im, (dy, dx) in zip(images, shifts[rows], strict=True)])
        return {"images": images, "labels": data["train_labels"][idx[rows]]}

    return batch


def elastic_batches(data: dict[str, np.ndarray], batch_size: int, seed: int = 0) -> Any:
    """The training examples through grain's ``ElasticIterator``: its position is global, so a run resumed on
    any number of processes reads each example once, where an uninterrupted run would have. Each example
    carries its number (``index``) so a run can say which it read.
    """
    import grain

    n = len(data["train_labels"])
    ds = grain.MapDataset.range(n).shuffle(seed=seed).repeat()
    ds = ds.map(
        lambda i: {"images": data["train_images"][i], "labels": data["train_labels"][i], "index": np.int32(i)}
    )
    shard = grain.sharding.ShardOptions(jax.process_index(), jax.process_count())
    return grain.experimental.ElasticIterator(ds, batch_size, shard)


def _shift(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
    out = np.zeros_like(image)
    h, w = image.shape[:2]
    out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


def eval_batches(data: dict[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """The test set in global batches of ``batch_size`` (the remainder is dropped), per process."""
    n = len(data["test_labels"]) // batch_size * batch_size
    per = batch_size // jax.process_count()
    for start in range(0, n, batch_size):
        lo = start + jax.process_index() * per
        yield {"images": data["test_images"][lo : lo + per], "labels": data["test_labels"][lo : lo + per]}
