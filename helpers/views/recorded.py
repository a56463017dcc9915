"""The postmortem section of a recorded case (:mod:`helpers.investigation.recorded`: a case recorded once on a live
server and read back offline), HTML-escaped."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..errors import CaseError
from ..investigation.cases import load_recorded_case
from ..investigation.recorded import recorded_headline, replay_recorded
from ..paths import ROOT
from .common import esc
from .investigation import sections_html


def recorded_parts(case_path: str | os.PathLike, repo_root: Optional[str | os.PathLike] = None) -> list[Any]:
    """The postmortem section of one recorded case: its title, story and recording line, then the recorded
    investigation's own sections (:func:`helpers.views.investigation.sections_html`: findings, hypotheses, proposed
    fix, acceptance budget, what the server ran). Every text from the case, the recording or the server is
    HTML-escaped. A case whose recording cannot be read gives one escaped paragraph saying why (the page still
    renders)."""
    p = Path(case_path)
    p = p if p.is_absolute() else Path(repo_root or ROOT) / p
    try:
        case = load_recorded_case(p)
        doc, meta = replay_recorded(case)
    except CaseError as exc:
        return [f"<p><b>Recorded case {esc(p.name)} not shown:</b> {esc(str(exc))}</p>"]
    parts: list[Any] = [f"<h3>{esc(case.title)}</h3>"]
    if case.story:
        parts.append(f"<p>{esc(case.story.strip())}</p>")
    parts.append(f'<p class="e3f-note">{esc(recorded_headline(doc, meta))} Case file {esc(os.fspath(case_path))}, '
                 f'recording {esc(case.recording)}; record again: <code>{esc(meta.get("command") or "")}</code>.</p>')
    parts += sections_html(doc, with_headline=True, run_dir=case.resolve(case.recording))
    return parts


__all__ = ["recorded_parts"]
