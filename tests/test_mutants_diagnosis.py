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
