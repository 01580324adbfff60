"""Small models and data sets that ship with mirrorax: the main job's CNN and its digits data.

Everything here runs without a network: the default data set is scikit-learn's bundled handwritten
digits (1,797 images of 8x8 pixels); a local MNIST ``.npz`` (``x_train, y_train, x_test, y_test``, as
``keras.datasets.mnist`` saves it) can be used instead.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["load_digits", "digits_cnn", "mlp"]


def load_digits(path: str | os.PathLike[str] | None = None, *, test_fraction: float = 0.2, seed: int = 0
                ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads a handwritten-digits data set as ``((x_train, y_train), (x_test, y_test))``.

    Images are float32 in ``[0, 1]`` with a trailing channel axis (``(n, h, w, 1)``); labels are int32.

    Args:
      path: a local MNIST ``.npz`` with ``x_train, y_train, x_test, y_test``; ``None`` uses
        scikit-learn's bundled 8x8 digits, split into train and test with ``seed``.
      test_fraction: share of the bundled digits held out for testing (ignored with ``path``).
      seed: seed of the bundled digits' train/test split.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the ``.npz`` lacks one of the four arrays.

    Example:
      >>> (x, y), (xt, yt) = load_digits()
      >>> x.shape[1:], x.dtype
      ((8, 8, 1), dtype('float32'))
    """
    if path is not None:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data: no such file {path!r}. Expected a local MNIST .npz with "
                                    "x_train, y_train, x_test, y_test (as keras.datasets.mnist saves it).")
        with np.load(path) as f:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f.files]
            if missing:
                raise ValueError(f"{path!r} lacks {missing}; it holds {sorted(f.files)}. Expected "
                                 "x_train, y_train, x_test, y_test.")
            arrays = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        x, y, xt, yt = arrays
        scale = 255.0 if x.dtype == np.uint8 or x.max() > 1.5 else 1.0

        def prep(a: np.ndarray) -> np.ndarray:
            return (a.astype(np.float32) / scale).reshape(a.shape[0], a.shape[1], a.shape[2], 1)

        return (prep(x), y.astype(np.int32)), (prep(xt), yt.astype(np.int32))

    from sklearn.datasets import load_digits as _sk_digits

    d = _sk_digits()
    images = (d.images / 16.0).astype(np.float32)[..., None]
    labels = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


def digits_cnn(input_shape: tuple[int, ...] = (8, 8, 1), num_classes: int = 10, *, width: int = 32,
               batch_norm: bool = True, dropout: float = 0.1) -> Any:
    """The main job's convolutional network (a Keras 3 model, not compiled).

    Two 3x3 convolutions (``width`` and ``2 * width`` filters, the first followed by BatchNormalization),
    max-pooling, a dense layer with Dropout and a softmax head. About 40k parameters at 8x8 input.

    Example:
      >>> model = digits_cnn()
      >>> model.output_shape
      (None, 10)
    """
    import keras

    layers = [keras.Input(input_shape), keras.layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [
        keras.layers.Activation("relu"),
        keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(num_classes, activation="softmax"))
    return keras.Sequential(layers, name="digits_cnn")


def mlp(input_dim: int = 784, hidden: int = 512, num_classes: int = 10) -> Any:
    """A two-layer perceptron ``input_dim-hidden-num_classes`` (a Keras 3 model, not compiled).

    Example:
      >>> mlp().count_params()
      407050
    """
    import keras

    return keras.Sequential([
        keras.Input((input_dim,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(num_classes, activation="softmax"),
    ], name="mlp")
