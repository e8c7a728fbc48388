"""scan --ray --placement: shared placement (a shared root's files read on every alive node) or the node-local
one (cli/ray.py). Shared is the local scan (cli/scan.run_scan) with the reads spread over the nodes."""

from __future__ import annotations

from collections.abc import Callable

import click

from ckpt_audit.cli.common import CommandError
from ckpt_audit.exitcodes import ExitCode

PLACEMENTS = ("auto", "node-local", "shared")


def run_if_shared(
    ctx: click.Context, roots, *, address: str, placement: str, deep: bool, run_scan: Callable, **options
) -> bool:
    """Run the scan shared and exit when `placement` is or resolves to shared; False: the caller runs node-local.
    `run_scan`: cli/scan.py's local scan body (passed in: cli.scan imports this module). Without Ray: one line,
    exit 2 (as node-local). --deep is left to node-local, which refuses it."""
    if placement == "node-local" or deep:
        return False
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.cluster import RayUnavailable, shared_reader

    try:
        reader = shared_reader(roots, address=address, placement=placement)
    except RayUnavailable as exc:
        click.echo(f"ckpt-audit: {ctx.info_name} {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    if reader is None:
        return False

    def extra() -> dict:
        return {"ray": True, "placement": placement_doc(reader)}

    run_scan(ctx, roots, deep=False, reader=reader, extra=extra, **options)
    return True  # run_scan exits; not reached


def placement_doc(reader) -> dict:
    """The JSON's view of a shared scan: who read what, and what the driver read itself."""
    return {
        "mode": "shared",
        "nodes": {
            n: {"files": t.files, "bytes": t.bytes, "handed_back": t.handed_back, "failed": t.failed}
            for n, t in sorted(reader.tally.items())
        },
        "read_by_driver": reader.read_here,
    }
