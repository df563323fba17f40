"""Behaviours of the diagnosis that mutation testing (``make mutate``) found unpinned, each pinned
by a test that the mutant it names fails."""

import torch

import circuitmath as cm
from circuitmath.testing import diagnose

CFG = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=23, n_ctx=8, d_mlp=64)


def test_rows_past_the_ranges_shown_are_counted():
    """Nine single rows of W_out changed by 1 %: the first six ranges are shown, then how many
    more there are (three), and the count of rows that differ covers all nine."""
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float32)
    after, after_cfg = cm.process_weights(model, CFG)
    after = dict(after)
    rows = list(range(0, 18, 2))
    after["blocks.1.mlp.W_out"] = after["blocks.1.mlp.W_out"].clone()
    after["blocks.1.mlp.W_out"][rows] *= 1.01
    found = diagnose(model, after, CFG, after_cfg=after_cfg)
    (culprit,) = {p.name: p for f in found.violations for p in f.parameters}.values()
    assert culprit.rows == tuple((r, r) for r in rows)
    assert "rows 0, 2, 4, 6, 8, 10, … (3 more ranges) (9 of 64) differ" in str(culprit), str(culprit)


def test_the_rotation_made_to_fix_the_ones_direction_fixes_it_and_stays_orthogonal():
    """fixing_ones_exactly of a random orthogonal Q (Q·1 far from ±1): an orthogonal matrix that
    maps 1 to ±1 to float64 rounding, with the sign of uᵀQu; Q itself fails (the control)."""
    from circuitmath._identities._residual_fit import fixes_ones, fixing_ones_exactly

    for seed in range(3):
        Q = cm.random_orthogonal(12, seed=seed)
        assert not fixes_ones(Q)
        R = fixing_ones_exactly(Q)
        assert torch.allclose(R.T @ R, torch.eye(12, dtype=torch.float64), atol=1e-12)
        sign = 1.0 if float(Q.sum()) >= 0 else -1.0
        assert torch.allclose(R @ torch.ones(12, dtype=torch.float64), sign * torch.ones(12, dtype=torch.float64), atol=1e-12)
