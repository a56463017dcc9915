"""The draft checkpoint offline: the parameters SGLang builds from its config and where each tensor loads (params),
its forward as SGLang runs it (model), simulated drafting and verification (simulate), checks that need no server
(checks), training logs (training_log) and the acceptance budget (budget)."""
