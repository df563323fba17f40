"""What the chapters share: showing what :mod:`circuitmath.render` writes, failing the build
when a proof or a numeric check does not come out as claimed, and tables of numeric checks."""

from __future__ import annotations

from IPython.display import Markdown, display

from circuitmath import render


def show(markdown: str) -> None:
    display(Markdown(markdown))


def show_statement(identity, proof=None) -> None:
    show(render.statement(identity, proof))


def show_definitions(identity_or_proof) -> None:
    show(render.definitions(identity_or_proof))


def show_derivation(identity_or_proof) -> None:
    show(render.derivation(identity_or_proof))


def show_steps(report) -> None:
    show(render.steps(report))


def show_twins(report, identity_or_proof=None) -> None:
    show(render.twins(report, identity_or_proof))


def show_report(report, identity_or_proof) -> None:
    """The steps table, then the negative twins under their own heading."""
    show("\n".join([render.steps(report), "", "### Negative twins", "", render.twins(report, identity_or_proof)]))


def check(report, *, symbolic: bool = True):
    """Print the report's summary and fail the build unless the claim is proved (for symbolic
    sizes unless ``symbolic=False``), every step holds, and every negative twin is rejected by a
    counterexample."""
    print(render.summary(report))
    assert report.ok and report.concrete_check, report.as_dict()
    assert report.symbolic_dims or not symbolic, f"{report.name}: not proved for symbolic sizes"
    assert all(step.holds for step in report.steps)
    assert report.twins, "an identity needs at least one negative twin"
    for twin in report.twins:
        assert twin.rejected and twin.counterexample_gap, f"negative twin {twin.name} was not rejected"
    return report


def prove(identity):
    """Run the identity's proof and :func:`check` it."""
    return check(identity.prove(), symbolic=not identity.proof.explicit_only)


def numeric_checks(identities, models, seeds=range(2)) -> list[tuple]:
    """Each identity's check and corruptions on each model and seed; asserts the verdicts.

    ``models`` maps a label to ``(cfg, dtype)``. Returns rows ``(identity, what, label, dtype,
    max error, tolerance, passed)`` for :func:`show_numeric_checks`.
    """
    import circuitmath as cm

    rows = []
    for identity in identities:
        for label, (cfg, dtype) in models.items():
            for seed in seeds:
                state_dict = cm.random_state_dict(cfg, seed=seed, dtype=dtype)
                result = identity.check(state_dict, cfg)
                assert result.passed, (identity.name, label, seed, result)
                rows.append((identity.name, "the identity's computation", label, dtype, result))
                for corruption in identity.corruptions:
                    wrong = identity.check_corruption(corruption, state_dict, cfg)
                    assert not wrong.passed, (identity.name, corruption, label, seed, wrong)
                    rows.append((identity.name, corruption, label, dtype, wrong))
    return rows


def show_numeric_checks(rows) -> None:
    merged: dict = {}
    for name, what, label, dtype, result in rows:
        merged.setdefault((name, what, label, dtype), []).append(result)
    lines = ["| identity | computation | model | dtype | largest error | smallest tolerance | passed |",
             "|---|---|---|---|---|---|---|"]
    for (name, what, label, dtype), results in merged.items():
        lines.append(
            f"| `{name}` | {render.md_text(what)} | {label} | `{str(dtype).removeprefix('torch.')}`"
            f" | {max(r.max_abs_error for r in results):.3g} | {min(r.tolerance for r in results):.3g}"
            f" | {sum(r.passed for r in results)} of {len(results)} |"
        )
    display(Markdown("\n".join(lines)))
