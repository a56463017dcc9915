"""Headless Chromium for the HTML and JupyterLab tests, driven with Playwright for Python and the system's Chromium
(Debian's ``chromium``; Playwright downloads no browser here: ``executable_path`` points at the system binary).

* :func:`find_chromium`: the binary (``$E3F_CHROMIUM`` first), or None (the tests skip with a reason);
* :func:`browser`: a context manager yielding a launched headless browser, closed (and its processes ended) on exit;
* :func:`render_page`: open a local HTML file (no network), wait for the plotly figures to draw, and return what the
  tests assert on:

  - ``plots``: one dict per ``.js-plotly-plot`` element: ``svg_children`` (elements inside its ``svg.main-svg``),
    ``traces`` (drawn trace groups), ``width``/``height`` in CSS pixels;
  - ``console_errors``: console messages of level error and uncaught exceptions (text);
  - ``requests``: every URL the page requested that is not ``file:``/``data:``/``about:``/``blob:``;
  - ``screenshot``: the PNG written (full page), if asked for.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

#: no background traffic: the pages under test must be the only thing that could touch the network
CHROMIUM_ARGS = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-sync", "--disable-dev-shm-usage"]

PLOTS_JS = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => {
  const svg = el.querySelector('svg.main-svg');
  const r = el.getBoundingClientRect();
  return {svg_children: svg ? svg.querySelectorAll('*').length : 0,
          traces: el.querySelectorAll('g.trace, g.hm, g.imagelayer image').length,
          width: r.width, height: r.height,
          title: (el.querySelector('.gtitle') || {}).textContent || ''};
})
"""


def find_chromium() -> Optional[str]:
    """Path of a Chromium/Chrome binary (``$E3F_CHROMIUM`` first), or None."""
    env = os.environ.get("E3F_CHROMIUM")
    if env and Path(env).exists():
        return env
    for name in CANDIDATES:
        p = shutil.which(name)
        if p:
            return p
    return None


def missing() -> Optional[str]:
    """Why the browser tests cannot run here (no Chromium, no Playwright), or None."""
    if find_chromium() is None:
        return "chromium is not installed (apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pyproject.toml lists it)"
    return None


@contextlib.contextmanager
def browser() -> Iterator:
    """A headless Chromium (Playwright ``Browser``) on the system binary; closed on exit.

    Raises:
        FileNotFoundError: no Chromium binary.
    """
    from playwright.sync_api import sync_playwright

    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium binary (apt-get install chromium)")
    args = CHROMIUM_ARGS + (["--no-sandbox"] if os.geteuid() == 0 else [])   # root cannot use the sandbox
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=binary, headless=True, args=args)
        try:
            yield b
        finally:
            b.close()


def watch(page) -> dict:
    """Collect a page's console errors, uncaught exceptions and network requests from now on:
    ``{"console_errors": [...], "requests": [...]}`` (lists filled while the page runs)."""
    seen: dict = {"console_errors": [], "requests": []}
    page.on("console", lambda m: seen["console_errors"].append(m.text) if m.type in ("error", "assert") else None)
    page.on("pageerror", lambda e: seen["console_errors"].append(str(e)))
    page.on("request", lambda r: seen["requests"].append(r.url))
    return seen


def render_page(html_path: Path, *, screenshot: Optional[Path] = None, timeout: float = 120.0,
                settle_s: float = 2.0, width: int = 1280, height: int = 900) -> dict:
    """Open ``html_path`` in headless Chromium and report plots, console errors, requests (see module doc).

    Raises:
        FileNotFoundError: no Chromium binary.
        playwright.sync_api.TimeoutError: the page did not load in ``timeout``.
    """
    with browser() as b:
        page = b.new_page(viewport={"width": width, "height": height})
        seen = watch(page)
        page.goto(Path(html_path).resolve().as_uri(), wait_until="load", timeout=timeout * 1000)
        page.wait_for_timeout(settle_s * 1000)
        plots = page.evaluate(PLOTS_JS)
        shot = None
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True, timeout=timeout * 1000)
            shot = Path(screenshot)
        requests = [u for u in seen["requests"] if not u.startswith(("file:", "data:", "about:", "blob:"))]
        return {"plots": plots, "console_errors": list(seen["console_errors"]), "requests": requests,
                "screenshot": shot}
