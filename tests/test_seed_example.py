"""The seeds' worked example, checked against the values computed by hand in the tutorials."""

from __future__ import annotations

import math

import torch

import addnorm

X = [[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]


def hand_layer_norm(rows, eps):
    """The tutorial's hand computation, in plain Python floats."""
    out = []
    for row in rows:
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        out.append([(v - mean) / math.sqrt(var + eps) for v in row])
    return out


def test_worked_example_eps_1e5_matches_seed(backend):
    y = addnorm.layer_norm(torch.tensor(X), 3, eps=1e-5, backend=backend)
    seed = torch.tensor([[0.0, -1.2238, 1.2238], [1.4140, -0.7070, -0.7070]])
    torch.testing.assert_close(y, seed, atol=1e-4, rtol=0)
    torch.testing.assert_close(y, torch.tensor(hand_layer_norm(X, 1e-5)))


def test_worked_example_eps_0_is_the_hand_computed_1_2247(backend):
    y = addnorm.layer_norm(torch.tensor(X, dtype=torch.float64), 3, eps=0.0, backend=backend)
    assert abs(y[0, 2].item() - 1.2247) < 1e-4  # sqrt(3/2): the seeds' hand computation
    torch.testing.assert_close(y, torch.tensor(hand_layer_norm(X, 0.0), dtype=torch.float64))


def test_seed_sbe_layout_normalized_over_last_two_dims(backend):
    """Seed 001 reshapes [B,S,E] = [1,2,3] to [S,B,E] and normalizes over [B,E]."""
    inp = torch.tensor([X]).reshape(2, 1, 3)
    gamma = torch.ones(1, 3)
    beta = torch.zeros(1, 3)
    y = addnorm.layer_norm(inp, inp.shape[-2:], gamma, beta, backend=backend)
    expected = torch.tensor(hand_layer_norm(X, 1e-5)).reshape(2, 1, 3)
    torch.testing.assert_close(y, expected)
    assert y.shape == (2, 1, 3)


def test_output_rows_have_mean_0_and_std_1():
    y = addnorm.layer_norm(torch.tensor(X, dtype=torch.float64), 3, eps=0.0)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(y.std(-1, unbiased=False), torch.ones(2, dtype=torch.float64))
