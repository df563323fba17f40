"""Build the book from a copy of book/ and read every page in headless Chromium, offline.

The build executes every notebook (a failed proof, twin or numeric check fails it). The browser
check asserts that MathJax, served from the book's own copy, typesets every formula without an
error, and that no page asks for anything outside 127.0.0.1.

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
                context = browser.new_context()
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
                    page.wait_for_load_state("networkidle")
                    results[name] = page.evaluate(_INSPECT)
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
    for chapter in WITH_MATH:
        result = results[chapter]
        assert result["loadsMathJax"], f"{chapter} does not load MathJax"
        assert result["containers"] > 0, f"{chapter}: no formula was typeset"
        if chapter in PLOTTING:
            assert result["images"] > 0, f"{chapter}: the plot is missing"
