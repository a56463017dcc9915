"""Credentials in a server URL (``http://user:secret@host``, issue 40) are never written anywhere -- run-folder
names, records, logs, pages, stdout, stderr -- and are shown redacted where the URL is echoed: an investigation, a
compare-engines run and an ablation against a fake server on 127.0.0.1 (tests/support/fakeserver.py), every path and every byte
they leave searched for the password."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest

from helpers.redaction import REDACTED, remember_url, scrub, scrub_bytes, url_label, url_secrets

from support.fakerun import run_cli, write_models, write_training
from support.fakeserver import fake_server

PASSWORD = "s3cr3t-pw-9f1c"


def test_scrub_hides_the_userinfo_of_any_url_whatever_its_length():
    text = 'GET http://u:p@127.0.0.1:8/x, "https://user:%40w@h:1" and git@github.com ssh://git@h/r'
    assert scrub(text) == (f'GET http://{REDACTED}@127.0.0.1:8/x, "https://{REDACTED}@h:1" and git@github.com '
                           f'ssh://{REDACTED}@h/r')
    assert scrub("http://user:p@ss@host:1/") == f"http://{REDACTED}@host:1/"      # an unencoded @ in the password
    assert scrub_bytes(b"url=http://a:bcd@h") == f"url=http://{REDACTED}@h".encode()


def test_url_secrets_and_label():
    url = f"http://al%40ice:{PASSWORD}@127.0.0.1:8000/v1?token=x"
    found = url_secrets(url)
    assert f"al%40ice:{PASSWORD}" in found and PASSWORD in found
    assert base64.b64encode(f"al@ice:{PASSWORD}".encode()).decode() in found      # the Basic header's token
    assert url_secrets("http://127.0.0.1:8000") == []
    assert url_label(url) == "127.0.0.1-8000/v1" and url_label("http://127.0.0.1:9") == "127.0.0.1-9"
    remember_url(url)
    assert PASSWORD not in scrub(f"the server said: bad password {PASSWORD}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    target, draft = write_models(out)
    return {"target": target, "draft": draft, "training": write_training(out / "train")}


def _leaks(folder: Path) -> list[str]:
    """Every path under ``folder`` whose name, or file whose bytes, hold the password or the user:password pair."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if PASSWORD in rel or "user-s3cr3t" in rel:
            out.append(f"name {rel}")
        elif p.is_file() and (PASSWORD.encode() in p.read_bytes()):
            out.append(f"bytes {rel}")
    return out


def test_an_investigation_and_a_comparison_keep_no_password(models, tmp_path):
    with fake_server("ok") as url, fake_server("ok") as url_b:
        cred = url.replace("http://", f"http://user:{PASSWORD}@")
        cred_b = url_b.replace("http://", f"http://user:{PASSWORD}@")     # --a equal to --b is refused up front
        inv = ["investigate", "--url", cred, "--training", str(models["training"]), "--target",
               str(models["target"]), "--draft", str(models["draft"]), "--out", str(tmp_path / "inv"), "--prompts",
               "2", "--max-new-tokens", "4", "--timeout", "120", "--no-apply"]
        rc_inv, _ = run_cli(inv, tmp_path, name="investigate", timeout=200)
        cmp = ["compare-engines", "--a", cred, "--b", cred_b, "--training", str(models["training"]), "--out",
               str(tmp_path / "cmp"), "--prompts", "2", "--max-new-tokens", "4", "--samples", "1", "--timeout", "120"]
        rc_cmp, _ = run_cli(cmp, tmp_path, name="compare", timeout=200)
        abl = ["ablate", "--url", cred, "--sweeps", "concurrency", "--concurrency", "1,2", "--toggles", "none",
               "--num-prompts", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "abl")]
        rc_abl, _ = run_cli(abl, tmp_path, name="ablate", timeout=200)
    assert rc_inv in (0, 1) and rc_cmp in (0, 1, 2) and rc_abl == 0, (rc_inv, rc_cmp, rc_abl)
    (run,) = (tmp_path / "inv").iterdir()
    port = url.rsplit(":", 1)[1]
    assert run.name.endswith(f"-investigate-127.0.0.1-{port}"), run.name
    doc = (run / "investigation.json").read_text()
    assert f"http://{REDACTED}@127.0.0.1:{port}" in doc                  # the URL is recorded, redacted
    (abl_run,) = (tmp_path / "abl").iterdir()
    assert abl_run.name.endswith(f"-ablate-127.0.0.1-{port}"), abl_run.name
    shown = [ln for ln in (tmp_path / "compare.stderr").read_text().splitlines() if "run folder" in ln]
    ports = {port, url_b.rsplit(":", 1)[1]}
    assert shown and any(shown[0].endswith(f"-compare-engines-127.0.0.1-{p}") for p in ports), shown  # (removed when left empty)
    # stdout / stderr of both commands are files of tmp_path too
    assert (tmp_path / "investigate.stderr").read_text().strip()
    assert _leaks(tmp_path) == []
