"""Headless Chromium driven over the Chrome DevTools Protocol (websocket-client), for the HTML tests.

:func:`render_page` opens a local HTML file in a fresh headless Chromium (no network: background
networking, component updates and first-run tasks are off, a fresh ``--user-data-dir``), waits for
the load event and for the plotly figures to draw, and returns what the tests assert on:

* ``plots``: one dict per ``.js-plotly-plot`` element: ``svg_children`` (elements inside its
  ``svg.main-svg``), ``traces`` (drawn trace groups), ``width``/``height`` in CSS pixels;
* ``console_errors``: console messages of level error, uncaught exceptions and log entries of level
  error (text);
* ``requests``: every URL the page requested that is not ``file:``/``data:``/``about:``;
* ``screenshot``: the PNG written (full page), if asked for.

The browser process is started by this module and killed by its PID when done.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

_PLOTS_JS = """
(() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => {
  const svg = el.querySelector('svg.main-svg');
  const r = el.getBoundingClientRect();
  return {svg_children: svg ? svg.querySelectorAll('*').length : 0,
          traces: el.querySelectorAll('g.trace, g.hm, g.imagelayer image').length,
          width: r.width, height: r.height};
}))()
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


class _CDP:
    def __init__(self, ws_url: str, timeout: float):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=timeout, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, params: Optional[dict] = None, timeout: float = 30.0) -> dict:
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        self.ws.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                msg = json.loads(self.ws.recv())
            except Exception:  # noqa: BLE001 - websocket timeout: keep waiting until the deadline
                continue
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)
        raise TimeoutError(f"CDP {method}: no answer in {timeout} s")

    def wait_event(self, method: str, timeout: float) -> Optional[dict]:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + timeout
        self.ws.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                msg = json.loads(self.ws.recv())
            except Exception:  # noqa: BLE001 - websocket timeout: keep waiting
                continue
            self.events.append(msg)
            if msg.get("method") == method:
                return msg
        return None

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        self.ws.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                self.events.append(json.loads(self.ws.recv()))
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


def render_page(html_path: Path, *, screenshot: Optional[Path] = None, timeout: float = 120.0,
                settle_s: float = 2.0, width: int = 1280, height: int = 900) -> dict:
    """Open ``html_path`` in headless Chromium and report plots, console errors, requests (see module doc).

    Raises:
        FileNotFoundError: no Chromium binary.
        RuntimeError / TimeoutError: the browser did not start or the page did not load in ``timeout``.
    """
    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium binary (apt-get install chromium)")
    profile = Path(tempfile.mkdtemp(prefix="e3f-chromium-"))
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--no-default-browser-check",
           "--disable-extensions", "--disable-sync", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
           f"--window-size={width},{height}", "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    cdp = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}: "
                                   f"{proc.stderr.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(p for p in pages if p.get("type") == "page")
        cdp = _CDP(page["webSocketDebuggerUrl"], timeout=timeout)
        for domain in ("Page", "Runtime", "Log", "Network"):
            cdp.call(f"{domain}.enable")
        cdp.call("Emulation.setDeviceMetricsOverride",
                 {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        cdp.events.clear()
        cdp.call("Page.navigate", {"url": Path(html_path).resolve().as_uri()}, timeout=timeout)
        if cdp.wait_event("Page.loadEventFired", timeout) is None:
            raise TimeoutError(f"{html_path} did not finish loading in {timeout} s")
        cdp.drain(settle_s)
        plots = cdp.call("Runtime.evaluate", {"expression": _PLOTS_JS, "returnByValue": True})["result"]["value"]
        errors, requests = [], []
        for e in cdp.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append(p["entry"].get("text", ""))
            elif m == "Network.requestWillBeSent":
                url = p.get("request", {}).get("url", "")
                if not url.startswith(("file:", "data:", "about:", "blob:")):
                    requests.append(url)
        shot = None
        if screenshot is not None:
            dims = cdp.call("Runtime.evaluate", {"expression": "[document.documentElement.scrollWidth, "
                                                               "document.documentElement.scrollHeight]",
                                                 "returnByValue": True})["result"]["value"]
            h = int(min(max(dims[1], height), 16000))
            cdp.call("Emulation.setDeviceMetricsOverride",
                     {"width": width, "height": h, "deviceScaleFactor": 1, "mobile": False})
            cdp.drain(0.5)
            data = cdp.call("Page.captureScreenshot", {"format": "png"}, timeout=timeout)["data"]
            Path(screenshot).write_bytes(base64.b64decode(data))
            shot = Path(screenshot)
        return {"plots": plots, "console_errors": errors, "requests": requests, "screenshot": shot}
    finally:
        if cdp is not None:
            cdp.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)
