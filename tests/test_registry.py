"""Every registered identity has a proof, negative twins, a numeric check and wrong transforms."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import circuitmath as cm

IDENTITIES = cm.identities()
NAMES = [i.name for i in IDENTITIES]
BASE_FIELDS = dict(n_layers=1, d_model=4, n_heads=1, d_head=4, d_vocab=5, n_ctx=3, d_mlp=None)


def test_registry_is_not_empty_and_names_are_unique():
    assert {"fold_layer_norm", "center_reading_weights"} <= set(NAMES)
    assert len(NAMES) == len(set(NAMES))


#: Identities of matrices that hold whatever the model: their preconditions say none.
PURE_LINEAR_ALGEBRA = {"kronecker_vec"}


def test_pure_linear_algebra_identities_list_no_model_preconditions():
    from circuitmath import render

    for name in PURE_LINEAR_ALGEBRA:
        identity = cm.get_identity(name)
        assert identity.preconditions == ()
        assert "**Preconditions**:\n\n- none" in render.statement(identity)
    assert "- none" not in render.statement(cm.get_identity("fold_layer_norm")).split("**Assumptions**")[0]


@pytest.mark.parametrize("identity", IDENTITIES, ids=NAMES)
def test_identity_is_complete(identity):
    assert identity.summary and identity.title
    # a weight transform states when it applies; an identity of matrices alone may have no condition
    assert identity.preconditions or (identity.compare is not None and identity.name in PURE_LINEAR_ALGEBRA)
    # what a numeric check needs of its model is no place for a transform's conditions
    assert not identity.check_requires or identity.name in PURE_LINEAR_ALGEBRA
    assert identity.proof.steps, "a proof needs at least one step"
    assert identity.proof.twins, "every proof needs at least one negative twin"
    assert any(w.differs_on is None and not w.regardless for w in identity.wrong_rewrites.values()), \
        "every numeric check needs a wrong rewrite it must reject on every model"
    assert callable(identity.transform)


@pytest.mark.parametrize("identity", IDENTITIES, ids=NAMES)
def test_proof_holds_and_every_twin_is_rejected(identity):
    report = identity.prove()
    assert report.proved, [s for s in report.steps if not s.holds]
    assert all(step.holds for step in report.steps)
    assert report.concrete_check
    # a report that left twins out would pass the loop below and report.ok alike
    assert [t.name for t in report.twins] == [t.name for t in identity.proof.twins]
    for twin in report.twins:
        assert twin.rejected, f"twin {twin.name} was not rejected: {twin}"
        assert twin.counterexample_gap and twin.counterexample_gap > 0
    assert report.ok


@pytest.mark.parametrize("name", ["fold_layer_norm", "center_reading_weights"])
def test_weight_processing_proofs_use_symbolic_dimensions(name):
    assert cm.get_identity(name).proof.symbolic_dims


def test_unknown_identity_is_a_clear_error():
    with pytest.raises(KeyError, match="no identity named 'nope'"):
        cm.get_identity("nope")


def test_the_wrong_rewrites_are_one_catalogue():
    """The diagnosis keeps no list of its own: the wrong rewrites it tries are the registry's."""
    from circuitmath import _diagnosis

    assert not hasattr(_diagnosis, "MISTAKES") and not hasattr(_diagnosis, "REGARDLESS")
    fold = cm.get_identity("fold_layer_norm").wrong_rewrites
    assert {"scale_columns", "bias_through_transpose"} <= set(fold)
    assert fold["scale_columns"].differs_on(cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=4, d_vocab=5, n_ctx=3, d_mlp=8))
    for name in ("center_reading_weights", "center_writing_weights"):
        assert cm.get_identity(name).wrong_rewrites["regardless"].regardless
    assert cm.get_identity("fold_layer_norm").describe("scale_columns").startswith("scale the reader's columns")



def test_negative_control_the_diagnosis_names_a_wrong_rewrite_only_from_the_registry(monkeypatch):
    """Emptied from center_unembed's catalogue, its wrong rewrite over d_model is named no more:
    the diagnosis has no other list of mistakes to find it in."""
    from types import MappingProxyType

    from circuitmath.testing import diagnose

    cfg = cm.Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12)
    before = cm.random_state_dict(cfg, seed=1, dtype=torch.float64)
    after = dict(before, **{"unembed.W_U": before["unembed.W_U"] - before["unembed.W_U"].mean(dim=0, keepdim=True)})

    def rewrites():
        return {f.rewrite for f in diagnose(before, after, cfg).findings if f.kind == "identity"}

    assert "center_unembed.over_d_model" in rewrites()
    identity = cm.get_identity("center_unembed")
    monkeypatch.setitem(identity.__dict__, "wrong_rewrites", MappingProxyType({}))
    assert not any(r and r.startswith("center_unembed.") for r in rewrites())

def test_prove_json_lists_each_proofs_axioms(capsys):
    from circuitmath import _cli

    assert _cli.main(["prove", "remove_key_biases", "kronecker_vec", "fold_layer_norm", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    # what LN(x) and LNPre(x) stand for is assumed, and said: a definition may only name a fresh symbol
    assert {a["text"] for a in rows["fold_layer_norm"]["axioms"]} >= {"LNPre, then gain and bias"}
    key_bias = [a["text"] for a in rows["remove_key_biases"]["assumptions"] if a["kind"] not in ("value", "stated")]
    assert key_bias and all("positive" in text for text in key_bias)  # invertibility only: the row sums are proved
    for row in rows.values():
        assert all(set(a) == {"latex", "text"} for a in row["axioms"])
        assert all(set(a) == {"kind", "latex", "text"} for a in row["assumptions"])
        assert len(row["instances"]) == 2 and row["reasons"] == []


@pytest.mark.parametrize("identity", IDENTITIES, ids=NAMES)
def test_every_step_agrees_on_two_instances_of_distinct_sizes(identity):
    report = identity.prove()
    assert all(step.instances_agree for step in report.steps)
    first, second = report.instances
    assert all(first[d] != second[d] for d in first)
    assert len(set(first.values())) == len(first), "two dimensions of the same size hide transposes"


def test_row_sums_are_proved_not_assumed():
    """The crux of fold_value_biases (A 1 = 1) and remove_key_biases (the row sums scale alike)
    follows from the softmax definitions; what remains assumed is that the sums are positive (and
    what the claim's symbols stand for: the patterns as softmaxes), no fact about a product."""
    for name in ("fold_value_biases", "remove_key_biases", "process_weights"):
        proof = cm.get_identity(name).proof
        assert all(f.invertible_matrix is not None or f.fixes is not None for f in proof.facts), name


def test_eigenvalue_proof_needs_its_nonzero_hypotheses():
    import dataclasses

    proof = cm.get_identity("eigenvalues_ab_ba").proof
    assert {h.text.split(" ")[0] for h in proof.nonzero} >= {"λ", "v", "B"}
    without_lambda = dataclasses.replace(proof, nonzero=tuple(h for h in proof.nonzero if not h.text.startswith("λ")))
    assert not without_lambda.verify().proved  # B v != 0 is no longer derived


def test_svd_proof_uses_its_orthonormality_facts():
    import dataclasses

    proof = cm.get_identity("factored_svd").proof
    name, lemma = proof.lemmas[0]
    broken = dataclasses.replace(proof, lemmas=((name, dataclasses.replace(lemma, facts=lemma.facts[:1])),))
    assert not broken.verify().proved


def test_an_identity_is_found_by_its_public_function_name_too():
    for identity in IDENTITIES:
        if identity.function and identity.name != "centering_projection":
            assert cm.get_identity(identity.function) is identity


def test_one_name_per_identity_and_its_transform():
    """Registry, function and checker share a name; only an identity that shares another's
    transform (centering_projection is center_writing_weights) is named apart."""
    for identity in IDENTITIES:
        if identity.function and identity.function != identity.name:
            assert cm.get_identity(identity.function).name == identity.function, identity.name


def test_a_former_name_still_finds_its_identity_with_a_warning_and_is_normalised_in_applied():
    """The one table of former names (``_config.FORMER_NAMES``) names registered identities only."""
    from circuitmath._config import FORMER_NAMES

    names = {identity.name for identity in IDENTITIES}
    assert FORMER_NAMES["layer_norm_fold"] == "fold_layer_norm" and len(FORMER_NAMES) >= 6
    assert set(FORMER_NAMES.values()) <= names and not set(FORMER_NAMES) & names
    for old, new in FORMER_NAMES.items():
        with pytest.warns(DeprecationWarning, match=new):
            assert cm.get_identity(old) is cm.get_identity(new)
    cfg = cm.Config.from_json(cm.Config(**BASE_FIELDS, applied=["layer_norm_fold", "center_reading_weights"]).to_json())
    assert cfg.applied == ("fold_layer_norm", "center_reading_weights")
    assert cm.Config(**BASE_FIELDS, applied=("rms_norm_fold",)).applied == ("fold_rms_norm",)


def test_a_weight_identity_is_named_once_by_its_public_transform():
    """A weight identity's name is its public transform's, read from the transform (written once);
    the transform records exactly that name, and an identity whose transform is private needs one."""
    for identity in IDENTITIES:
        if identity.public is not None and identity.public.identity == identity.name:
            assert identity.function == identity.public.__name__ == identity.name
    sd, cfg = cm.random_state_dict(cm.Config(**BASE_FIELDS), seed=0), cm.Config(**BASE_FIELDS)
    assert cm.center_unembed(sd, cfg)[1].applied == (cm.get_identity("center_unembed").name,)
    with pytest.raises(ValueError, match="needs a name"):
        cm.Identity(title="t", summary="s", preconditions=(), build_proof=lambda: None,
                    transform=lambda state_dict, cfg: (state_dict, cfg))


def test_the_static_checker_names_are_the_registry_s():
    """``circuitmath.testing`` defines its ``check_``/``assert_`` names statically; they are exactly
    one pair per checker the registry derives, each bound to that checker."""
    from circuitmath import testing

    derived = {f"check_{cm.get_identity(name).function}": checker for name, checker in testing.CHECKERS.items()}
    static = {n for n in testing.__all__ if n.startswith(("check_", "assert_"))} - {"check_model", "check_identity",
                                                                                   "assert_equivalent"}
    assert static == set(derived) | {n.replace("check_", "assert_", 1) for n in derived}
    for name, checker in derived.items():
        assert getattr(testing, name) is checker
        assert getattr(testing, name.replace("check_", "assert_", 1)).__name__ == name.replace("check_", "assert_", 1)


def test_a_file_saved_with_former_names_loads_with_the_new_ones(tmp_path):
    """A safetensors file whose stored config records ``layer_norm_fold`` (saved before the rename)."""
    from safetensors.torch import save_file

    from circuitmath import io

    cfg = cm.Config(**BASE_FIELDS, normalization_type="LNPre")
    old = {**cfg.to_dict(), "applied": ["layer_norm_fold", "center_reading_weights"]}
    path = tmp_path / "old.safetensors"
    save_file(cm.random_state_dict(cfg, seed=0), str(path), metadata={io.CONFIG_KEY: json.dumps(old)})
    _state_dict, loaded = io.load(path)
    assert loaded.applied == ("fold_layer_norm", "center_reading_weights")
    unfolded = loaded.replace(normalization_type="LN")
    with pytest.raises(cm.AlreadyAppliedError):  # the old record still guards against a second fold
        cm.fold_layer_norm(cm.random_state_dict(unfolded, seed=0), unfolded)


#: Identities whose chapter has no section on them yet: each must gain one (an entry that has its
#: section fails the check below, so this set only shrinks).
PENDING_SECTIONS: set[str] = set()

BOOK = Path(__file__).resolve().parents[1] / "book"


def _section_of(identity) -> bool:
    """Whether ``identity``'s chapter names it in its source (its section states, proves or checks it)."""
    path = BOOK / f"{identity.chapter}.md"
    return path.exists() and re.search(rf"\b{identity.name}\b", path.read_text()) is not None


def test_the_book_lists_every_identity_with_its_chapter():
    """The book's list of identities (``render.identity_list``, shown in ``checking.md``) is the
    registry's; each identity links to an existing chapter that has a section on it."""
    from circuitmath.render import identity_list

    listed = identity_list(IDENTITIES)
    assert "identity_list(cm.identities())" in (BOOK / "checking.md").read_text()
    for identity in IDENTITIES:
        assert f"[`{identity.name}`]({identity.chapter}.md)" in listed, identity.name
        assert (BOOK / f"{identity.chapter}.md").exists(), (identity.name, identity.chapter)
    missing = {identity.name for identity in IDENTITIES if not _section_of(identity)}
    assert missing == PENDING_SECTIONS, f"no section in their chapter: {sorted(missing - PENDING_SECTIONS)}; " \
                                        f"sections now written: {sorted(PENDING_SECTIONS - missing)}"


def test_negative_control_an_identity_of_a_chapter_without_its_section_is_caught():
    fold = cm.get_identity("fold_layer_norm")
    assert _section_of(fold)
    elsewhere = next(path.stem for path in sorted(BOOK.glob("*.md")) if "fold_layer_norm" not in path.read_text())
    assert not _section_of(dataclasses.replace(fold, chapter=elsewhere))
    assert not _section_of(dataclasses.replace(fold, chapter="no_such_chapter"))
