"""The README front page and the docs/ pages it links (issue 39): every command they show is checked here against
the code it names, and every link between them resolves.

* The README starts with exactly the two commands for a fresh machine, ``make postmortem`` and ``make test``, both
  Makefile targets.
* Every relative link in README.md and docs/*.md names an existing file, and an anchor names a heading of that page
  (GitHub's slug rule); every docs page is linked from the front page.
* Every command line of a fenced block (and every inline ``.venv/bin/python -m helpers ...`` span) is one of the
  kinds below and checked as such; a line of no known kind fails the test, so a new kind of command gets a check:

  - ``make TARGET``: a target of the Makefile;
  - ``.venv/bin/python -m helpers ...``: parsed by the command's own argument parser (the real
    :class:`helpers.cli.common.Parser`, stopped right after parsing: no server, no run folder), placeholders such as
    PORT or PID given values; and the command is one a server / suite test runs for real (``LIVE_TESTS``);
  - ``.venv/bin/python - <<'PY'`` / ``.venv/bin/python -c "..."``: the snippet run for real, its ``/tmp/`` paths
    moved under pytest's tmp_path;
  - ``.venv/bin/papermill NB OUT -p NAME VALUE ...``: the notebook exists and each NAME is in its parameters cell;
  - a few shell lines (``export``, a variable, ``sh outputs/<run>/command.txt``): listed in ``SHELL_LINES``.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: values given to the placeholders of documented commands before they are parsed
PLACEHOLDERS = {"$H": "env/models/llama_h64", "HOST": "127.0.0.1", "PORT": "30000", "SGLANG": "30001",
                "VLLM": "30002", "PID": "12345", "<run>": "20261201-000000-x", "/tmp/": "{tmp}/"}

#: shell lines that are not this tool's commands, exactly as documented
SHELL_LINES = {"export PYTHONPATH=$PWD", "H=env/models/llama_h64", "sh outputs/<run>/command.txt"}

#: each documented command (its first word, or first two for ``server``) and the tests that run it for real
LIVE_TESTS = {
    "investigate": ["tests/server/test_investigate_live.py"],
    "server start": ["tests/server/test_investigate_live.py", "tests/server/test_vllm_faults.py"],
    "server stop": ["tests/unit/test_docs.py"],
    "server detect": ["tests/unit/engines/test_detect.py"],
    "simulate": ["tests/unit/cli/test_simulate_cli.py"],
    "ablate": ["tests/server/test_ablate_live.py"],
    "compare-engines": ["tests/server/test_vllm_faults.py"],
    "watch": ["tests/unit/acceptance/test_watch.py"],
    "diagnose": ["tests/unit/cli/test_diag_cli.py"],
    "measure": ["tests/server/test_acceptance.py"],
    "suite": ["tests/suite/test_suite_main.py", "tests/unit/suite/test_suite_runner.py"],
    "replay": ["tests/server/test_cases.py"],
}


def _fences(text: str):
    """(info string, lines) of every fenced block of a Markdown text."""
    out, info, block = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, block = line[3:].strip(), []
            else:
                out.append((info, block))
                info = None
        elif info is not None:
            block.append(line)
    return out


def _commands(page: Path) -> list[str]:
    """The command lines of a page: every line of a bash block (continuations joined, comments and heredoc bodies
    kept with their command), the ``$``-prompted or ``.venv/bin/`` / ``make`` lines of other blocks, and the inline
    ``.venv/bin/python -m helpers ...`` spans of the prose."""
    text = page.read_text()
    cmds = []
    for info, lines in _fences(text):
        if info not in ("bash", ""):
            continue
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if info == "" or line.startswith("$ "):
                line = line[2:] if line.startswith("$ ") else line
                if not (line.startswith(".venv/bin/") or line.startswith("make ")):
                    continue
            if not line or line.startswith("#"):
                continue
            while line.endswith("\\") and i < len(lines):
                line = line[:-1] + " " + lines[i].strip()
                i += 1
            m = re.search(r"<<'(\w+)'", line)
            if m:                                     # a heredoc: its body belongs to the command
                body = []
                while lines[i].strip() != m.group(1):
                    body.append(lines[i])
                    i += 1
                i += 1
                line = line + "\n" + "\n".join(body)
            cmds.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`(\.venv/bin/python -m helpers [^`]*)`", prose):
        cmds.append(" ".join(span.split()))
    return cmds


def _all_commands():
    return [(p, c) for p in PAGES for c in _commands(p)]


def _fill(cmd: str, tmp: Path) -> str:
    for k, v in PLACEHOLDERS.items():
        cmd = cmd.replace(k, v.format(tmp=tmp))
    return cmd


def _targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_readme_starts_with_the_two_commands():
    """Issue 39: a newcomer's first two commands, first in the README, and true (Makefile targets)."""
    text = (ROOT / "README.md").read_text()
    first = text.split("\n```", 1)
    assert first[0].startswith("# ") and first[0].count("\n") == 1, "the README opens with its title, then the block"
    info, lines = _fences(text)[0]
    cmds = [ln.split("#")[0].strip() for ln in lines]
    assert info == "bash" and cmds == ["make postmortem", "make test"], lines
    assert {"postmortem", "test"} <= _targets()
    assert len(text.splitlines()) <= 150, "the front page stays a front page: move detail to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_links_resolve_and_every_page_is_linked():
    """Every relative link of README.md and docs/*.md names an existing file (and an existing heading when it has an
    anchor); every docs page is linked from the front page."""
    bad = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target}: no heading '{anchor}' in {dest.name}")
    assert not bad, "\n".join(bad)
    front = re.findall(r"\]\((docs/[^)#\s]+)", (ROOT / "README.md").read_text())
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in front]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """The checker's own rules on a page with one good and two broken links (a file, an anchor)."""
    (tmp_path / "a.md").write_text("# Title\n\n## What it shows\n")
    assert _anchors(tmp_path / "a.md") == {"title", "what-it-shows"}
    assert _slug("What `make postmortem` does") == "what-make-postmortem-does"
    assert _slug("Acceptance over time: `watch`") == "acceptance-over-time-watch"


def test_every_documented_command_is_one_the_code_accepts(tmp_path, monkeypatch):
    """Every command line of the README and docs/ pages, by kind (module docstring)."""
    from helpers.__main__ import main
    from helpers.cli import common

    parsed: list[argparse.Namespace] = []

    class _Parsed(Exception):
        pass

    def parse_only(self, args=None, namespace=None):
        parsed.append(argparse.ArgumentParser.parse_args(self, args, namespace))
        raise _Parsed()

    monkeypatch.setattr(common.Parser, "parse_args", parse_only)
    monkeypatch.delenv("E3F_DEBUG", raising=False)
    cmds = _all_commands()
    assert len(cmds) >= 25, cmds                      # the pages' commands were found at all
    unknown, failed, seen = [], [], set()
    for page, raw in cmds:
        where = f"{page.relative_to(ROOT)}: {raw.splitlines()[0]}"
        cmd = _fill(raw, tmp_path)
        if "\n" not in raw and " ".join(shlex.split(raw, comments=True)) in SHELL_LINES:
            continue
        first = cmd.splitlines()[0]
        if first.startswith("make "):
            words = [w for w in shlex.split(first, comments=True)[1:] if "=" not in w]
            if not set(words) <= _targets():
                failed.append(f"{where}: not a Makefile target")
        elif first.startswith(".venv/bin/python -m helpers "):
            line = first.split(" -m helpers ", 1)[1]
            groups = re.findall(r" \[([^\]]*)\]", line)   # a synopsis: each [optional group] parsed with the rest
            base = re.sub(r" \[[^\]]*\]", "", line)
            for variant in [base] + [f"{base} {g}" for g in groups]:
                argv = shlex.split(variant, comments=True)
                parsed.clear()
                code = main(argv)
                ok = code == 0 if argv == ["--help"] else len(parsed) == 1
                if argv != ["--help"]:
                    seen.add(" ".join(argv[:2]) if argv[0] == "server" else argv[0])
                if not ok:
                    failed.append(f"{where}: the command's parser refused {argv}")
        elif first.startswith(".venv/bin/python - <<") or first.startswith(".venv/bin/python -c "):
            code = cmd.split("\n", 1)[1] if first.startswith(".venv/bin/python - <<") else shlex.split(first)[2]
            r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
            if r.returncode:
                failed.append(f"{where}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        elif first.startswith(".venv/bin/papermill "):
            words = shlex.split(first, comments=True)
            nb = ROOT / words[1]
            names = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
            if not nb.is_file():
                failed.append(f"{where}: no notebook {words[1]}")
                continue
            cells = json.loads(nb.read_text())["cells"]
            params = "".join(next("".join(c["source"]) for c in cells
                                  if "parameters" in c.get("metadata", {}).get("tags", [])))
            missing = [n for n in names if not re.search(rf"^{re.escape(n)}\s*[:=]", params, flags=re.M)]
            if missing:
                failed.append(f"{where}: not in the notebook's parameters cell: {missing}")
        else:
            unknown.append(where)
    assert not unknown, "commands of no known kind (give them a check here):\n" + "\n".join(unknown)
    assert not failed, "\n".join(failed)
    untested = sorted(seen - set(LIVE_TESTS))
    assert not untested, f"documented commands with no test that runs them listed in LIVE_TESTS: {untested}"
    for name, files in LIVE_TESTS.items():
        for f in files:
            assert (ROOT / f).is_file(), f
            word = name.split()[-1]
            assert word in (ROOT / f).read_text(), f"{f} does not run {name}"


def test_a_wrong_flag_in_a_documented_command_is_refused(monkeypatch):
    """The parse-only check refuses what the real command refuses (so the test above can fail)."""
    from helpers.__main__ import main
    from helpers.cli import common

    parsed = []

    def parse_only(self, args=None, namespace=None):
        parsed.append(argparse.ArgumentParser.parse_args(self, args, namespace))
        raise RuntimeError("parsed")

    monkeypatch.setattr(common.Parser, "parse_args", parse_only)
    assert main(["investigate", "--url", "http://127.0.0.1:1", "--trainig", "x"]) == 2 and not parsed
    assert main(["server", "start", "--tp", "two"]) == 2 and not parsed
    main(["investigate", "--url", "http://127.0.0.1:1", "--training", "x"])
    assert len(parsed) == 1 and parsed[0].training == "x"


def test_server_stop_ends_the_tree_it_names(capsys):
    """``server stop PID`` (the documented way to stop a detached server), run for real on a process tree of this
    test's own: the leader and its child are ended and counted."""
    import psutil

    from helpers.__main__ import main

    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 20
        while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(leader.pid).children()[0].pid
        assert main(["server", "stop", str(leader.pid)]) == 0
        assert capsys.readouterr().out.strip() == f"stopped 2 process(es): {[leader.pid, child]}"
        leader.wait(timeout=10)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert main(["server", "stop", str(leader.pid)]) == 0
        assert capsys.readouterr().out.strip() == f"no process {leader.pid}"
    finally:
        if leader.poll() is None:
            leader.kill()


def test_documented_params_files_load(tmp_path):
    """Every ``yaml`` block of the pages is a suite params file that :func:`helpers.suite.params.load_params` accepts,
    its example folders (/models/..., /data/...) moved to the bundled Kimi-class pair that exists here."""
    from helpers.suite.params import load_params

    kimi = ROOT / "env" / "models" / "kimi"
    where = {"/models/Kimi-K2.5": kimi / "target", "/models/kimi-eagle3": kimi / "draft",
             "/data/specforge-sample": kimi / "data" / "sample"}
    blocks = [(p, "\n".join(lines)) for p in PAGES for info, lines in _fences(p.read_text()) if info == "yaml"]
    assert blocks
    for i, (page, text) in enumerate(blocks):
        for k, v in where.items():
            text = text.replace(k, str(v))
        f = tmp_path / f"params-{i}.yaml"
        f.write_text(text)
        params = load_params(f)
        assert params.server.url == "http://gpu-host:30000" and params.draft_dir == str(kimi / "draft"), page
