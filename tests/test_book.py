"""Build the book from a copy of book/ and read every page in headless Chromium, offline.

The build executes every notebook (a failed proof, twin or numeric check fails it). The browser
check asserts, on every page, that MathJax, served from the book's own copy, typesets every
formula without an error and that no page asks for anything outside 127.0.0.1; and what a reader
meets at a 1280 px window: no raw LaTeX (``$$``, ``\\begin``) or Python warning in the text, no
table, display equation, output or figure wider than the text column (or cut inside its own
scrolling box), no output thousands of pixels long, every figure shown at its own size; and at a
390 px phone width: no page wider than the screen, and a table of contents that opens.

Figures are checked where they are drawn: every chapter shows them with ``pages.show_figure``,
which fails the build unless the figure fits the column, its text is readable and its legends
match its colours (the unit tests below make that check fail on the defects it exists for).

Needs the MathJax copy (``make book/_extra/mathjax/tex-chtml.js``) and Debian's Chromium
(``make chromium``); ``make test`` provides both. Never runs ``playwright install``.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
MATHJAX = BOOK / "_extra" / "mathjax" / "tex-chtml.js"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
]
# Every chapter of the table of contents must typeset formulas; one that plots must show its plots.
CHAPTERS = tuple(
    f"{line.split('file:')[1].strip()}.html" for line in (BOOK / "_toc.yml").read_text().splitlines() if "file:" in line
)
PLOTTING = tuple(c for c in CHAPTERS if "plt." in (BOOK / c.replace(".html", ".md")).read_text())
WITH_MATH = tuple(c for c in CHAPTERS if "$" in (t := (BOOK / c.replace(".html", ".md")).read_text()) or "render." in t)
BUILD_TIMEOUT = 2400  # seconds: the real-weights chapter runs MiniLM
PAGE_TIMEOUT = 60_000  # milliseconds
WIDE, PHONE = 1280, 390  # window widths in CSS pixels
LONGEST_OUTPUT = 3000  # pixels: an output taller than this is a leak (a repr), not something to read


def _build(tmp_path: Path) -> Path:
    """Copy book/ (without old builds) into ``tmp_path`` and build it; return the HTML folder."""
    book = tmp_path / "book"
    shutil.copytree(BOOK, book, ignore=shutil.ignore_patterns("_build", ".ipynb_checkpoints", "__pycache__"))
    jupyter_book = Path(sys.executable).with_name("jupyter-book")  # the venv's, not one on PATH
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # The notebooks' kernel imports this working tree's circuitmath, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [str(jupyter_book), "build", str(book), "--all", "--warningiserror", "--keep-going"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    log = f"--- stdout ---\n{done.stdout[-6000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    assert done.returncode == 0, f"jupyter-book build exited {done.returncode}\n{log}"
    html = book / "_build" / "html"
    assert (html / "mathjax" / "tex-chtml.js").is_file(), "html_extra_path did not copy MathJax into the site"
    return html


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


def _pages(html: Path) -> list[str]:
    """Every HTML page of the site, as paths relative to its root (assets excluded)."""
    pages = []
    for path in sorted(html.rglob("*.html")):
        relative = path.relative_to(html)
        if relative.parts[0].startswith("_") or relative.parts[0] == "mathjax":
            continue
        pages.append(relative.as_posix())
    return pages


# Run in the page: wait for MathJax (when the page loads it) and count what it produced.
_INSPECT = """async () => {
    const loadsMathJax = !!document.querySelector('script[src*="mathjax/tex-chtml.js"]');
    let mathJaxStarted = false;
    if (loadsMathJax) {
        const deadline = Date.now() + 30000;
        while (!(window.MathJax && window.MathJax.startup && window.MathJax.startup.promise)) {
            if (Date.now() > deadline) break;
            await new Promise((resolve) => setTimeout(resolve, 50));
        }
        if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
            await window.MathJax.startup.promise;
            mathJaxStarted = true;
        }
    }
    return {
        url: location.href,
        loadsMathJax,
        mathJaxStarted,
        containers: document.querySelectorAll("mjx-container").length,
        merrors: document.querySelectorAll("mjx-merror").length,
        untypeset: document.querySelectorAll(".math:not(:has(mjx-container))").length,
        brokenImages: [...document.images].filter((img) => !img.complete || img.naturalWidth === 0).length,
        images: document.images.length,
    };
}"""


# Run in the page at 1280 px: what a reader of the text column meets.
_READ = """() => {
    const article = document.querySelector("article.bd-article") || document.querySelector("main");
    const style = getComputedStyle(article);
    const box = article.getBoundingClientRect();
    const left = box.left + parseFloat(style.paddingLeft), right = box.right - parseFloat(style.paddingRight);
    const name = (el) => (el.tagName.toLowerCase() + " " + (el.textContent || el.src || "").trim().replace(/\\s+/g, " ")).slice(0, 90);
    // The text a reader sees, without code (sources may spell "$$") and typeset math (MathML text).
    const copy = article.cloneNode(true);
    copy.querySelectorAll(".cell_input, code, script, style, mjx-container, .headerlink").forEach((el) => el.remove());
    const text = copy.textContent;
    const wide = [];
    const blocks = article.querySelectorAll(
        "table, mjx-container[display='true'] > mjx-math, .cell_output pre, .cell_output img, .cell_output table");
    for (const el of blocks) {
        const r = el.getBoundingClientRect();
        if (r.width === 0) continue;  // inside a closed dropdown
        if (r.right > right + 1 || r.left < left - 1) wide.push(`${name(el)}: ${Math.round(r.width)} px in ${Math.round(right - left)} px`);
    }
    for (const el of article.querySelectorAll(".cell_output pre, .pst-scrollable-table-container, .table-wrapper, div.math, mjx-container[display='true']")) {
        if (el.scrollWidth > el.clientWidth + 1) wide.push(`${name(el)}: ${el.scrollWidth} px of content in a ${el.clientWidth} px box`);
    }
    const images = [...article.querySelectorAll(".cell_output img")];
    return {
        column: Math.round(right - left),
        rawTex: ["$$", "\\begin{", "\\end{"].filter((s) => text.includes(s)),
        warnings: [...new Set(text.match(/\\b[A-Za-z]*Warning\\b:?/g) || [])],
        stderr: article.querySelectorAll(".cell_output .stderr, .cell_output .output.stderr").length,
        tracebacks: article.querySelectorAll(".cell_output .traceback, .cell_output .output.error").length,
        reprs: (text.match(/\\b[A-Z][A-Za-z]+Report\\(/g) || []).length,
        wide,
        tall: [...article.querySelectorAll(".cell_output")].filter((el) => el.getBoundingClientRect().height > %d)
            .map((el) => `${name(el)}: ${Math.round(el.getBoundingClientRect().height)} px`),
        shrunk: images.filter((img) => img.naturalWidth && img.getBoundingClientRect().width < 0.98 * img.naturalWidth)
            .map((img) => `${img.naturalWidth} px shown at ${Math.round(img.getBoundingClientRect().width)} px`),
        figures: images.length,
    };
}""" % LONGEST_OUTPUT

# Run in the page at 390 px: the page fits the screen; click the visible table-of-contents button.
_PHONE = """async () => {
    const overflow = document.documentElement.scrollWidth - window.innerWidth;
    const visible = (el) => !!el && el.getBoundingClientRect().width > 0 && getComputedStyle(el).visibility !== "hidden";
    const button = [...document.querySelectorAll(".primary-toggle")].find(visible);
    if (!button) return {overflow, button: false, opened: false, links: 0};
    button.click();
    await new Promise((resolve) => setTimeout(resolve, 300));
    const dialog = document.getElementById("pst-primary-sidebar-modal");
    const links = dialog ? [...dialog.querySelectorAll("nav a")].filter(visible).length : 0;
    const opened = !!dialog && dialog.open;
    if (opened) dialog.close();
    return {overflow, button: true, opened, links};
}"""


def _reader_problems(name: str, read: dict) -> list[str]:
    """Every defect ``_READ`` found on one page, as sentences."""
    problems = []
    if read["rawTex"]:
        problems.append(f"raw LaTeX in the text: {read['rawTex']}")
    if read["warnings"] or read["stderr"]:
        problems.append(f"a Python warning or stderr output: {read['warnings']}, {read['stderr']} stderr blocks")
    if read["tracebacks"]:
        problems.append(f"{read['tracebacks']} cells show an error")
    if read["reprs"]:
        problems.append(f"{read['reprs']} report reprs leaked into the text")
    problems += [f"wider than the {read['column']} px column: {w}" for w in read["wide"]]
    problems += [f"an output taller than {LONGEST_OUTPUT} px: {t}" for t in read["tall"]]
    problems += [f"a figure shown smaller than drawn (its labels shrink): {s}" for s in read["shrunk"]]
    return [f"{name}: {p}" for p in problems]


def test_every_plotting_chapter_shows_figures_through_the_checked_helper():
    """plt.show() would skip the figure checks; every chapter that plots uses pages.show_figure."""
    for chapter in CHAPTERS:
        source = (BOOK / chapter.replace(".html", ".md")).read_text()
        assert "plt.show(" not in source, f"{chapter} shows a figure without pages.show_figure"
        if "plt.subplots" in source:
            assert source.count("show_figure(fig)") >= source.count("plt.subplots"), chapter


def test_every_chapter_ends_with_what_it_established():
    for chapter in CHAPTERS:
        source = (BOOK / chapter.replace(".html", ".md")).read_text()
        if chapter != "intro.html":
            assert "show_established(" in source.rsplit("```{code-cell}", 1)[-1], f"{chapter} lacks its summary"


def _figure(**kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kwargs)


def _pages_module():
    sys.path.insert(0, str(BOOK))
    try:
        import pages
    finally:
        sys.path.remove(str(BOOK))
    return pages


def test_figure_check_passes_a_readable_figure():
    pages = _pages_module()
    fig, ax = _figure(figsize=(6, 3))
    ax.plot([0, 1], [0, 1], color="tab:blue", label="a")
    ax.bar([0, 1], [1, 2], color="tab:orange", label="b")
    ax.errorbar([0, 1], [1, 1], yerr=0.2, fmt="o", color="tab:green", label="c")
    ax.legend()
    pages.check_figure(fig)


@pytest.mark.parametrize(
    "defect", ["too_wide", "small_labels", "legend_alike", "legend_wrong_colour", "proxy_not_plotted", "error_bars"])
def test_figure_check_fails_on_each_defect_negative_control(defect):
    """Each defect the issue found in the book's figures makes check_figure fail."""
    from matplotlib.patches import Patch

    pages = _pages_module()
    fig, ax = _figure(figsize=(9 if defect == "too_wide" else 6, 3))
    ax.plot([0, 1], [0, 1], color="tab:blue", label="line")
    if defect == "small_labels":
        ax.set_yticks([0, 1], ["a", "b"], fontsize=5)
    if defect == "legend_alike":  # the path-expansion chart: empty bars give four blue swatches
        for kind in ("direct", "one head", "virtual head", "bias"):
            ax.barh([], [], label=kind)
        ax.bar([0, 1, 2, 3], [1, 2, 3, 4], color=["tab:blue", "tab:orange", "tab:green", "0.6"])
    if defect == "legend_wrong_colour":  # one label over bars of several colours
        ax.bar([0, 1], [1, 2], color=["tab:red", "tab:green"], label="bars")
    if defect == "error_bars":  # bars of another colour than the legend shows
        ax.errorbar([0, 1], [0, 1], yerr=0.1, fmt="o", color="tab:green", ecolor="tab:red", label="error bars")
    if defect == "proxy_not_plotted":
        ax.legend(handles=[Patch(color="tab:purple", label="tolerance")])
    else:
        ax.legend()
    with pytest.raises(AssertionError):
        pages.check_figure(fig)


def _settle(page) -> None:
    """Wait until the page is what a reader sees: MathJax done typesetting (where the page loads
    it) and every font it asked for loaded. (Playwright's "networkidle" never fired on the
    rotation chapter although no request was pending: a heuristic, not a state of the page.)"""
    from playwright.sync_api import Error, TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_load_state("networkidle", timeout=15_000)  # every page but one: nothing in flight
    except PlaywrightTimeout:
        pass  # then what a reader waits for: typesetting and fonts, below
    for _attempt in range(5):  # a page that redirects destroys the context the first wait ran in
        try:
            page.wait_for_load_state("load")
            page.evaluate("() => (window.MathJax && MathJax.startup ? MathJax.startup.promise : Promise.resolve())"
                          ".then(() => document.fonts.ready).then(() => true)")
            return
        except Error as error:
            if "context was destroyed" not in str(error):
                raise
    raise AssertionError(f"{page.url} kept navigating")


@pytest.mark.book
@pytest.mark.xdist_group("book")
def test_book_builds_and_renders_offline(tmp_path):
    if not MATHJAX.is_file():
        pytest.fail(f"{MATHJAX.relative_to(ROOT)} is missing: run `make {MATHJAX.relative_to(ROOT)}`")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run `make chromium`")
    from playwright.sync_api import sync_playwright

    html = _build(tmp_path)
    pages = _pages(html)
    for chapter in CHAPTERS:
        assert chapter in pages, f"{chapter} was not built; pages: {pages}"

    handler = functools.partial(_QuietHandler, directory=str(html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"

    outside: list[str] = []  # requests to anywhere but 127.0.0.1, aborted
    failed: list[str] = []  # local requests that failed or returned an error status
    page_errors: list[str] = []  # uncaught JavaScript exceptions
    results: dict[str, dict] = {}
    reading: dict[str, dict] = {}
    phone: dict[str, dict] = {}

    def route(route):
        url = route.request.url
        parts = urlsplit(url)
        inline = parts.scheme in ("data", "blob", "about")
        if inline or (parts.scheme in ("http", "https", "ws", "wss") and parts.hostname == "127.0.0.1"):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                context = browser.new_context(viewport={"width": WIDE, "height": 900})
                context.route("**/*", route)
                page = context.new_page()
                page.set_default_timeout(PAGE_TIMEOUT)
                page.on(
                    "requestfailed",
                    lambda r: None if r.url in outside else failed.append(f"{r.url}: {r.failure}"),
                )
                page.on(
                    "response",
                    lambda r: failed.append(f"{r.url}: HTTP {r.status}") if r.status >= 400 else None,
                )
                page.on("pageerror", lambda e: page_errors.append(f"{page.url}: {e}"))
                for name in pages:
                    page.goto(base + name, wait_until="load")
                    if 'http-equiv="Refresh"' in (html / name).read_text(encoding="utf-8"):
                        page.wait_for_url(lambda url: not url.endswith("/" + name), wait_until="load")
                    _settle(page)
                    results[name] = page.evaluate(_INSPECT)
                    reading[name] = page.evaluate(_READ)
                page.set_viewport_size({"width": PHONE, "height": 800})
                for name in pages:
                    page.goto(base + name, wait_until="load")
                    _settle(page)
                    page.evaluate(_INSPECT)  # typeset first: formulas set the page's width
                    phone[name] = page.evaluate(_PHONE)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()

    assert not outside, f"pages asked for resources outside 127.0.0.1: {sorted(set(outside))}"
    assert not failed, f"local requests failed: {failed}"
    assert not page_errors, f"JavaScript errors: {page_errors}"
    for name, result in results.items():
        where = f"{name} (at {result['url']})"
        assert result["mathJaxStarted"] or not result["loadsMathJax"], f"{where}: MathJax did not start"
        assert result["merrors"] == 0, f"{where}: MathJax reported {result['merrors']} errors"
        assert result["untypeset"] == 0, f"{where}: {result['untypeset']} math elements were not typeset"
        assert result["brokenImages"] == 0, f"{where}: {result['brokenImages']} images did not load"
    problems = [p for name, read in reading.items() for p in _reader_problems(name, read)]
    for name, result in phone.items():
        if result["overflow"] > 1:
            problems.append(f"{name}: at {PHONE} px the page is {result['overflow']} px wider than the screen")
        if not (result["button"] and result["opened"] and result["links"] > 0):
            problems.append(f"{name}: at {PHONE} px the table of contents does not open ({result})")
    assert not problems, "what a reader meets:\n" + "\n".join(problems)
    for chapter in WITH_MATH:
        result = results[chapter]
        assert result["loadsMathJax"], f"{chapter} does not load MathJax"
        assert result["containers"] > 0, f"{chapter}: no formula was typeset"
        if chapter in PLOTTING:
            assert result["images"] > 0 and reading[chapter]["figures"] > 0, f"{chapter}: the plot is missing"


def test_the_book_test_carries_the_book_marker():
    """``-m 'not book'`` deselects the build: the marker and the xdist group sit on the test."""
    marks = {m.name: m for m in getattr(test_book_builds_and_renders_offline, "pytestmark", [])}
    assert "book" in marks and marks["xdist_group"].args == ("book",)
    assert not getattr(_settle, "pytestmark", None), "markers on a helper select nothing"


def _displays_stand_alone(markdown: str) -> bool:
    """Every ``$$`` of ``markdown`` is a line of its own (``$$ \\begin`` run together is shown raw)."""
    return all(line.strip() == "$$" for line in markdown.splitlines() if "$$" in line)


def test_rendered_identities_keep_displays_on_lines_of_their_own():
    import circuitmath as cm
    from circuitmath import render

    for identity in cm.identities():
        report = identity.prove()
        for text in (render.statement(identity), render.derivation(identity), render.twins(report, identity),
                     render.established([(report, identity)])):
            assert _displays_stand_alone(text), identity.name
        derivation = render.derivation(identity)
        assert derivation.count("\\begin{aligned}") == 1, identity.name  # one aligned block
        for i, step in enumerate(identity.proof.steps, 1):
            assert f"\\text{{({i})}}" in derivation and f"\n{i}. {step.reason}" in derivation, (identity.name, i)
        for line in render.twins(report, identity).splitlines():
            assert not any(term.strip().startswith("1 ") for term in line.replace(" - ", " + ").split(" + ")), line
    assert not _displays_stand_alone("$$ \\begin{aligned} x \\end{aligned} $$$$ y $$")  # the check can fail


def test_established_shows_axioms_only_when_the_report_records_them():
    import circuitmath as cm
    from circuitmath import render

    identity = cm.get_identity("fold_layer_norm")
    report = identity.prove()
    stripped = type("Report", (), {"__getattr__": lambda self, name: getattr(report, name),
                                    "as_dict": lambda self: {k: v for k, v in report.as_dict().items() if k != "axioms"}})()
    without = render.established([(stripped, identity)], ["a number"])
    assert "`fold_layer_norm`" in without and "axiom" not in without and "- a number" in without
    assert "for every size ($d$, $m$ symbolic)" in without

    class WithAxioms:
        def __init__(self, report, axioms):
            self._report, self._axioms = report, axioms

        def __getattr__(self, name):
            return getattr(self._report, name)

        def as_dict(self):
            return self._report.as_dict() | {"axioms": self._axioms}

    assert "rests on the axioms rows of A sum to 1" in render.established(
        [(WithAxioms(report, ["rows of A sum to 1"]), identity)])
    assert "rests on no axiom" in render.established([(WithAxioms(report, []), identity)])
    assert "rests on the axioms softmax" in render.established([(WithAxioms(report, [{"name": "softmax"}]), identity)])


def test_prose_typesets_ascii_math_and_code_names():
    from circuitmath.render import prose

    assert prose("each norm's output is read only by W_Q, W_in") == "each norm's output is read only by $W_{Q}$, $W_\\mathrm{in}$"
    assert prose("eps == 0") == "$\\varepsilon = 0$"
    assert prose("normalization_type is LN") == "`normalization_type` is LN"
    assert prose("every reader's input is LNPre(x)") == "every reader's input is $\\mathrm{LNPre}(x)$"
