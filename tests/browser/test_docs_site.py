"""The documentation site as a reader gets it: built strictly, served locally, each page opened in Chromium.

One build of the real site (``python -m labkit docs``'s ``build``) per session, served by a local
``http.server`` (search needs one), then every page opened: no console error, no failed request, no
request off this machine, no broken image, a title; every lesson page shows a figure; no page shows a
hidden check's source or a solution.
"""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs tools: pip install -r requirements-docs.txt")
from labkit.lab import docs  # noqa: E402

pytestmark = pytest.mark.browser

ROOT = Path(docs.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """The real site, built once in strict mode (a warning fails this fixture, so every test)."""
    return docs.build(tmp_path_factory.mktemp("docs") / "site").parent


@pytest.fixture(scope="module")
def served(site):  # type: ignore[no-untyped-def]
    """The site's address on 127.0.0.1, from a quiet local http.server."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # type: ignore[no-untyped-def]
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def pages(site: Path) -> list[str]:
    return sorted(str(p.relative_to(site)) for p in site.rglob("*.html")
                  if p.parts[len(site.parts)] != "assets" and p.name != "404.html")


def test_every_lesson_and_problem_set_on_disk_has_its_page_and_every_module_its_reference(site):
    found = pages(site)
    for lesson in docs.lessons():
        assert f"lessons/{lesson.stem}.html" in found, f"{lesson.name} has no page"
    for ps in docs.problem_sets():
        assert f"exercises/{ps.stem}.html" in found, f"{ps.name} has no page"
    for module in docs.REFERENCE:
        assert f"reference/{module}.html" in found
    guides = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert guides and all(f"{g}.html" in found for g in guides)


def test_no_page_shows_a_hidden_check_or_a_solution(site):
    for page in pages(site):
        html = (site / page).read_text(encoding="utf-8")
        if page.startswith("lessons/"):
            assert "with expect(" not in html, f"{page} shows a hidden check's source"
            assert "nbval-" not in html, f"{page} shows nbval's tags"
        if page.startswith("exercises/"):
            for marker in ("BEGIN SOLUTION", "HIDDEN TESTS"):
                assert marker not in html, f"{page} shows {marker!r}: not the student release"
            assert "YOUR CODE HERE" in html, f"{page}: the release's stubs are missing"


def test_every_page_opens_with_its_title_its_images_and_no_error(site, served, browser):  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    context.set_default_timeout(30_000)
    offsite: list[str] = []

    def local_only(route):  # type: ignore[no-untyped-def]
        if route.request.url.startswith(served) or route.request.url.startswith("data:"):
            route.continue_()
        else:  # the site is offline: nothing may leave this machine
            offsite.append(route.request.url)
            route.abort()

    context.route("**/*", local_only)
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console error: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    figures = {}
    try:
        for path in pages(site):
            problems.clear()
            response = page.goto(served + path, wait_until="load")
            page.wait_for_load_state("networkidle")
            # MathJax typesets after load and fetches its fonts' tables as it meets characters: wait for
            # its queue to empty, or the next page's navigation cancels those requests mid-flight
            page.wait_for_function("""() => !window.MathJax || (MathJax.isReady
                && MathJax.Hub.queue.pending === 0 && MathJax.Hub.queue.running === 0
                && Object.values(MathJax.Ajax.loading).every(file => file.preloaded))""")
            page.wait_for_load_state("networkidle")
            assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
            h1 = page.locator("article h1").first.inner_text().replace("¶", "").strip()
            assert h1, f"{path} has no title (h1)"
            title = page.title()  # "<the page's title> - labkit"; the home page's is the site's
            named = title.endswith(" - labkit") and title[: -len(" - labkit")].strip()
            assert title == "labkit" if path == "index.html" else named, f"{path}: <title> {title!r}"
            broken = page.evaluate("""() => [...document.images]
                .filter(img => !img.complete || img.naturalWidth === 0).map(img => img.src.slice(0, 80))""")
            assert not broken, f"{path}: broken images {broken}"
            assert not problems, f"{path}: " + "; ".join(problems)
            figures[path] = page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output img')]
                .filter(img => img.naturalWidth > 100).length""")
    finally:
        context.close()
    assert not offsite, f"requests off this machine: {offsite[:5]}"
    lessons = {p: n for p, n in figures.items() if p.startswith("lessons/")}
    assert len(lessons) == len(docs.lessons())
    assert all(lessons.values()), f"lesson pages without a figure: {[p for p, n in lessons.items() if not n]}"
