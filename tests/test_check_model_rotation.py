"""``check MODEL`` rotates the residual stream by a structured ``Q`` (a random permutation times
orthogonal blocks of 16 coordinates, :func:`~circuitmath._identities.rotation.check_rotation`):
what a rotation gets wrong is caught as a dense ``Q`` catches it.

A gain ``diag(w)`` left between the norm and the rotation commutes with ``Q`` only where ``w`` is
constant on each set of 16 coordinates one block mixes (every entry of a block is nonzero): a
gain that differs in one coordinate, or in every coordinate, is mixed with another gain with
certainty, whatever the seed. On these models the rows are violated in float32 and float64; the
exact rotations, and the same wrong rotation through a uniform gain (which commutes with every
``Q``), hold."""

import pytest
import torch

import circuitmath as cm
from circuitmath import _diagnosis as diagnosis_module
from circuitmath._identities.rotation import check_rotation
from circuitmath._processing.rotation import rotated_tensors
from support import Identity, with_identities

D_MODEL = 48  # three blocks of 16
TOKENS = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


def _config(norm: str) -> cm.Config:
    return cm.Config(n_layers=2, d_model=D_MODEL, n_heads=4, d_head=12, d_vocab=50, n_ctx=16, d_mlp=64,
                     normalization_type=norm)


def _model(norm: str, dtype: torch.dtype, gain=None) -> tuple[dict, cm.Config]:
    """A random ``norm`` model; ``gain(name)`` sets every norm's gain (default: random, all distinct)."""
    cfg = _config(norm)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    for name in sd:
        if gain is not None and name.endswith(".w"):
            sd[name] = gain(name).double()
    return {k: v.to(dtype) for k, v in sd.items()}, cfg


def _rotated_through_the_norm(fixing_ones: bool):
    """Rotate every writer and reader by the check rotation, the norms' gains and biases left
    where they are (what ``rotate_residual_stream`` refuses to do)."""
    def rotate_unfolded(sd, cfg):
        return dict(sd) | rotated_tensors(sd, cfg, check_rotation(cfg, fixing_ones=fixing_ones)), cfg
    return rotate_unfolded


def _statuses(monkeypatch, sd, cfg, *identities) -> list[str]:
    with_identities(monkeypatch, *identities)
    return [f.status for f in diagnosis_module.check_model(sd, cfg, tokens=TOKENS).findings]


def _one_gain_differs(name):
    w = torch.ones(D_MODEL)
    w[7] = 1.25
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("gain", [None, _one_gain_differs], ids=["every gain distinct", "one gain differs"])
def test_a_rotation_through_an_unfolded_rms_gain_is_violated(monkeypatch, dtype, gain):
    sd, cfg = _model("RMS", dtype, gain)
    exact = cm.get_identity("rotate_residual_stream")
    wrong = Identity("rotate_residual_stream.unfolded_gain", _rotated_through_the_norm(False))
    assert _statuses(monkeypatch, sd, cfg, exact, wrong) == ["holds", "violated"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_rotation_through_a_uniform_gain_holds(monkeypatch, dtype):
    """The control: ``1.5 I`` commutes with every ``Q``, so the same rotation is exact."""
    sd, cfg = _model("RMS", dtype, lambda name: torch.full((D_MODEL,), 1.5))
    wrong = Identity("rotate_residual_stream.unfolded_gain", _rotated_through_the_norm(False))
    assert _statuses(monkeypatch, sd, cfg, wrong) == ["holds"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_layer_norm_rotated_through_its_gain_and_bias_or_by_a_q_that_moves_ones_is_violated(monkeypatch, dtype):
    """LayerNorm: rotating through its unfolded gain and bias (by a ``Q`` with ``Q 1 = 1``) is
    violated; on the folded LNPre model, a ``Q`` that moves 1 is violated and one that fixes it holds."""
    sd, cfg = _model("LN", dtype)
    exact = cm.get_identity("layer_norm_rotation")
    through = Identity("layer_norm_rotation.unfolded", _rotated_through_the_norm(True))
    moving = Identity("layer_norm_rotation.moves_ones", _rotated_through_the_norm(False), prepare=cm.fold_layer_norm)
    fixing = Identity("layer_norm_rotation.fixes_ones", _rotated_through_the_norm(True), prepare=cm.fold_layer_norm)
    assert _statuses(monkeypatch, sd, cfg, exact, through, moving, fixing) == ["holds", "violated", "violated", "holds"]
