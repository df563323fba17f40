"""What several test modules share (on the path through ``pythonpath`` in pyproject.toml)."""

import torch

# Sizeable biases, and weights small enough that no softmax saturates: a saturated softmax is
# one-hot whatever its scores, so it hides a wrong change of the scores (post-norm models read
# the raw embeddings, whose outlier dimensions would otherwise give scores in the hundreds).
DISCRIMINATING_WEIGHTS = dict(min_bias_scale=0.5, max_gain_spread=0.3, max_outlier_scale=3.0)


def snapshot(state_dict):
    """A copy of every tensor, to show later that a transform left its input alone."""
    return {k: v.clone() for k, v in state_dict.items()}


def same(a, b):
    """Same names, dtypes and every entry equal."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
