"""Behaviours that mutation testing (``make mutate``) found unpinned, each pinned here by a test
that the mutant it names fails: validation at the public entry of two transforms, the second
centering of the rounding-sensitivity pass, the streamed path of ``assert_equivalent`` on
checkpoint folders, the generated checkers' docstrings, and four figures of the diagnosis."""

import pytest
import torch

import circuitmath as cm
from circuitmath._errors import StateDictError

LN = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)


# -- bad input to a transform is refused at its entry, naming the tensor ----------------------


def _centered_lnpre():
    sd = cm.random_state_dict(LN, seed=0, dtype=torch.float64)
    return cm.process_weights(sd, LN)


def _shortformer():
    cfg = LN.replace(positional_embedding_type="shortformer")
    return cm.random_state_dict(cfg, seed=0, dtype=torch.float64), cfg


def _extra_key(sd, name):
    return dict(sd, extra=torch.zeros(3, dtype=torch.float64)), "extra"


def _nan(sd, name):
    broken = sd[name].clone()
    broken.view(-1)[0] = float("nan")
    return dict(sd, **{name: broken}), name


def _mixed_dtypes(sd, name):
    return dict(sd, **{name: sd[name].float()}), name


def _wrong_shape(sd, name):
    return dict(sd, **{name: sd[name][..., :-1]}), name


@pytest.mark.parametrize("transform, model", [
    (cm.layer_norm_to_rms_norm, _centered_lnpre), (cm.shortformer_to_tables, _shortformer),
], ids=["layer_norm_to_rms_norm", "shortformer_to_tables"])
@pytest.mark.parametrize("spoil", [_extra_key, _nan, _mixed_dtypes, _wrong_shape])
@pytest.mark.parametrize("name", ["blocks.1.attn.W_V", "unembed.W_U"])
def test_a_transform_refuses_bad_weights_naming_them(transform, model, spoil, name):
    sd, cfg = model()
    transform(sd, cfg)  # control: the unspoilt model is accepted
    spoilt, named = spoil(sd, name)
    with pytest.raises(StateDictError, match=named.replace(".", r"\.")):
        transform(spoilt, cfg)


# -- the rounding-sensitivity pass centers twice, then shifts along 1 by 2 u mean|x| -----------


def test_the_nudged_centering_removes_the_first_means_rounding_and_shifts_by_its_bound():
    """``x - mean(x)`` in float32 of entries near 1000 keeps a mean of about ``eps * 1000``; the
    second centering removes it (a mean left of order ``eps``). Then the shift along 1 is
    ``± 2 u mean|x|`` per position, the sign drawn per position."""
    from circuitmath._compare import _rounded_centering

    generator = torch.Generator().manual_seed(0)
    x = 1000 + torch.randn(3, 5, 64, generator=generator)
    eps = torch.finfo(torch.float32).eps
    once = x - x.mean(-1, keepdim=True)
    assert float(once.mean(-1).abs().max()) > 100 * eps  # the first mean's rounding is there to remove
    centered = _rounded_centering(0.0)("blocks.0.ln1", x)
    assert float(centered.mean(-1).abs().max()) <= 4 * eps
    u = 1e-3
    shifted = _rounded_centering(u)("blocks.0.ln1", x)
    shift = (shifted - centered).mean(-1)
    assert torch.allclose(shift.abs(), 2 * u * x.abs().mean(-1), rtol=1e-4)
    assert bool((shift > 0).any()) and bool((shift < 0).any())


# -- assert_equivalent checks checkpoint folders a block at a time ----------------------------


@pytest.mark.parametrize("opened", [False, True], ids=["paths", "opened"])
def test_assert_equivalent_streams_two_checkpoint_folders_and_loads_neither_whole(tmp_path, monkeypatch, opened):
    from circuitmath import _checkpoint, _streaming_check_processed, io
    from circuitmath.testing import NotEquivalentError, assert_equivalent

    sd = cm.random_state_dict(LN, seed=0)
    io.save(tmp_path / "m.safetensors", sd, LN)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "before", steps=[])
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "after", steps="applicable")
    streamed, check_processed = [], _streaming_check_processed.check_processed

    def spied(*args, **kwargs):
        streamed.append(args[:2])
        return check_processed(*args, **kwargs)

    def whole(self):
        raise AssertionError(f"{self.path} loaded whole")

    monkeypatch.setattr(_streaming_check_processed, "check_processed", spied)
    monkeypatch.setattr(_checkpoint.Checkpoint, "load", whole)
    before, after = tmp_path / "before", tmp_path / "after"
    if opened:
        before, after = io.open_checkpoint(before), io.open_checkpoint(after)
    tokens = torch.randint(0, LN.d_vocab, (2, LN.n_ctx), generator=torch.Generator().manual_seed(0))
    assert assert_equivalent(before, after, tokens=tokens).passed
    assert len(streamed) == 1
    # negative control: a processing changed by 10 % fails, streamed too
    changed, changed_cfg = cm.process_weights(sd, LN)
    changed["blocks.1.mlp.W_in"] = changed["blocks.1.mlp.W_in"] * 1.1
    with _checkpoint.CheckpointWriter(tmp_path / "changed", 1) as out:
        out.write(changed, changed_cfg)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(before, tmp_path / "changed", tokens=tokens)
    assert len(streamed) == 2


def test_a_checkpoint_folder_against_a_state_dict_is_bad_input_naming_the_folder(tmp_path):
    from circuitmath import io
    from circuitmath.testing import assert_equivalent

    sd = cm.random_state_dict(LN, seed=0)
    io.save(tmp_path / "m.safetensors", sd, LN)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "after", steps="applicable")
    for pair in ((sd, tmp_path / "after"), (tmp_path / "after", sd)):
        with pytest.raises(cm.CircuitMathError, match=r"checkpoint folder .*after, the other model is a dict"):
            assert_equivalent(*pair, LN)
    loaded, loaded_cfg = io.open_checkpoint(tmp_path / "after").load()  # what the message says to do
    assert assert_equivalent(sd, loaded, LN, after_cfg=loaded_cfg).passed


# -- the generated checkers say what they check ------------------------------------------------


def _checked_identities():
    from circuitmath import testing

    return [(cm.get_identity(name), check, getattr(testing, f"assert_{cm.get_identity(name).function}"))
            for name, check in testing.CHECKERS.items()]


def test_each_generated_checker_says_what_it_checks_and_how():
    """``check_<function>``: its first sentence names the transform and, for a note that goes on
    the sentence (lower case), the note in parentheses; a note that is a sentence of its own
    (upper case) is a paragraph; then the identity's name and summary. ``assert_<function>``
    names its ``check_``."""
    forms = set()
    for identity, check, assert_ in _checked_identities():
        first, *rest = check.__doc__.split("\n\n")
        assert first.startswith(f"Check ``after`` against :func:`circuitmath.{identity.function}` of ``before``")
        assert first.rstrip().endswith("see :func:`check_identity`).") or rest[0].endswith("See :func:`check_identity`.")
        note = identity.check_note
        if note and note[0].islower():
            assert f"({note}; see :func:`check_identity`)." in first, check.__doc__
            forms.add("clause")
        elif note:
            assert rest[0] == f"{note} See :func:`check_identity`.", check.__doc__
            forms.add("paragraph")
        else:
            assert first.endswith("(see :func:`check_identity`).")
            forms.add("none")
        assert rest[-1] == f"The identity is ``{identity.name}``: {identity.summary}."
        assert check.__name__ == f"check_{identity.function}"
        assert f":func:`check_{identity.function}`" in assert_.__doc__ and assert_.__name__ == f"assert_{identity.function}"
    assert forms == {"clause", "paragraph", "none"}  # each form is seen


# -- the diagnosis -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1e-3, 1e3])
def test_a_rotation_is_recognised_whatever_the_size_of_the_embeddings(size):
    """The rotation is recognised where ``W_E`` kept its row norms up to a tolerance relative to
    the largest norm: embeddings of norm about 1000 (or 0.001), rotated in float32, keep theirs to
    about ``eps * 1000`` (``eps * 0.001``)."""
    from circuitmath._processing.rotation import random_orthogonal

    cfg = LN.replace(normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0)
    sd = dict(sd, **{n: sd[n] * size for n in ("embed.W_E", "pos_embed.W_pos")})
    rotated, _ = cm.rotate_residual_stream(sd, cfg, random_orthogonal(cfg.d_model, seed=3, dtype=torch.float32))
    found = cm.testing.diagnose(sd, rotated, cfg)
    assert found.ok and found.replayed[-1:] == ("rotate_residual_stream",), str(found)


def test_relative_errors_are_over_the_largest_entry():
    from circuitmath._diagnosis._tensors import _relative_difference

    a, b = torch.tensor([100.0, 0.0, -3.0]), torch.tensor([105.0, 0.0, -3.0])
    assert _relative_difference(a, b) == (5.0, 5.0 / 105.0)
    assert _relative_difference(a, b, reference=torch.tensor([-1000.0])) == (5.0, 5.0 / 1000.0)
    assert _relative_difference(a, a.clone()) == (0.0, 0.0)


def test_a_mistake_hidden_under_a_later_step_is_blamed_on_its_step_and_tensors():
    """Value biases folded without W_O, then the writers centered (b_O centered again): the
    diagnosis tries each step's wrong rewrites followed by the rest of the replay, from the
    state and config before that step, and blames the value-bias fold, and only the tensors it
    touched."""
    from blame_corpus import corpus

    bug = next(b for b in corpus() if b.name == "value biases folded without W_O, then the writers centred")
    before, after, after_cfg = bug.outputs()
    found = cm.testing.diagnose(before, after, bug.cfg, after_cfg=after_cfg)
    assert not found.ok
    assert {p.name for p in found.culprits()} == set(bug.touched()), str(found)
    assert [f.name for f in found.violations if f.kind == "identity"] == ["fold_value_biases"], str(found)


# -- folding a gain stored as w and applied as 1 + w (Gemma) -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_gain_applied_as_one_plus_w_is_folded_as_one_plus_w_rounded_once(dtype):
    """``(1 + w)[:, None] * W`` computed in float64 and rounded once: with ``w`` about ``1e-3``, a
    ``1 + w`` rounded to bfloat16 first (or ``1 - w``) gives other bits."""
    cfg = LN.replace(normalization_type="RMS", norm_gain_offset=1.0)
    sd = cm.random_state_dict(cfg, seed=0, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    sd = dict(sd, **{n: (1e-3 * torch.randn(cfg.d_model, generator=generator, dtype=torch.float64)).to(dtype)
                     for n in sd if n.endswith(".w")})
    folded, _ = cm.fold_rms_norm(sd, cfg)
    W, w = sd["blocks.1.attn.W_Q"], sd["blocks.1.ln1.w"]
    expected = (W.double() * (1 + w.double())[:, None]).to(dtype)
    assert torch.equal(folded["blocks.1.attn.W_Q"], expected)


def test_default_tokens_take_at_most_32_positions_from_a_fixed_seed():
    from circuitmath.testing import default_tokens

    long = LN.replace(n_ctx=40)
    assert default_tokens(long).shape == (2, 32) and default_tokens(LN, batch=3).shape == (3, LN.n_ctx)
    assert torch.equal(default_tokens(long), default_tokens(long)) and int(default_tokens(long).max()) < LN.d_vocab
    assert not torch.equal(default_tokens(long), default_tokens(long, seed=1))


@pytest.mark.parametrize("sign", [1, -1])
def test_a_rotation_mapping_the_ones_to_plus_or_minus_the_ones_is_told_from_one_that_does_not(sign):
    """The diagnosis snaps a recovered LNPre rotation to ``Q 1 = ±1`` exactly only when it
    recognises one: both signs are recognised, a general rotation is not."""
    from circuitmath._identities._residual_fit import fixes_ones
    from circuitmath._processing.rotation import orthogonal_fixing_ones, random_orthogonal

    assert fixes_ones(sign * orthogonal_fixing_ones(12, seed=3))
    assert not fixes_ones(sign * random_orthogonal(12, seed=3))


def test_a_diagnosis_s_findings_are_values_a_caller_cannot_change():
    """A :class:`~circuitmath.testing.Finding` is frozen: a caller that keeps one (in a set, as
    a key) holds what the check found, and cannot rewrite it."""
    import dataclasses

    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=0)
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg)
    finding = cm.testing.diagnose(sd, folded, cfg).findings[0]
    assert {finding: 1}[finding] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.kind = "model"


def test_a_record_naming_no_registered_identity_is_said_and_the_replay_inferred():
    import dataclasses

    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=0)
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg)
    own = dataclasses.replace(folded_cfg, applied=folded_cfg.applied + ("my_own_step",))
    found = cm.testing.diagnose(sd, folded, cfg, after_cfg=own)
    assert found.ok and found.replayed == ("fold_layer_norm",), str(found)
    assert any("['my_own_step'], which are no registered identities" in note for note in found.notes), found.notes
    # control: a record of registered identities is replayed as recorded, and said so
    assert any("replaying the identities recorded" in note
               for note in cm.testing.diagnose(sd, folded, cfg, after_cfg=folded_cfg).notes)


def test_a_missing_file_is_bad_input_naming_it(tmp_path):
    missing = tmp_path / "model.safetensors"
    with pytest.raises(StateDictError, match=f"{missing}: no such file or folder"):
        cm.testing.check_model(missing)
