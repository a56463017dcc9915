#!/usr/bin/env bash
# Install the dedicated SGLang server environment for the embedded CPU reference server.
#
#   env/reference/install.sh            # creates env/reference/.venv (git-ignored)
#   SGLANG_VENV=/path/to/venv env/reference/install.sh
#
# What it does (each step is logged; a failing step names what is missing):
#   1. a venv with torch 2.13.0 (CPU) and triton 3.8.0 (imported by SGLang at module level),
#   2. sglang==0.5.23 --no-deps (its Requires-Dist pulls the CUDA stack), torchvision 0.28.0,
#      apache-tvm-ffi, then the minimal set of modules SGLang's CPU path imports,
#   3. the torchvision import fix (fix_torchvision.py),
#   4. the pure-torch sgl_kernel stand-in (env/reference/standin) on the venv's path via a .pth,
#   5. this project (--no-deps, editable) so SGLang's --forward-hooks can import helpers.hooks,
#   6. a smoke import of everything above with the env vars the launcher sets.
# Idempotent: a stamp file records a hash of this script; a re-run with the same script and a
# working venv only re-checks (step 6).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${SGLANG_VENV:-$HERE/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.e3f-install-stamp"

log() { printf '[install-sglang] %s\n' "$*" >&2; }
die() { printf '[install-sglang] ERROR: %s\n' "$*" >&2; exit 1; }
step() {  # step "what" cmd...
  local what="$1"; shift
  log "$what"
  "$@" || die "step failed: $what (command: $*)"
}

command -v "$PY" >/dev/null || die "no Python interpreter '$PY' (set PYTHON=...); Python 3.11 is expected"
"$PY" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null \
  || die "$PY is older than Python 3.10; SGLang 0.5.23 wheels need Python 3.10+ (3.11 tested)"
"$PY" -c 'import venv, ensurepip' 2>/dev/null || die "$PY lacks venv/ensurepip (Debian: apt-get install python3-venv)"

HASH="$(cat "$HERE/install.sh" "$HERE/fix_torchvision.py" | sha256sum | cut -c1-16)"
smoke() {
  SGLANG_USE_CPU_ENGINE=1 E3F_STANDIN_AMX=1 "$VENV/bin/python" - <<'PY'
import importlib, sys
for mod in ("torch", "triton", "sglang", "torchvision.transforms", "sgl_kernel", "helpers"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001
        sys.exit(f"cannot import {mod}: {type(exc).__name__}: {exc}")
import sglang, torch, sgl_kernel
from sglang.srt.utils.common import cpu_has_amx_support
if not getattr(sgl_kernel, "STANDIN", False):
    sys.exit("sgl_kernel is not the project's stand-in (another sgl_kernel shadows it)")
if not cpu_has_amx_support():
    sys.exit("SGLang does not select the intel_amx path (stand-in ops or boot hook missing)")
print(f"sglang {sglang.__version__}, torch {torch.__version__}, sgl_kernel stand-in OK")
PY
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && [ -x "$VENV/bin/python" ]; then
  log "already installed ($VENV); checking"
  smoke && exit 0
  log "check failed; reinstalling"
fi

[ -x "$VENV/bin/python" ] || step "create venv $VENV" "$PY" -m venv "$VENV"
P="$VENV/bin/python"
PIP=("$P" -m pip install --disable-pip-version-check -q)
step "upgrade pip" "${PIP[@]}" --upgrade pip
step "torch 2.13.0 (CPU) + triton 3.8.0" "${PIP[@]}" torch==2.13.0 triton==3.8.0
"$P" -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ or not torch.cuda.is_available() else 1)' \
  || die "torch in $VENV is not a CPU build; remove the venv and make sure torch==2.13.0+cpu is reachable"
step "sglang 0.5.23 without its CUDA dependency tree" \
  "${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0 apache-tvm-ffi==0.1.11
log "note: pip's resolver will now print an ERROR listing sglang requirements that are not installed"
log "      (cuda-python, flashinfer, ...): expected, the CPU path does not import them; the smoke import decides"
step "modules SGLang's CPU path imports" "${PIP[@]}" \
  transformers==5.19.0 tokenizers==0.23.2 fastapi "uvicorn>=0.51" uvloop pyzmq orjson msgspec psutil \
  setproctitle pydantic requests aiohttp numpy pybase64 python-multipart prometheus-client interegular \
  partial_json_parser packaging einops tqdm safetensors sentencepiece==0.2.1 tiktoken openai==2.8.0 \
  pillow scipy xxhash zstandard watchfiles distro regex "python-dateutil<3" ipython dill \
  compressed-tensors==0.18.0 gguf jsonschema xgrammar==0.2.7 soundfile==0.13.1 httpx pyyaml
step "torchvision import fix" "$P" "$HERE/fix_torchvision.py"
SITE="$("$P" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
log "sgl_kernel stand-in -> $SITE/e3f_standin.pth"
printf '%s\nimport e3f_boot\n' "$HERE/standin" > "$SITE/e3f_standin.pth"
step "this project (editable, no deps) for --forward-hooks" "${PIP[@]}" --no-deps -e "$ROOT"
step "smoke import" smoke
echo "$HASH" > "$STAMP"
log "done: $VENV"
