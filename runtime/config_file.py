"""``kvdrive serve --config FILE``: a YAML or JSON mapping of flag values, turned into flags.

Keys are the long flags without dashes, with ``_`` or ``-`` (``gpu_budget: 512MiB``,
``full-attention: true``). The values become command-line flags placed before the real ones, so a flag
given on the command line wins and every value goes through the same parsing and validation.
"""

from __future__ import annotations

from pathlib import Path

import yaml

SERVE_KEYS = frozenset({
    "model", "device", "dtype", "page_size", "gpu_budget", "dram_budget", "dram_hugepage_dir", "ssd_dir",
    "ssd_budget", "ssd_compression", "token_budget", "full_attention", "placement", "host", "port",
    "served_model_name", "api_key_file", "admin_token_file", "protect_metadata", "max_body_bytes", "max_running",
    "max_sequences", "max_waiting", "step_tokens", "step_seconds", "scheduling", "drain_seconds",
})
SWITCHES = frozenset({"full_attention", "protect_metadata"})  # flags without a value


class ConfigFileError(ValueError):
    """The config file cannot be read or names an unknown flag."""


def config_flags(path: str) -> list[str]:
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
        if key not in SERVE_KEYS:
            raise ConfigFileError(f"--config {path}: unknown key {raw_key!r} (known: {', '.join(sorted(SERVE_KEYS))})")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key not in SWITCHES:
                raise ConfigFileError(f"--config {path}: {raw_key} takes a value, not true/false")
            flags += [flag] if value else []
        elif value is None or isinstance(value, (dict, list)):
            raise ConfigFileError(f"--config {path}: {raw_key} needs a single value")
        else:
            flags += [flag, str(value)]
    return flags
