"""Offline HTML pages of executed notebooks: nbconvert with the suite's template (plotly.js inline once, no
CDN, widgets replaced by a note above the view they redraw), and the checks every page must pass.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

from ..paths import ROOT
from ..runfiles import atomic_write_text

#: postmortem.html should stay below this: plotly.js alone is ~4.8 MB (inline, once); figures are
#: downsampled (helpers.views.common.MAX_POINTS) so that the page stays quick to open.
HTML_BUDGET_BYTES = 8_000_000


PLOTLYJS_MARKER = "* plotly.js v"  # banner at the top of every plotly.js bundle


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


WIDGET_NOTE = ('<div class="e3f-widget-note">(interactive control: open the notebook in JupyterLab to use '
               'it; the view below is the one the notebook was run with)</div>')


def export_html(notebook: Path, out: Path) -> int:
    """Export an executed notebook to offline HTML (template ``helpers/templates/e3f``).

    Returns the size in bytes. Output cells keep their HTML as produced by the notebook (the
    notebooks escape server-provided text); code is hidden behind a toggle button; widget views
    become a one-line note (their state is not exported; the view each widget redraws is an ordinary output).
    """

    nb = nbformat.read(notebook, as_version=4)
    # page title: "<notebook> - <run folder>" (e.g. "99_postmortem - 20261130-224332-seeds-hunt");
    # only safe characters, as the template does not escape it
    nb.metadata["title"] = re.sub(r"[^A-Za-z0-9 _.:-]", "_",
                                  f"{notebook.stem} - {notebook.resolve().parent.parent.name}")
    nb.metadata.pop("widgets", None)  # widget state needs a CDN manager; each widget's view is an ordinary output
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if WIDGET_VIEW in (output.get("data") or {}):
                output["data"] = {"text/html": WIDGET_NOTE}
    exporter = HTMLExporter(template_name="e3f",
                            extra_template_basedirs=[str(ROOT / "helpers" / "templates")])
    body, _ = exporter.from_notebook_node(nb)
    atomic_write_text(out, body)
    return out.stat().st_size


_SCRIPT_SRC = re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"']?\s*(?:https?:)?//", re.IGNORECASE)


_LINK_HREF = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?\s*(?:https?:)?//", re.IGNORECASE)


def check_html(path: Path) -> dict:
    """Offline-ness of an exported page: ``{"bytes", "plotlyjs_copies", "external_scripts",
    "external_links", "offline"}``; ``offline`` is True when no ``<script src>`` / ``<link href>``
    points at another host and plotly.js is embedded at most once."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    info = {"bytes": Path(path).stat().st_size, "plotlyjs_copies": text.count(PLOTLYJS_MARKER),
            "external_scripts": len(_SCRIPT_SRC.findall(text)),
            "external_links": len(_LINK_HREF.findall(text))}
    info["offline"] = (info["external_scripts"] == 0 and info["external_links"] == 0
                       and info["plotlyjs_copies"] <= 1)
    return info
