"""``kvdrive serve --config FILE``: a YAML or JSON mapping of flag values, turned into flags.

Keys are the long flags without dashes, with ``_`` or ``-`` (``gpu_budget: 512MiB``,
``full-attention: true``). The values become command-line flags placed before the real ones, so a flag
given on the command line wins and every value goes through the same parsing and validation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


class ConfigFileError(ValueError):
    """The config file cannot be read or names an unknown flag."""


def options_of(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The flags a config file may set: each option's dest -> whether it is a switch (takes no value).
    Read from the command's own parser, so that every flag it gains is known here too."""
    return {a.dest: a.nargs == 0 for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config", "version")}


def config_flags(path: str, options: dict[str, bool]) -> list[str]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"--config {path}: {exc}") from exc
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in options:
            raise ConfigFileError(f"--config {path}: unknown key {raw_key!r} (known: {', '.join(sorted(options))})")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if not options[key]:
                raise ConfigFileError(f"--config {path}: {raw_key} takes a value, not true/false")
            flags += [flag] if value else []
        elif value is None or isinstance(value, (dict, list)):
            raise ConfigFileError(f"--config {path}: {raw_key} needs a single value")
        else:
            flags += [flag, str(value)]
    return flags
