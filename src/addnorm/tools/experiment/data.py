"""The square-corners task: the sequences, their noise floor, and ``--data`` files.

The task comes from Godoy's *Deep Learning with PyTorch Step-by-Step* (seed 003): each
sequence is the four corners of the square ``[-1, 1]²`` in order, starting at a random corner,
clockwise or counter-clockwise, with Gaussian noise (σ = 0.1) on every coordinate. Given the
first two corners, the model predicts the last two (teacher forcing in training,
autoregressive at test). Even a perfect model cannot beat the noise: the *noise floor* is the
test MSE of predicting the exact corners (≈ σ² = 0.01), reported beside every result.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from ..cli import is_number, read_numbers
from .config import Config

CORNERS = np.array([[-1.0, -1.0], [-1.0, 1.0], [1.0, 1.0], [1.0, -1.0]])  # clockwise
NOISE = 0.1
TRAIN_SEED, TEST_SEED = 13, 19  # Godoy's seeds: the same sequences as the book
N_TRAIN, N_TEST = 256, 128


def square_sequences(n: int, seed: int, noise: float = NOISE) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy square-corner sequences, ``(points [n, 4, 2], directions [n])``.

    ``directions[i]`` is 1 for clockwise, 0 for counter-clockwise. The random draws follow
    Godoy's ``generate_sequences`` (seed 13 and 19 give the book's train and test sets).
    """
    rng = np.random.RandomState(seed)
    bases = rng.randint(4, size=n)
    directions = rng.randint(2, size=n)
    clean = [CORNERS[[(b + i) % 4 for i in range(4)]][:: 2 * d - 1] for b, d in zip(bases, directions, strict=True)]
    points = np.stack([c + rng.randn(4, 2) * noise for c in clean]) if n else np.zeros((0, 4, 2))
    return points.astype(np.float32), directions


def noise_floor(points: np.ndarray) -> float:
    """MSE of the perfect-corner predictor on the last two points: each target against the
    corner of ``[-1, 1]²`` nearest to it (for σ = 0.1 always its true corner)."""
    target = points[:, 2:].astype(np.float64)
    return float(np.mean((target - np.sign(target)) ** 2))


def load_sequences(path: str | pathlib.Path) -> np.ndarray:
    """Sequences from a ``.npy`` file or a ``.csv`` file, as float32 ``[n, 4, 2]``.

    A ``.csv`` holds one sequence per row: ``x0, y0, x1, y1, x2, y2, x3, y3`` (a header line
    is allowed). Raises ValueError naming the file and what was expected.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "no such file"
        raise ValueError(f"--data {path}: {what}; expected a .npy or .csv file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            data = read_numbers(path)
        elif suffix == ".csv":
            with path.open() as f:
                header = not is_number(f.readline().split(",")[0])
            data = read_numbers(path, skiprows=int(header))
            if data.shape[1:] == (8,):
                data = data.reshape(-1, 4, 2)
        else:
            raise ValueError(f"--data {path}: expected a .npy or .csv file, got {suffix or 'no suffix'!r}")
    except (OSError, ValueError) as err:
        if str(err).startswith("--data"):
            raise
        raise ValueError(f"--data {path}: could not read it as {suffix}: {err}") from err
    if not np.issubdtype(data.dtype, np.number):
        raise ValueError(f"--data {path}: expected numbers, got dtype {data.dtype}")
    if data.ndim != 3 or data.shape[1:] != (4, 2) or len(data) < 2:
        want = "8 columns per row" if suffix == ".csv" else "shape [n, 4, 2]"
        raise ValueError(
            f"--data {path}: expected {want} with n >= 2 (four 2-D points per sequence), got shape {list(data.shape)}"
        )
    if not np.isfinite(data).all():
        raise ValueError(f"--data {path}: contains NaN or infinite values")
    return data.astype(np.float32)


def split(points: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)``: the first two points and the last two, as tensors."""
    t = torch.from_numpy(np.ascontiguousarray(points, dtype=np.float32))
    return t[:, :2], t[:, 2:]


def decoder_input(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: the last source point, then the target shifted right by one."""
    return torch.cat([source[:, -1:], target[:, :-1]], dim=1)


def load_data(cfg: Config) -> tuple[np.ndarray, np.ndarray, str]:
    """``(train, test, description)``: the generated sets, or ``cfg.data`` split 2/3 : 1/3
    after a fixed shuffle."""
    if cfg.data is None:
        train, _ = square_sequences(N_TRAIN, TRAIN_SEED)
        test, _ = square_sequences(N_TEST, TEST_SEED)
        return (
            train,
            test,
            (
                f"generated square corners, noise σ={NOISE}: train {N_TRAIN} "
                f"(seed {TRAIN_SEED}), test {N_TEST} (seed {TEST_SEED})"
            ),
        )
    data = load_sequences(cfg.data)
    perm = np.random.RandomState(TEST_SEED).permutation(len(data))
    n_test = max(1, len(data) // 3)
    return (
        data[perm[n_test:]],
        data[perm[:n_test]],
        f"{cfg.data}: {len(data)} sequences, train {len(data) - n_test}, test {n_test} (fixed shuffle)",
    )
