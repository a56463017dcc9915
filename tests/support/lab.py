"""JupyterLab for the browser tests: started on 127.0.0.1 with this repository's config
(``env/jupyter/jupyter_server_config.py``, as ``make lab`` does), a token, its own settings folders (autosave off, no
news or update checks: the test never writes into ``notebooks/`` and nothing reaches the network), kernels importing
this checkout's ``helpers``; stopped by its process group on exit. :class:`Lab` drives notebooks through the UI with
Playwright (open, edit a cell, Run All, wait, read outputs)."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from support import ROOT

#: JupyterLab user settings for the test: no autosave (the notebooks under test are the repository's), no news feed
#: and no update check (no request leaves 127.0.0.1), all cells rendered
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                          "checkForUpdates": False},
    # every cell in the DOM (JupyterLab 4 renders only the cells in view by default), so cells can be found by text
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def _free_port() -> int:
    from helpers.server.embedded import free_port

    return free_port()


@contextlib.contextmanager
def jupyterlab(tmp: Path, env: Optional[dict] = None, timeout: float = 120.0) -> Iterator[str]:
    """Start JupyterLab on ``127.0.0.1`` rooted at ``notebooks/``; yield ``(base URL, token, pid)``
    (``http://127.0.0.1:PORT``; the pages are ``{base}/lab?token={token}``).

    Raises:
        TimeoutError: JupyterLab did not answer ``/api/status`` in ``timeout`` seconds (its log tail is in the message).
    """
    settings = tmp / "lab-settings"
    for name, value in SETTINGS.items():
        p = settings / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = Path(sys.executable).parent / "jupyter"
    cmd = [str(jupyter), "lab", f"--config={ROOT / 'env' / 'jupyter' / 'jupyter_server_config.py'}",
           f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}", "--no-browser",
           f"--ServerApp.root_dir={ROOT / 'notebooks'}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), "JUPYTER_CONFIG_DIR": str(tmp / "lab-config"),
               "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
               "JUPYTER_RUNTIME_DIR": str(tmp / "lab-runtime"), **(env or {})}
    log = tmp / "jupyterlab.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise TimeoutError(f"JupyterLab did not start: {log.read_text()[-3000:]}") from None
                time.sleep(0.3)
        yield base, token, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Lab:
    """One JupyterLab page driven through its UI (Playwright ``Page``)."""

    def __init__(self, page, base: str, token: str, pid: int = 0):
        self.page, self.base, self.token, self.pid = page, base, token, pid

    def open(self, name: str, timeout: float = 120.0) -> None:
        """Open ``notebooks/<name>.ipynb`` in its own page load and wait for its kernel to be idle."""
        self.page.goto(f"{self.base}/lab/tree/{name}.ipynb?reset&token={self.token}")   # reset: only this tab
        # the panel appears before its cells: wait for the title (every notebook opens with a markdown h1)
        self.page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedMarkdown h1",
                                    timeout=timeout * 1000)
        self.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout * 1000)

    def dirty(self, settle_s: float = 15.0) -> list[str]:
        """Titles of the tabs marked unsaved once the kernel has connected: polled for up to ``settle_s`` seconds
        (while the kernel starts, JupyterLab marks the tab for a moment, until the kernel's ``language_info`` equals
        the notebook's)."""
        deadline = time.monotonic() + settle_s
        while True:
            tabs = self.page.eval_on_selector_all(".lm-TabBar-tab.jp-mod-dirty", "els => els.map(e => e.textContent)")
            if not tabs or time.monotonic() > deadline:
                return tabs
            self.page.wait_for_timeout(250)

    def listing(self) -> list[str]:
        """The names the file browser lists."""
        self.page.wait_for_selector(".jp-DirListing-itemName")
        return self.page.eval_on_selector_all(".jp-DirListing-itemName", "els => els.map(e => e.textContent)")

    def _cells(self):
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")

    def set_parameters(self, values: dict) -> None:
        """Replace the assignments of the ``parameters`` cell (the first code cell whose source sets ``run_dir``)
        with ``values`` typed into its editor (other lines kept)."""
        cells = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
        for i in range(cells.count()):
            cell = cells.nth(i)
            source = cell.locator(".cm-content").inner_text()
            if source.lstrip().startswith("run_dir ="):
                break
        else:
            raise AssertionError("no parameters cell")
        lines = []
        for line in source.splitlines():
            name = line.split("=", 1)[0].strip()
            lines.append(f"{name} = {values[name]!r}" if name in values else line)
        editor = cell.locator(".cm-content")
        editor.click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.insert_text("\n".join(lines))
        self.page.keyboard.press("Escape")

    def run_all(self, timeout: float = 300.0, while_running=None) -> float:
        """Run all cells through the Run menu and wait until every code cell has run; returns the seconds taken.
        ``while_running(page)`` is called once while a cell is still running (e.g. to see its progress)."""
        t0 = time.monotonic()
        prompts = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt"
        before = self.page.eval_on_selector_all(prompts, "els => els.map(e => e.textContent.trim())")
        for _ in range(3):            # a click on a menu that is still opening can be lost: check that cells started
            self.page.get_by_role("menuitem", name="Run", exact=True).click()
            self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            started = time.monotonic() + 10
            while time.monotonic() < started and self.page.eval_on_selector_all(
                    prompts, "els => els.map(e => e.textContent.trim())") == before:
                self.page.wait_for_timeout(100)
            if self.page.eval_on_selector_all(prompts, "els => els.map(e => e.textContent.trim())") != before:
                break
        called = while_running is None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            texts = self.page.eval_on_selector_all(prompts, "els => els.map(e => e.textContent.trim())")
            if not called and any("*" in t for t in texts):
                called = bool(while_running(self.page))
            idle = self.page.query_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            done = texts and all(t.strip("[]: ").isdigit() for t in texts)
            if idle and not any("*" in t for t in texts) and (done or self.errors()):   # an error stops Run All
                return time.monotonic() - t0
            self.page.wait_for_timeout(250)
        raise TimeoutError(f"Run All did not finish in {timeout} s")

    def errors(self) -> list[str]:
        """Error outputs (tracebacks) of the open notebook."""
        return self.page.eval_on_selector_all(
            ".jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type='application/vnd.jupyter.error']",
            "els => els.map(e => e.textContent.slice(0, 2000))")

    def text(self, selector: str) -> list[str]:
        """Text of the elements of the open notebook matching ``selector``."""
        return self.page.eval_on_selector_all(f".jp-NotebookPanel:not(.lm-mod-hidden) {selector}",
                                              "els => els.map(e => e.textContent)")
