#!/usr/bin/env bash
# Launch a TP 8 SGLang GPU server with an EAGLE-3 draft and the flags the suite needs.
#   TARGET, DRAFT (required), PORT (30000), STEPS (3), TOPK (1), DRAFT_TOKENS (4),
#   HOOKS_DIR (optional: per-rank capture of the embedding before / after its all-reduce via --forward-hooks),
#   LAYERS_DIR (optional: every layer's residual stream, out(0)..out(n-1) + embedding, per rank, recorded only
#               while `python -m helpers capture --every-layer LAYERS_DIR` runs: layer identity from the server),
#   NUM_LAYERS (target num_hidden_layers; read from TARGET/config.json, text_config included, if unset),
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
if [ -n "${HOOKS_DIR:-}" ] || [ -n "${LAYERS_DIR:-}" ]; then
  N="${NUM_LAYERS:-$("$PY" -c "from helpers.formats.configs import read_target_config as r; import sys; print(r(sys.argv[1]).num_hidden_layers)" "$TARGET")}"
  # module names of the target's family (helpers.hooks.model_family: Llama, DeepSeek-V2/V3, Kimi-K2.5's language_model.)
  HOOKS="$("$PY" -c "
import json, sys
from helpers.hooks import CaptureConfig, hook_specs, model_family
from helpers.capture import every_layer_hook_specs
from helpers.formats.configs import read_target_config
t = read_target_config(sys.argv[4])
fam = model_family(t.architectures, t.model_type)
specs = []
if sys.argv[1]:
    specs += hook_specs(capture=CaptureConfig(out_dir=sys.argv[1], keys=['embedding', 'embedding_local']), num_layers=int(sys.argv[3]), family=fam)
if sys.argv[2]:
    specs += [s for s in every_layer_hook_specs(sys.argv[2], int(sys.argv[3]), fam) if s['name'] not in {x['name'] for x in specs}]
print(json.dumps(specs))
" "${HOOKS_DIR:-}" "${LAYERS_DIR:-}" "$N" "$TARGET")"
  ARGS+=(--forward-hooks "$HOOKS" --disable-cuda-graph)
fi
# shellcheck disable=SC2086
exec "$PY" -m sglang.launch_server "${ARGS[@]}" ${EXTRA:-}
