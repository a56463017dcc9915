"""Command line: argument parsing and exit codes only; each command module calls the library and maps its errors."""
