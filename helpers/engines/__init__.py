"""One adapter per serving engine behind one seam (DESIGN.md "Engines"): detect the engine and version of a server
from its own endpoints, start and stop an embedded reference server, read the effective speculative config, the
acceptance counters and the aux hidden states the engine feeds its EAGLE-3 draft.

* :mod:`.base` -- the :class:`~helpers.engines.base.EngineAdapter` contract and its typed results;
* :mod:`.detect` -- which engine a URL is (one line and exit 2 for neither, or a version whose rules are unknown);
* :mod:`.sglang` -- SGLang (the existing ``helpers.server`` / ``helpers.capture`` code behind the contract);
* :mod:`.vllm` -- vLLM: the client contract (:class:`~helpers.engines.vllm.VLLMClient`) and the adapter;
* :mod:`.vllm_answers` -- a completion as SGLang's ``meta_info`` / a per-request row, the ``/metrics`` counters;
* :mod:`.vllm_capture` -- the served samples assembled from the worker extension's records;
* :mod:`.vllm_rules` -- vLLM's id rules, loader rules and ablation toggles as the objects the engine-neutral code calls;
* :mod:`.vllm_server` -- the embedded vLLM CPU reference server (``env/vllm/install.sh``), a rewritten launch command;
* :mod:`.vllm_worker` -- runs inside vLLM's workers (``--worker-extension-cls``): what the engine loaded, capture.

Nothing is imported here, so ``helpers.engines.vllm_worker`` imports inside the vLLM venv without the suite's
dependencies.
"""
