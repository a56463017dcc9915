"""Command line: argument parsing, progress lines and exit codes only; every command calls the library and runs under
the one error contract of :mod:`.common` (one line ``<command>: error: ...``, exit 2 bad input, 1 server or run
failure)."""
