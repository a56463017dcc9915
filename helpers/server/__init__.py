"""Everything about talking to and running SGLang servers.

* :mod:`.client` -- the HTTP client (:class:`~helpers.server.client.SGLangClient`): probe, generate, flush,
  metrics, effective speculative config, with deadlines and the API key kept out of every message;
* :mod:`.protocol` -- typed models of the answers (``/generate`` ``meta_info``);
* :mod:`.settings` -- speculative settings in one shape, launch-argument parsing, SGLang's silent overrides;
* :mod:`.redaction` -- secrets out of answers, commands and URLs;
* :mod:`.process` -- one managed server process (start, log pump, stop by PID, swept at exit);
* :mod:`.embedded` -- the embedded reference server (real SGLang 0.5.23 on CPU);
* :mod:`.registry` -- state files of the servers this tool started (so ``investigate`` can restart one with a fix).
"""
