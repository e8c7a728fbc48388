"""The `ckpt-audit` command line: a click group whose subcommands load lazily.

Lazy loading keeps `ckpt-audit scan` light (no torch, no textual): each subcommand's module is imported
only when that subcommand runs. Every subcommand lives in its own module under `ckpt_audit/cli/`.
"""

from __future__ import annotations

import importlib
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
    "demo": "ckpt_audit.cli.demo:demo_command",
    "prune": "ckpt_audit.cli.prune:prune_command",
    "export": "ckpt_audit.cli.export:export_command",
    "resume-test": "ckpt_audit.cli.resume_test:resume_test_command",
    "train": "ckpt_audit.cli.train:train_command",
    "tui": "ckpt_audit.cli.tui:tui",
    "continuity": "ckpt_audit.cli.continuity:continuity_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt-audit")
def cli() -> None:
    """Keep training checkpoints honest: scan, verify, prune, export, resume-test.

    \b
    Example:
        ckpt-audit demo            # build a demo tree with the reference trainer and scan it
        ckpt-audit scan /ckpts     # hash, validate and catalog every checkpoint under /ckpts
    """


def main() -> None:
    """Entry point: map every outcome onto a documented exit code; never exit 1 on a crash."""
    try:
        code = cli.main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.UsageError as exc:
        exc.show()
        code = ExitCode.USAGE
    except click.Abort:
        click.echo("ckpt-audit: interrupted", err=True)
        code = ExitCode.INTERRUPTED
    except KeyboardInterrupt:
        click.echo("ckpt-audit: interrupted", err=True)
        code = ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        code = ExitCode.ERROR
    except Exception as exc:  # last resort: one line, exit 3, never a traceback
        click.echo(f"ckpt-audit: error: {type(exc).__name__}: {exc}", err=True)
        code = ExitCode.ERROR
    sys.exit(int(code or 0))
