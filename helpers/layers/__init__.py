"""The layer vocabulary, the bottom of ``helpers`` (it imports nothing of the package; formats, server and diagnosis
all read it):

* :mod:`.ids` -- physical tensor names (``embedding``, ``out(L)``, ``final_norm``) and layer ids with their
  convention (SGLang capture index, SpecForge, vLLM, EAGLE, HF);
* :mod:`.sglang` -- SGLang release facts: version parsing, the per-architecture id rules and EAGLE-3 draft classes
  generated from the installed release (``data/sglang-<version>-eagle3.json``), the target family.
"""
