"""Running ``modelrunner.cli.main`` in-process as if a distribution were not installed (tests of the
subcommands that other distributions declare through entry points)."""

from __future__ import annotations

import pytest

from modelrunner import cli


def hide_distribution(monkeypatch: pytest.MonkeyPatch, dist: str) -> None:
    """Make the CLI see the installed entry points except ``dist``'s (as if it were not installed)."""
    real = cli.entry_points

    def visible(**selection):
        return [ep for ep in real(**selection) if ep.dist is None or ep.dist.name != dist]

    monkeypatch.setattr(cli, "entry_points", visible)


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``modelrunner ARGV`` run in this process."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
