#!/usr/bin/env bash
# Set up the three environments (idempotent):
#   .venv                  the suite: helpers/, notebooks, tests (torch CPU, pandas, plotly, papermill...)
#   env/reference/.venv    the embedded SGLang 0.5.23 CPU server (env/reference/install.sh)
#   env/vllm/.venv         the embedded vLLM 0.32.0 CPU server (env/vllm/install.sh)
# VLLM_EXTRA=0.29.0 also builds that vLLM release in env/vllm/.venv-0.29.0 (env/vllm/README.md "Other releases").
# SUITE_VENV / SGLANG_VENV / VLLM_VENV override the locations. SKIP_SGLANG=1 / SKIP_VLLM=1 skip a server
# environment (neither is needed to attach to a remote GPU server or to run the offline diagnosis).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUITE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.e3f-setup-stamp"
log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no Python interpreter '$PY' (set PYTHON=...)"
# The two server environments install beside the suite's (three pip runs at once: on 2 cores ~40 % less wall time
# than one after the other; each script logs with its own prefix and has its own venv and stamp).
if [ -n "${VLLM_EXTRA:-}" ]; then   # refused before any install starts
  [ "$VLLM_EXTRA" != "0.32.0" ] || die "VLLM_EXTRA=0.32.0 is the release env/vllm/.venv always gets; VLLM_EXTRA names an older one (env/vllm/README.md, \"Other releases\")"
  VLLM_VERSION="$VLLM_EXTRA" "$ROOT/env/vllm/install.sh" --check-version || die "VLLM_EXTRA=$VLLM_EXTRA: not a release env/vllm/install.sh builds"
fi
declare -A JOBS=()
if [ "${SKIP_SGLANG:-0}" != "1" ]; then
  "$ROOT/env/reference/install.sh" & JOBS[env/reference/install.sh]=$!
fi
if [ "${SKIP_VLLM:-0}" != "1" ]; then
  VLLM_VERSION=0.32.0 "$ROOT/env/vllm/install.sh" & JOBS[env/vllm/install.sh]=$!
fi
if [ -n "${VLLM_EXTRA:-}" ]; then   # an older vLLM release beside it, only when asked: VLLM_EXTRA=0.29.0
  env -u VLLM_VENV VLLM_VERSION="$VLLM_EXTRA" "$ROOT/env/vllm/install.sh" & JOBS["env/vllm/install.sh $VLLM_EXTRA"]=$!
fi
HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/env/setup.sh" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && "$VENV/bin/python" -c 'import helpers, torch, papermill, plotly' 2>/dev/null; then
  log "suite environment up to date ($VENV)"
else
  [ -x "$VENV/bin/python" ] || { log "create venv $VENV"; "$PY" -m venv "$VENV"; }
  P="$VENV/bin/python"
  log "upgrade pip"; "$P" -m pip install --disable-pip-version-check -q --upgrade pip
  # torch first, pinned to the CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
  log "torch 2.13.0 (CPU)"; "$P" -m pip install --disable-pip-version-check -q torch==2.13.0 \
    || die "could not install torch==2.13.0 (CPU wheel); on another machine install a CPU torch first"
  log "eagle3-forensics and its dependencies (pyproject.toml)"
  "$P" -m pip install --disable-pip-version-check -q -e "$ROOT" || die "pip install -e $ROOT failed"
  "$P" -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 || true
  echo "$HASH" > "$STAMP"
fi
failed=()
for job in "${!JOBS[@]}"; do
  wait "${JOBS[$job]}" || failed+=("$job")
done
[ ${#failed[@]} -eq 0 ] || die "failed: ${failed[*]} (its log lines above say which step)"
log "ready: suite $VENV"
