"""Pieces every command shares: catalog location, the locked catalog session, --json rendering, one-line errors."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from ckpt_audit import units
from ckpt_audit.exitcodes import ExitCode

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

SCHEMA_VERSION = 1
CATALOG_ENV = "CKPT_AUDIT_CATALOG"


def default_catalog_path() -> str:
    """$CKPT_AUDIT_CATALOG, else $XDG_DATA_HOME/ckpt-audit/catalog.db (~/.local/share/ckpt-audit/catalog.db)."""
    if env := os.environ.get(CATALOG_ENV):
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "ckpt-audit", "catalog.db")


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # sqlite3 opens "" as a private temporary database: a scan would record into it and lose every row
    if value == "":
        raise click.BadParameter("is empty (leave --catalog out for the default)", ctx=ctx, param=param)
    return value


def ray_address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--ray [ADDRESS]'s value. Click gives the optional value the word after the flag, so `--ray /ckpts` would
    take the root (or the step directory) as the address and then scan nothing or miss an argument: a value that is
    neither `auto` nor HOST:PORT nor ray://HOST:PORT (a host, a port 1-65535) is refused here, before anything else is
    read: Ray took ':' with a logged traceback and 'ray://' after 30 s of gRPC errors."""
    if value is None:
        return value
    from ckpt_audit.session.cluster import is_ray_address  # only for --ray: scan without it loads no cluster code

    if is_ray_address(value):
        return value
    raise click.BadParameter(
        f"{value!r} is not a Ray address (auto, HOST:PORT or ray://HOST:PORT): --ray takes the word after it, so "
        "write the paths first or give the address (--ray auto)",
        ctx=ctx,
        param=param,
    )


def ray_option(help: str):
    """--ray [ADDRESS] as scan, prune and export spell it: the address defaults to "auto" (the running cluster)
    when the flag is given bare; `help` says what the command does on the cluster."""
    return click.option(
        "--ray",
        "ray_address",
        is_flag=False,
        flag_value="auto",
        default=None,
        callback=ray_address,
        metavar="[ADDRESS]",
        help=help,
    )


catalog_option = click.option(
    "--catalog",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_not_empty,
    help=f"SQLite catalog (default: ${CATALOG_ENV} or ~/.local/share/ckpt-audit/catalog.db).",
)


class _Unit(click.ParamType):
    """A flag value in one of ckpt_audit.units' forms: a duration (to nanoseconds) or a size (to bytes)."""

    def __init__(self, name: str, parse: Callable[[str], int]) -> None:
        self.name = name
        self.parse = parse

    def convert(self, value, param, ctx):
        try:
            return value if isinstance(value, int) else self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Unit("DURATION", units.parse_duration)  # 90m, 36h, 7d, 2w
SIZE = _Unit("SIZE", units.parse_size)  # 500MB, 5GB, 50GiB


def resolve_catalog(path: str | None) -> str:
    return path if path is not None else default_catalog_path()


@contextmanager
def session(ctx: click.Context, roots, catalog: str | None) -> Iterator:
    """The preamble of every command that writes the catalog: a ckpt_audit.session.Session over the roots given,
    held under the catalog's lock for the whole body. A bad root or catalog is a one-line error (exit 3); another
    run holding the lock exits 4 at once."""
    from ckpt_audit.session import Locked, SessionError, open_session

    try:
        with open_session(resolve_catalog(catalog), roots=roots) as s:
            yield s
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    except Locked as exc:
        click.echo(f"ckpt-audit: {exc}", err=True)
        ctx.exit(int(ExitCode.LOCKED))


class Bar:
    """The CLI's one progress bar (a session.Progress) on stderr, only when stderr is a terminal (never in cron mail
    or pipes): a `with` block, or `close()` when done."""

    def __init__(self, label: str, *, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.bar: ProgressBar[Any] | None = None
        self.done = 0

    def __call__(self, done: int, total: int, item: str = "", /) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = click.progressbar(
                length=max(total, 1), label=self.label, file=sys.stderr, item_show_func=lambda i: (i or "")[:60]
            )
            self.bar.__enter__()
        self.bar.length = max(total, done, 1)  # a total may grow as it is found (export's tensors)
        self.bar.update(done - self.done, item)
        self.done = done

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def emit_json(document: dict) -> None:
    click.echo(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2, sort_keys=False))


class CommandError(click.ClickException):
    """A one-line error with exit code 3."""

    exit_code = int(ExitCode.ERROR)

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        click.echo(f"ckpt-audit: error: {self.format_message()}", err=True)


# what to install for a missing top-level module, where its pip name differs
INSTALL = {m: "'ckpt-audit[torch]'" for m in ("torch", "transformers", "torchdata", "numpy")} | {
    "tui": "ckpt-audit",
    "harness": "ckpt-audit",
}


def install_for(module: str) -> str:
    return INSTALL.get(module, module)


def needs(command: str, module: str) -> str:
    """The one line a command that cannot run without `module` fails with."""
    return f"`ckpt-audit {command}` needs {module!r}, which is not installed: pip install {install_for(module)}"


def require_torch(command: str, modules: tuple[str, ...] = ("torch",)) -> None:
    """Fail in one line (exit 3) naming the extra, before a command that loads tensors or trains touches anything:
    without it verify would call every shard not-loadable, and the demo's trainer would die in a child."""
    import importlib.util

    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise CommandError(needs(command, name))


def write_metrics_file(path: str, result, scrub) -> None:
    """The textfile for node_exporter; prometheus_client is imported only here (scan's start-up stays light)."""
    import time

    from ckpt_audit.metrics_textfile import write_metrics

    try:
        write_metrics(path, result, now_ns=time.time_ns(), scrub_period_ns=None if scrub is None else scrub.period_ns)
    except OSError as exc:
        raise CommandError(f"cannot write metrics file {path}: {exc.strerror or exc}") from None


# --junit-xml FILE, the same for scan, verify, continuity and resume-test (ckpt_audit/report_junit.py writes it)
junit_option = click.option(
    "--junit-xml",
    "junit_xml",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also write a JUnit XML report here (one test case per compared item) for a CI system's test report; "
    "output and exit code are unchanged.",
)


def check_junit_writable(path: str | None) -> None:
    """Refuse before minutes of work, not after (exit 3): the report's directory must be writable, and a file already
    there is replaced only if it is an XML document (a report from an earlier run), never a shard named by a typo."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
        raise CommandError(f"cannot write --junit-xml {path}: {directory} is not a writable directory")
    if os.path.lexists(path):
        try:
            with open(path, "rb") as f:
                xml = f.read(5) == b"<?xml"
        except OSError:
            xml = False
        if not xml or os.path.islink(path):
            raise CommandError(f"--junit-xml {path} exists and is not an XML report: refusing to replace it")


def write_junit_report(path: str, suites) -> None:
    """Written atomically after the work; a failure is a one-line error (exit 3), which outranks findings."""
    from ckpt_audit.report_junit import write_junit

    try:
        write_junit(path, suites)
    except OSError as exc:
        raise CommandError(f"cannot write --junit-xml {path}: {exc.strerror or exc}") from None
