"""Errors every command reports as one line, importable without torch.

`geodiloco status` and `geodiloco health` must answer in well under a second: the CLI catches
these for every command, so their module must not pull in the training stack (importing torch
took ~7-20 s of a status call on a loaded machine)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the field."""
