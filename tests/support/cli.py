"""The `sluice` CLI run in-process (typer's runner), as the CLI tests drive it."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from entry.cli import app


def invoke(runner: CliRunner, *args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_error(result: Result, *fragments: str) -> None:
    """A usage error: exit status 2, one ``error:`` line naming each fragment, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
