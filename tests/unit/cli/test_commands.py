"""``python -m helpers``'s docstring and usage list every command with the cli module that implements it (issue 19)."""
from __future__ import annotations

import importlib
import re

import helpers.__main__ as entry


def test_every_command_has_its_cli_module_and_the_docstring_names_it():
    for cmd, mod in entry.COMMANDS.items():
        assert mod.startswith("helpers.cli."), mod
        assert callable(getattr(importlib.import_module(mod), "cli_main", None)), mod
        assert re.search(rf"^  {cmd}\s.*\({re.escape(mod)}\)$", entry.__doc__, re.M), f"{cmd} not in the docstring"
        assert re.search(rf"^  {cmd}\s", entry.USAGE, re.M), f"{cmd} not in the usage"
    named = re.findall(r"^  ([\w-]+)\s.*\((helpers\.[\w.]+)\)$", entry.__doc__, re.M)
    assert dict(named) == entry.COMMANDS
