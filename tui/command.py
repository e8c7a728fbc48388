"""`ckpt-audit tui`: the interactive front end (textual is imported only when this command runs)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, catalog_option, resolve_catalog


@click.command("tui")
@catalog_option
@click.argument("roots", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
def tui(catalog: str | None, roots: tuple[Path, ...]) -> None:
    """Browse runs and checkpoints, inspect findings, prune with a live plan, export to HuggingFace.

    With ROOTs it scans them first (in the background, reusing catalogued hashes); without, it shows
    what the catalog holds. Press ? inside for every key.

    \b
    Example:
        ckpt-audit tui /ckpts                 # scan /ckpts, then browse it
        ckpt-audit tui --catalog ./cat.db     # browse what a cron scan recorded
    """
    for root in roots:
        if not root.is_dir():
            raise CommandError(f"{root}: not a directory")
    try:
        from tui.app import AuditApp
    except ImportError as exc:  # textual missing from this install
        raise CommandError(f"the TUI needs textual: {exc}") from exc
    AuditApp(catalog_path=Path(resolve_catalog(catalog)), roots=[str(r) for r in roots]).run()
