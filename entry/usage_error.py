"""How every ``sluice`` command refuses bad input: ``error: ...`` on stderr, exit status 2."""

from __future__ import annotations

import typer


def usage_error(message: str) -> typer.Exit:
    """Print ``message`` as the command's error; the caller raises the returned Exit, so the
    refusal reads as control flow at the call site (``raise usage_error(...)``)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)
