#!/usr/bin/env bash
# Launch a TP 8 SGLang GPU server with an EAGLE-3 draft and the flags the suite needs.
#   TARGET, DRAFT (required), PORT (30000), STEPS (3), TOPK (1), DRAFT_TOKENS (4),
#   HOOKS_DIR (optional: per-rank capture of embedding / layer outputs via --forward-hooks),
#   NUM_LAYERS (target num_hidden_layers; read from TARGET/config.json if unset),
#   PYTHON (python of the SGLang environment), EXTRA (more flags).
set -euo pipefail
: "${TARGET:?set TARGET to the target model path}"
: "${DRAFT:?set DRAFT to the EAGLE-3 draft path}"
PORT="${PORT:-30000}"; STEPS="${STEPS:-3}"; TOPK="${TOPK:-1}"; DRAFT_TOKENS="${DRAFT_TOKENS:-4}"
PY="${PYTHON:-python3}"
ARGS=(--model-path "$TARGET" --tp-size 8 --host 0.0.0.0 --port "$PORT"
      --speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT"
      --speculative-num-steps "$STEPS" --speculative-eagle-topk "$TOPK"
      --speculative-num-draft-tokens "$DRAFT_TOKENS"
      --enable-return-hidden-states --enable-metrics)
if [ -n "${HOOKS_DIR:-}" ]; then
  N="${NUM_LAYERS:-$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]+'/config.json'))['num_hidden_layers'])" "$TARGET")}"
  HOOKS="$("$PY" -c "
import json, sys
from helpers.hooks import CaptureConfig, hook_specs
print(json.dumps(hook_specs(capture=CaptureConfig(out_dir=sys.argv[1], keys=['embedding', 'embedding_local']), num_layers=int(sys.argv[2]))))
" "$HOOKS_DIR" "$N")"
  ARGS+=(--forward-hooks "$HOOKS" --disable-cuda-graph)
fi
# shellcheck disable=SC2086
exec "$PY" -m sglang.launch_server "${ARGS[@]}" ${EXTRA:-}
