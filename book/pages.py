"""What the chapters share: showing what :mod:`circuitmath.render` writes, failing the build
when a proof or a numeric check does not come out as claimed, tables of numeric checks, the
"what this chapter established" section, and one style for every figure, checked when shown."""

from __future__ import annotations

import io
import warnings

import matplotlib
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, Markdown, display

from circuitmath import render

#: Width of the book's text column in CSS pixels at a 1280 px window (sphinx-book-theme): a
#: figure at most this wide is shown at its own size, so its labels keep the size checked here.
COLUMN_PX = 680
DPI = 100
#: Smallest text in a figure, in CSS pixels as shown (9 pt at 100 dpi is 12.5 px).
MIN_TEXT_PX = 11.0
STYLE = {
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    "figure.titlesize": 11,
    "axes.grid": False,
}
matplotlib.rcParams.update(STYLE)

# Every chapter computes on small models, one at a time: a second thread only waits for the first
# on a busy machine (a small check took 4.3 s with two threads against 0.1 s with one there).
torch.set_num_threads(1)

#: Every report proved on this page, with its identity, and every numeric-check row, in order.
PROVED: list = []
NUMERIC: list = []


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


def check(report, *, symbolic: bool = True, identity=None):
    """Print the report's summary and fail the build unless the claim is proved (for symbolic
    sizes unless ``symbolic=False``), every step holds, and every negative twin is rejected by a
    counterexample. With ``identity``, the report is kept for :func:`show_established`."""
    print(render.summary(report))
    assert report.ok and report.concrete_check, report.as_dict()
    assert report.symbolic_dims or not symbolic, f"{report.name}: not proved for symbolic sizes"
    assert all(step.holds for step in report.steps)
    assert report.twins, "an identity needs at least one negative twin"
    for twin in report.twins:
        assert twin.rejected and twin.counterexample_gap, f"negative twin {twin.name} was not rejected"
    if identity is not None and all(i is not identity for _r, i in PROVED):
        PROVED.append((report, identity))
    return report


def prove(identity):
    """Run the identity's proof and :func:`check` it (kept for :func:`show_established`)."""
    return check(identity.prove(), symbolic=not identity.proof.explicit_only, identity=identity)


def numeric_checks(identities, models, seeds=range(2)) -> list[tuple]:
    """Each identity's check and wrong rewrites on each model and seed; asserts the verdicts.

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
                for wrong_name in identity.wrong_everywhere:
                    wrong = identity.check_wrong_rewrite(wrong_name, state_dict, cfg)
                    assert not wrong.passed, (identity.name, wrong_name, label, seed, wrong)
                    rows.append((identity.name, wrong_name, label, dtype, wrong))
    NUMERIC.extend(rows)
    return rows


#: What the numeric checks call a correct computation; every other name is a wrong transform.
RIGHT = ("the identity's computation", "the transform", "random N and M")


def closest(results, right: bool):
    """The result of ``results`` closest to the other verdict: for a correct computation
    (``right``) the largest error for its tolerance, for a wrong one the smallest. The table of
    numeric checks and the chapter's summary both show this one result's error and tolerance."""
    choose = max if right else min
    return choose(results, key=lambda r: r.max_abs_error / r.tolerance)


def numeric_summary(rows=None) -> list[str]:
    """One line per identity of ``rows`` (default: every numeric check on this page): how many
    checks passed, the error and tolerance of the check closest to failing (:func:`closest`),
    and the wrong transforms rejected."""
    rows = NUMERIC if rows is None else rows
    by_identity: dict = {}
    for name, what, _label, _dtype, result in rows:
        by_identity.setdefault(name, {"right": [], "wrong": []})["right" if what in RIGHT else "wrong"].append(result)
    lines = []
    for name, got in by_identity.items():
        right, wrong = got["right"], got["wrong"]
        nearest = closest(right, True)
        line = (f"`{name}`: {sum(r.passed for r in right)} of {len(right)} numeric checks pass, the worst at"
                f" {nearest.max_abs_error:.2g} against a tolerance of {nearest.tolerance:.2g}")
        if wrong:
            smallest = closest(wrong, False)
            line += (f"; {sum(not r.passed for r in wrong)} of {len(wrong)} wrong transforms rejected, the closest"
                     f" at {smallest.max_abs_error / smallest.tolerance:.3g} times its tolerance")
        lines.append(line + ".")
    return lines


def show_established(numbers=(), measured=None) -> None:
    """The body of the chapter's closing section: every identity proved on the page (see
    :func:`circuitmath.render.established`), the summary of its numeric checks (those of
    :func:`numeric_checks`, or ``measured``: ``{(identity, what, ..., dtype): [comparisons]}``)
    and ``numbers``, further results in Markdown."""
    rows = list(NUMERIC)
    if measured is not None:
        rows += [(key[0], key[1], None, key[-1], r) for key, results in measured.items() for r in results]
    show(render.established(PROVED, [*numeric_summary(rows), *numbers]))


def _colour(artist):
    """The colour a legend entry or a plotted artist shows, as an RGBA tuple (or None)."""
    from matplotlib.colors import to_rgba

    for getter in ("get_color", "get_facecolor", "get_edgecolor"):
        if hasattr(artist, getter):
            value = getattr(artist, getter)()
            try:
                if hasattr(value, "ndim") and value.ndim == 2:
                    value = value[0] if len(value) else None
                return None if value is None else tuple(round(c, 3) for c in to_rgba(value))
            except (TypeError, ValueError):
                continue
    return None


def _look(artist):
    """What tells legend entries apart: colour, line style, marker (a scatter's marker is its
    path), hatch."""
    style = getattr(artist, "get_linestyle", lambda: None)()
    marker = getattr(artist, "get_marker", lambda: None)()
    if marker is None and hasattr(artist, "get_paths") and artist.get_paths():
        marker = artist.get_paths()[0].vertices.round(3).tobytes()
    hatch = getattr(artist, "get_hatch", lambda: None)()
    return (_colour(artist), str(style), str(marker), str(hatch))


def _parts(artist):
    """The drawn artists of ``artist``: itself, or every artist of a container (an error bar's
    line, caps and bars), however nested."""
    if isinstance(artist, (matplotlib.container.Container, tuple, list)):
        return [part for child in artist for part in _parts(child)]
    return [] if artist is None else [artist]


def _threshold(line, ax) -> bool:
    """Whether ``line`` spans its axes across at one height or position (``axhline``, ``axvline``)."""
    from matplotlib.transforms import BlendedAffine2D, BlendedGenericTransform

    blended = (BlendedAffine2D, BlendedGenericTransform)
    transform = line.get_transform()
    parts = [transform, getattr(transform, "_a", None), getattr(transform, "_b", None)]
    return any(isinstance(part, blended) for part in parts)


def _marks(ax):
    """Where the data of ``ax`` is drawn, as display boxes: every marker or vertex of a plotted
    line (not a threshold spanning the axes), every scatter point and every bar."""
    import numpy as np
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import Bbox

    points = []
    for line in ax.lines:
        if line.get_visible() and not _threshold(line, ax) and len(line.get_xydata()):
            points += list(line.get_transform().transform(line.get_xydata()))
    for collection in ax.collections:
        offsets = collection.get_offsets()
        if collection.get_visible() and len(offsets) and type(collection).__name__ == "PathCollection":
            points += list(collection.get_offset_transform().transform(offsets))
    bars = []
    for patch in ax.patches:
        if not patch.get_visible():
            continue
        if isinstance(patch, Rectangle):  # a bar: all of it
            box = patch.get_window_extent()
            bars += [box] if box.width * box.height else []
        else:  # an outline (a step histogram): its corners
            points += list(patch.get_transform().transform(patch.get_path().vertices))
    boxes = [Bbox([p - 2, p + 2]) for p in np.asarray(points, dtype=float).reshape(-1, 2) if np.isfinite(p).all()]
    return boxes + bars


def check_figure(fig) -> None:
    """Fail the build unless ``fig`` fits the text column at its own size, every text in it is at
    least :data:`MIN_TEXT_PX` high as shown, it has a title (each of its axes, or the figure), a
    threshold line across an axes (``axhline``, ``axvline``) is named in its legend, no legend
    covers a plotted point or bar, and every legend tells its entries apart and shows each in
    the colour of what it labels (every bar, line or point carrying that label)."""
    width_px = fig.get_size_inches()[0] * fig.dpi
    assert width_px <= COLUMN_PX + 0.5, f"figure {width_px:.0f} px wide: the column holds {COLUMN_PX} px"
    fig.canvas.draw()
    titles = [fig._suptitle] + [ax.title for ax in fig.axes]
    assert any(t is not None and t.get_text().strip() for t in titles), "a figure without a title: set_title or suptitle"
    for ax in fig.axes:
        if not ax.get_visible() or not ax.has_data():
            continue
        legend = ax.get_legend()
        named = {t.get_text() for shown in [legend, *fig.legends] if shown is not None for t in shown.get_texts()}
        for line in ax.lines:  # axes through 0 and the separators of an image's blocks need no name
            at = line.get_xydata()[0][0 if line.get_xydata()[0][1] == 0 and line.get_xydata()[1][1] == 1 else 1]
            if _threshold(line, ax) and at != 0 and not ax.images:
                assert line.get_label() in named, f"a threshold line at {line.get_xydata()[0]} is not in the legend"
        if legend is not None:
            box = legend.get_window_extent()
            covered = [b for b in _marks(ax) if b.overlaps(box)]
            assert not covered, f"the legend of {ax.get_title()!r} covers {len(covered)} plotted points or bars"
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_visible() and text.get_text().strip():
            shown = text.get_fontsize() * fig.dpi / 72
            assert shown >= MIN_TEXT_PX, f"text {text.get_text()!r} is {shown:.1f} px high (at least {MIN_TEXT_PX})"
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        entries = [(t.get_text(), h) for t, h in zip(legend.get_texts(), legend.legend_handles)]
        looks = [_look(h) for _t, h in entries]
        assert len(set(looks)) == len(looks), f"legend entries look alike: {[t for t, _h in entries]}"
        labelled: dict = {}
        for artist in [*ax.lines, *ax.collections, *ax.patches, *ax.containers]:
            labelled.setdefault(artist.get_label(), []).extend(_parts(artist))
        for text, handle in entries:
            shown = [_colour(a) for a in labelled.get(text, [])]
            if shown:  # an artist carries this label: all of it must look like the legend says
                assert all(c == _colour(handle) for c in shown), f"legend entry {text!r} does not match its colours"
            else:  # a proxy entry: its colour must appear in the plot
                everything = {_colour(a) for parts in labelled.values() for a in parts}
                assert _colour(handle) in everything, f"legend entry {text!r} shows a colour that is not plotted"


def show_figure(fig) -> None:
    """:func:`check_figure`, then show ``fig`` as a PNG at its own size and close it."""
    if fig.get_layout_engine() is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            try:
                fig.tight_layout()
            except UserWarning as warning:
                raise AssertionError(f"{warning}: draw this figure with layout='constrained'") from None
    check_figure(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    plt.close(fig)
    display(Image(buffer.getvalue()))


def show_numeric_checks(rows) -> None:
    merged: dict = {}
    for name, what, label, dtype, result in rows:
        merged.setdefault((name, what, label, dtype), []).append(result)
    lines = ["| identity | computation | model | dtype | closest run: error / tolerance | passed |",
             "|---|---|---|---|---|---|"]
    for (name, what, label, dtype), results in merged.items():
        nearest = closest(results, what in RIGHT)
        lines.append(
            f"| `{name}` | {render.md_text(what)} | {label} | {str(dtype).removeprefix('torch.')}"
            f" | {nearest.max_abs_error:.2g} / {nearest.tolerance:.2g}"
            f" | {sum(r.passed for r in results)} of {len(results)} |"
        )
    display(Markdown("\n".join(lines)))
