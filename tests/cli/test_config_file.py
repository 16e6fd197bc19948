"""`kvdrive serve --config FILE`: the file's keys are the serve command's own flags (read from its parser,
so a flag added to `serve` is a key at once), and the command line wins over the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdrive.runtime.cli import parse_args


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_every_serve_flag_is_a_key_and_the_command_line_wins(tmp_path: Path) -> None:
    path = _config(tmp_path, "threads: 2\nfull-attention: true\ngpu_budget: 64MiB\nmax-running: 3\n")
    args = parse_args(["serve", "--config", path, "--max-running", "5"])
    assert args.threads == 2  # a key the old hand-kept list lacked
    assert args.full_attention is True
    assert args.gpu_budget == 64 << 20
    assert args.max_running == 5


@pytest.mark.parametrize(("text", "message"), [
    ("no_such_flag: 1\n", "unknown key 'no_such_flag'"),
    ("port: true\n", "port takes a value, not true/false"),
    ("host: [a, b]\n", "host needs a single value"),
    ("- a list\n", "expected a mapping"),
])
def test_a_bad_file_is_refused_with_what_is_wrong(tmp_path: Path, text: str, message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--config", _config(tmp_path, text)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
