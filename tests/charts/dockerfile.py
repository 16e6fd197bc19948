"""A small reader of the Dockerfile and .dockerignore, enough for the image tests.

Stages with their resolved base image and instructions (continuation lines joined, comments
dropped, global ARG defaults substituted into FROM), and the .dockerignore decision for a path
(Docker's rules: patterns are matched in order, the last match wins, ``!`` re-includes, a
pattern that matches a folder matches everything under it).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None

    def arg_defaults(self) -> dict[str, str]:
        defaults = {}
        for rest in self.all("ARG"):
            name, _, value = rest.partition("=")
            defaults[name] = value.strip('"')
        return defaults


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [line for line in lines if line.strip()]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name=name, base=base))
        elif not stages and instruction == "ARG":
            key, _, value = rest.partition("=")
            global_args[key] = value.strip('"')
        elif stages:
            stages[-1].instructions.append((instruction, rest))
    return global_args, stages


def exec_form(rest: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT/CMD."""
    import json

    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def words(command: str) -> list[str]:
    return shlex.split(command)


def ignored(patterns: list[str], path: str) -> bool:
    """Whether ``path`` (relative, with / separators) is left out of the build context."""
    result = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if pattern.startswith("**/"):
            regex = "(.*/)?" + fnmatch.translate(pattern[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            result = not negate
    return result


def dockerignore(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
