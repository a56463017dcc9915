"""The draft checkpoint offline: its forward as SGLang runs it (model), simulated drafting and verification
(simulate), checks that need no server (checks), training logs (training_log) and the acceptance budget (budget)."""
