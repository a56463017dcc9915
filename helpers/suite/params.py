"""The suite's params file (YAML, validated with pydantic; every field documented in ``env/cases/main.yaml``):
which notebooks, which server (managed, attached or none), the model paths and per-notebook parameters.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInput, BadParams, CaseError
from ..investigation.cases import load_case
from ..paths import NOTEBOOK_DIR, ROOT
from ..runfiles import load_yaml_model, load_yaml_text
from ..redaction import has_url_credentials, url_secrets
from ..server.client import check_url
from ..server.listener_flags import refuse_listener_flags
from ..server.restart import relaunch_argv
from ..server.settings import SpecSettings

DEFAULT_NOTEBOOKS = ["00_replay", "00_investigate", "01_attach", "02_dump", "03_compare", "10_hyp_tp_sharding",
                     "11_hyp_embedding_allreduce", "12_hyp_layer_offset", "20_acceptance",
                     "21_ablate", "99_postmortem"]


POSTMORTEM = "99_postmortem"


REPLAY = "00_replay"


INVESTIGATE = "00_investigate"


#: notebooks that read what another one wrote (run after it)
NEEDS = {"03_compare": ["02_dump"], "10_hyp_tp_sharding": ["02_dump"],
         "11_hyp_embedding_allreduce": ["02_dump"], "12_hyp_layer_offset": ["02_dump", "03_compare"]}


class ManagedServer(BaseModel):
    """The embedded reference server the runner starts (helpers.server.embedded.start)."""

    model_config = ConfigDict(extra="forbid")
    target: str = Field("env/models/target", min_length=1)
    draft: Optional[str] = "env/models/draft"
    tp: int = Field(2, ge=1)
    spec: SpecSettings = Field(default_factory=lambda: SpecSettings(num_steps=3, topk=1, num_draft_tokens=4))
    faults: list[dict[str, Any]] = Field(default_factory=list)
    extra_args: list[str] = Field(default_factory=list)
    timeout: float = Field(600.0, gt=0)


class ServerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: Optional[str] = None
    api_key_env: str = "SGLANG_API_KEY"
    managed: Optional[ManagedServer] = None


class SuiteParams(BaseModel):
    """Validated suite params file (YAML). See env/cases/main.yaml for a documented example.

    Fields: ``name`` (run folder suffix), ``server`` (``url`` | ``managed``, ``api_key_env``),
    ``case`` (case file replayed by 00_replay), ``target_dir`` / ``draft_dir`` / ``training_data``
    (live notebooks), ``notebooks`` (order), ``notebook_dir`` (default ``notebooks/``), ``common`` and
    ``notebook_params`` (papermill parameters), ``timeout_per_notebook`` (s), ``jobs`` and ``needs``
    (concurrency of the views). Relative paths: repository root first, then the params file's folder.
    """

    model_config = ConfigDict(extra="forbid")
    name: str = "postmortem"
    server: ServerParams = Field(default_factory=ServerParams)
    case: Optional[str] = None
    target_dir: Optional[str] = None
    draft_dir: Optional[str] = None
    training_data: Optional[str] = None
    notebooks: list[str] = Field(default_factory=lambda: list(DEFAULT_NOTEBOOKS), min_length=1)
    notebook_dir: Optional[str] = None
    common: dict[str, Any] = Field(default_factory=dict)
    notebook_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    timeout_per_notebook: int = Field(1200, ge=10)
    jobs: int = Field(2, ge=1, le=16)
    needs: dict[str, list[str]] = Field(default_factory=lambda: {k: list(v) for k, v in NEEDS.items()})

    def notebook_path(self, name: str) -> Path:
        return (Path(self.notebook_dir) if self.notebook_dir else NOTEBOOK_DIR) / f"{name}.ipynb"


def _resolve(value: Optional[str], params_dir: Path) -> Optional[Path]:
    """A path from a params file: absolute; else relative to the repository root when it exists there,
    else relative to the params file's folder."""
    if not value:
        return None
    p = Path(os.path.expanduser(value))
    if p.is_absolute():
        return p
    for base in (ROOT, params_dir):
        if (base / p).exists():
            return (base / p).resolve()
    return (ROOT / p).resolve()


#: the main job's params (``make postmortem``): a case file given as ``--params`` runs with these
MAIN_PARAMS = ROOT / "env" / "cases" / "main.yaml"


def _case_as_params(path: Path):
    """``prepare`` for :func:`load_yaml_model`: a case file (a mapping with a ``timeline``) given where a params
    file is expected becomes the main job's params (:data:`MAIN_PARAMS`) with that case and the case's name, so
    ``suite run --params env/cases/<case>.yaml`` runs the main job on any case."""

    def prepare(data: Any) -> Any:
        if not (isinstance(data, dict) and "timeline" in data):
            return data
        base = load_yaml_text(MAIN_PARAMS.read_text(encoding="utf-8"), "params file", path=MAIN_PARAMS,
                              error=BadParams) or {}
        return {**base, "name": str(data.get("name") or path.stem), "case": str(path.resolve())}

    return prepare


#: notebook parameters the runner sets itself (where the notebooks write, what relative paths mean): a params file's
#: ``common`` / ``notebook_params`` may not set them, so that a run writes into its own run folder only
RUNNER_PARAMETERS = ("run_dir", "repo_root")


def plain_name(path: Path, field: str, name: Any) -> str:
    """``name`` when it is a plain file-name stem (a notebook's name): a non-empty string, no ``/`` or ``\\``, not
    ``.`` / ``..``, no NUL, no leading ``-`` -- so that ``<folder>/<name>.ipynb`` and ``<run>/html/<name>.html`` stay
    in their folders.

    Raises:
        BadParams: naming the params file and ``field``."""
    text = str(name)
    if (not isinstance(name, str) or not text.strip() or text in (".", "..") or "/" in text or "\\" in text
            or "\x00" in text or text.startswith("-")):
        raise BadParams(f"params file {path}: field '{field}': {text[:80]!r} is not a notebook name (a plain name "
                        "such as 20_acceptance: no '/', no '..', not absolute)")
    return text


def _strings(value: Any, where: str):
    """``(field, string)`` for every string value held in ``value`` (mappings and lists, nested), ``field`` as
    ``where.key[0].key``."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")


def refuse_url_credentials(path: Path, field: str, value: Any) -> None:
    """Refuse a URL with credentials (``scheme://user:pw@host``: :func:`helpers.redaction.has_url_credentials`) in any
    string of ``value`` (nested): papermill writes a notebook's parameters into its executed copy.

    Raises:
        BadParams: naming the params file and the field (``common.server_url``, ``notebook_params.01_attach.x[0]``),
            the value not shown."""
    for where, text in _strings(value, field):
        if has_url_credentials(text):
            raise BadParams(f"params file {path}: field '{where}': credentials in a URL (user:password@) would be "
                            "written into every executed notebook (papermill records its parameters); give the "
                            "address without them (an API key goes through server.api_key_env)")


def _must_exist(path: Path, field: str, value: str, folder: bool = False) -> None:
    """BadParams naming the params file and ``field`` when the resolved path ``value`` does not exist (is not a
    folder, with ``folder``)."""
    if not Path(value).exists() or (folder and not Path(value).is_dir()):
        raise BadParams(f"params file {path}: field '{field}': {value} not found{' as a folder' if folder else ''}")


def load_params(path: str | os.PathLike) -> SuiteParams:
    """Read and validate a suite params YAML file, or a case file (:func:`_case_as_params`: the main job's params
    with that case).

    Read with the suite's one YAML loader (:func:`helpers.runfiles.load_yaml_model`).

    Raises:
        BadParams: file missing, not YAML, or a field invalid (the message names the file and the field): a model
            or data folder (``target_dir``, ``draft_dir``, ``training_data``, ``server.managed.target`` / ``draft``,
            the case's ``models.*``) that does not exist, a ``server.url`` that is not http(s):// or carries
            credentials (papermill writes its parameters into every executed notebook), as any string of ``common``
            / ``notebook_params`` may not (:func:`refuse_url_credentials`), a speculative setting below
            1; a notebook name (``notebooks``, ``needs``, ``notebook_params``) that is not a plain name
            (:func:`plain_name`); ``run_dir`` / ``repo_root`` in ``common`` or ``notebook_params``
            (:data:`RUNNER_PARAMETERS`); a listener flag in ``server.managed.extra_args``
            (:func:`helpers.server.listener_flags.refuse_listener_flags`); a ``relaunch`` of ``common`` /
            ``notebook_params.00_investigate`` that ``investigate --relaunch`` would refuse
            (:func:`helpers.server.restart.relaunch_argv`: a listener flag other than the exact --host / --port).
    """
    path = Path(path)
    params = load_yaml_model(path, SuiteParams, what="params file", error=BadParams, prepare=_case_as_params(path))
    for i, nb in enumerate(params.notebooks):
        plain_name(path, f"notebooks[{i}]", nb)
    for key, names in params.needs.items():
        plain_name(path, "needs", key)
        for nb in names:
            plain_name(path, f"needs.{key}", nb)
    for key, values in [("common", params.common)] + [(f"notebook_params.{plain_name(path, 'notebook_params', k)}",
                                                       v) for k, v in params.notebook_params.items()]:
        for name in RUNNER_PARAMETERS:
            if name in values:
                raise BadParams(f"params file {path}: field '{key}.{name}': the runner sets {name} itself (the "
                                "notebooks write into the run folder only); leave it out")
        refuse_url_credentials(path, key, values)
        if key in ("common", f"notebook_params.{INVESTIGATE}") and values.get("relaunch"):
            if not isinstance(values["relaunch"], str):
                raise BadParams(f"params file {path}: field '{key}.relaunch': the server's launch command as one "
                                f"string, got {type(values['relaunch']).__name__}")
            try:            # 00_investigate's fixed copy: the same checks as investigate --relaunch, before any run
                relaunch_argv(values["relaunch"])
            except BadInput as exc:
                raise BadParams(f"params file {path}: field '{key}.relaunch': {exc.message}") from None
    for key in ("case", "target_dir", "draft_dir", "training_data", "notebook_dir"):
        if getattr(params, key) is not None and not str(getattr(params, key)).strip():
            raise BadParams(f"params file {path}: field '{key}' is empty (leave it out, or name a path)")
    if params.server.url is None and params.server.managed is None and params.case is None:
        raise BadParams(f"params file {path}: set case (replay a case file), server.url (attach) or "
                        "server.managed (start the embedded reference server)")
    here = path.resolve().parent
    if params.notebook_dir:
        params.notebook_dir = str(_resolve(params.notebook_dir, here))
    for key in ("target_dir", "draft_dir", "training_data"):
        if getattr(params, key):
            setattr(params, key, str(_resolve(getattr(params, key), here)))
            _must_exist(path, key, getattr(params, key))
    url = params.server.url
    if url is not None:
        try:
            check_url(url)
        except BadInput as exc:
            raise BadParams(f"params file {path}: field 'server.url': {exc.message} "
                            "(e.g. http://127.0.0.1:30000)") from None
        if url_secrets(url):
            raise BadParams(f"params file {path}: field 'server.url': credentials in the URL (user:password@) would "
                            "be written into every executed notebook (papermill records its parameters); give the "
                            "address without them (an API key goes through server.api_key_env)")
    if params.server.managed is not None:
        m = params.server.managed
        try:
            refuse_listener_flags(m.extra_args, "sglang", where="server.managed.extra_args")
        except BadInput as exc:
            raise BadParams(f"params file {path}: field 'server.managed.extra_args': {exc.message}") from None
        for key in ("target", "draft"):
            if getattr(m, key):
                _must_exist(path, f"server.managed.{key}", str(_resolve(getattr(m, key), here)), folder=True)
    if params.case:

        case = _resolve(params.case, here)
        if not case.exists():
            raise BadParams(f"params file {path}: field 'case': case file {params.case} not found "
                            f"(looked in {ROOT} and {here})")
        try:
            c = load_case(case)
        except CaseError as exc:
            raise BadParams(f"params file {path}: field 'case': {exc}") from None
        for key in ("target", "draft", "training_data"):     # a case's models: repository-relative (Case.resolve)
            if getattr(c.models, key):
                where = c.resolve(getattr(c.models, key))
                if not where.is_dir():
                    raise BadParams(f"case file {case}: field 'models.{key}': {getattr(c.models, key)} not found "
                                    f"as a folder (looked at {where})")
        params.case = str(case)
    missing = [nb for nb in params.notebooks if not params.notebook_path(nb).exists()]
    if missing:
        raise BadParams(f"params file {path}: field 'notebooks': no notebook {missing} in "
                        f"{params.notebook_path('x').parent}")
    given = params.needs if "needs" in params.model_fields_set else {}      # the defaults name the shipped notebooks
    unknown = sorted(n for n in {n for k, v in given.items() for n in [k, *v]}
                     if n not in params.notebooks and not params.notebook_path(n).exists())
    if unknown:
        raise BadParams(f"params file {path}: field 'needs': no notebook {unknown} in "
                        f"{params.notebook_path('x').parent}")
    if given:          # a given entry replaces that notebook's default needs; the other defaults stay
        params.needs = {**{k: list(v) for k, v in NEEDS.items()}, **{k: list(v) for k, v in given.items()}}
    cycle = _needs_cycle(params.needs)
    if cycle:
        raise BadParams(f"params file {path}: field 'needs': a cycle {' -> '.join(cycle)} (no notebook of it could "
                        "ever start)")
    return params


def _needs_cycle(needs: dict[str, list[str]]) -> Optional[list[str]]:
    """A cycle in the ``needs`` graph (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> Optional[list[str]]:
        state[n] = 1
        stack.append(n)
        for m in needs.get(n, []):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in list(needs):
        if state.get(n) is None and (c := visit(n)):
            return c
    return None
