"""`ckpt-audit compare A B`: B is an exact copy of A (a copy-out or a restore), file by file, without downloads."""

from __future__ import annotations

import click

from ckpt_audit.cli.common import CommandError, emit_json
from ckpt_audit.exitcodes import ExitCode


@click.command("compare")
@click.argument("source")
@click.argument("copy")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout.")
@click.pass_context
def compare_command(ctx: click.Context, source, copy, as_json) -> None:
    """Check that COPY holds exactly SOURCE's files: same names, sizes and checksums (either side a directory or
    an s3:// prefix; an object's checksum is read from its metadata, a local file's by reading it).

    Exit codes: 0 an exact copy, 1 any difference (each named), 2 usage, 3 error (a side cannot be listed).

    \b
    Example:
        aws s3 cp --recursive --checksum-algorithm CRC64NVME /ckpts/proj/exp s3://bucket/proj/exp
        ckpt-audit compare /ckpts/proj/exp s3://bucket/proj/exp && ckpt-audit prune ... /ckpts/proj/exp
    """
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.stores import compare

    try:
        n, diffs = compare(source, copy)
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    code = ExitCode.FINDINGS if diffs else ExitCode.OK
    if as_json:
        emit_json(
            {
                "command": "compare",
                "source": source,
                "copy": copy,
                "files": n,
                "differences": [{"path": d.path, "reason": d.reason} for d in diffs],
                "exit_code": int(code),
            }
        )
    else:
        for d in diffs:
            click.echo(f"differs: {d.path}: {d.reason}")
        click.echo(f"{n} file(s) compared, {len(diffs)} difference(s)")
    ctx.exit(int(code))
