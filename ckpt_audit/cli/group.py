"""The `ckpt-audit` command line: a click group whose subcommands load lazily (main() is in __init__.py).

Lazy loading keeps `ckpt-audit scan` light (no torch, no textual): each subcommand's module is imported
only when that subcommand runs. The core's commands live under `ckpt_audit/cli/`; the TUI's and the harness's
(`tui`, `demo`, `train`, `resume-test`) plug in through the `ckpt_audit.commands` entry-point group
(pyproject.toml), so ckpt_audit never imports them.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from ckpt_audit import __version__
from ckpt_audit.exitcodes import ExitCode

# name -> "module:attribute"; one line per command.
COMMANDS: dict[str, str] = {
    "scan": "ckpt_audit.cli.scan:scan_command",
    "verify": "ckpt_audit.cli.verify:verify_command",
    "ls": "ckpt_audit.cli.scan:ls_command",
    "show": "ckpt_audit.cli.scan:show_command",
    "prune": "ckpt_audit.cli.prune:prune_command",
    "export": "ckpt_audit.cli.export:export_command",
    "continuity": "ckpt_audit.cli.continuity:continuity_command",
    "latest": "ckpt_audit.cli.latest:latest_command",
    "fix-tracker": "ckpt_audit.cli.fix_tracker:fix_tracker_command",
    "compare": "ckpt_audit.cli.compare:compare_command",
}
PLUGIN_GROUP = "ckpt_audit.commands"


def plugins() -> dict[str, str]:
    """Commands other packages plug in: name -> "module:attribute" (read only when a command is not the core's,
    so `scan` never pays for the metadata walk)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in COMMANDS}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *plugins()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name) or plugins().get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:  # a plug-in whose package (or one it needs) is not installed
            return _unavailable(name, module, exc)


def _unavailable(name: str, module: str, exc: ImportError) -> click.Command:
    """A stand-in that lists in --help and, when run, fails in one line (exit 3) naming what to install."""
    from ckpt_audit.cli.common import CommandError, install_for, needs

    missing = (getattr(exc, "name", None) or module).split(".")[0]
    hint = needs(name, missing)

    def fail() -> None:
        raise CommandError(hint)

    return click.Command(
        name,
        callback=fail,
        help=f"Unavailable: {hint}.",
        short_help=f"(unavailable: install {install_for(missing)})",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt-audit")
def cli() -> None:
    """Keep training checkpoints honest: scan, verify, prune, export, resume-test.

    \b
    Example:
        ckpt-audit demo            # build a demo tree with the reference trainer and scan it
        ckpt-audit scan /ckpts     # hash, validate and catalog every checkpoint under /ckpts
    """


def run() -> int:
    """The command line's outcome as a documented exit code; never 1 on a crash."""
    try:
        _utf8_arguments()
        return cli.main(standalone_mode=False) or 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        exc.show()
        return ExitCode.USAGE
    except (click.Abort, KeyboardInterrupt):  # click turns a Ctrl-C into Abort
        click.echo("ckpt-audit: interrupted", err=True)
        return ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return ExitCode.ERROR
    except Exception as exc:  # last resort: one line, exit 3, never a traceback
        click.echo(f"ckpt-audit: error: {type(exc).__name__}: {exc}", err=True)
        return ExitCode.ERROR


def _utf8_arguments() -> None:
    """Paths are UTF-8 text in the catalog: an argument that is not (a name in Latin-1 bytes) is a usage error naming
    it escaped, never an encoding crash halfway through a scan. Names below a root are reported (non-utf8-name)."""
    for arg in sys.argv[1:]:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            raise click.UsageError(f"{shown} is not valid UTF-8: ckpt-audit catalogues paths as UTF-8 text") from None
