"""The `seq2seq` command line: each command parses options, loads the config and calls one library function.

Every command runs inside the error boundary of boundary.py (`user_errors`): one line per
problem, exit 2 for bad input, never a traceback unless --debug. The commands live by what they
do: train_commands.py, translate_commands.py, ship_commands.py; app.py holds the application.
"""

from __future__ import annotations

import importlib

from seq2seq.cli.app import app

__all__ = ["app", "main"]

# Importing a module registers its commands; `seq2seq --help` lists them in this order.
for module in ("train_commands", "translate_commands", "ship_commands"):
    importlib.import_module(f"seq2seq.cli.{module}")


def main() -> None:
    app()
