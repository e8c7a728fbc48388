"""Pieces every command shares: catalog location, --json rendering, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ckpt_audit.exitcodes import ExitCode

SCHEMA_VERSION = 1
CATALOG_ENV = "CKPT_AUDIT_CATALOG"


def default_catalog_path() -> Path:
    """$CKPT_AUDIT_CATALOG, else $XDG_DATA_HOME/ckpt-audit/catalog.db (~/.local/share/ckpt-audit/catalog.db)."""
    if env := os.environ.get(CATALOG_ENV):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ckpt-audit" / "catalog.db"


catalog_option = click.option(
    "--catalog",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"SQLite catalog (default: ${CATALOG_ENV} or ~/.local/share/ckpt-audit/catalog.db).",
)


def resolve_catalog(path: Path | None) -> Path:
    return path if path is not None else default_catalog_path()


def emit_json(document: dict) -> None:
    click.echo(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2, sort_keys=False))


class CommandError(click.ClickException):
    """A one-line error with exit code 3."""

    exit_code = int(ExitCode.ERROR)

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        click.echo(f"ckpt-audit: error: {self.format_message()}", err=True)
