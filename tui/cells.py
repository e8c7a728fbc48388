"""How model values look in a table cell: status badges, sizes, ages, CRC marks."""

from __future__ import annotations

from rich.text import Text

from ckpt_audit.models import Severity, Status
from ckpt_audit.units import format_age

BADGE: dict[Status, tuple[str, str]] = {
    Status.COMPLETE: ("✓ complete", "bold green"),
    Status.INCOMPLETE: ("◐ incomplete", "bold yellow"),
    Status.CORRUPT: ("✗ corrupt", "bold red"),
    Status.UNCOMMITTED: ("… uncommitted", "cyan"),
    Status.HUSK: ("○ husk", "dim"),
    Status.IN_PROGRESS: ("⟳ in-progress", "bold blue"),
    Status.UNSAFE: ("! unsafe", "bold white on red"),  # loud: resuming it would run code
    Status.UNKNOWN: ("? unknown", "bold black on yellow"),  # not a verdict: part of it could not be read
}
SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "dim"}
SHORT = {
    Status.COMPLETE: "✓",
    Status.INCOMPLETE: "◐",
    Status.CORRUPT: "✗",
    Status.UNCOMMITTED: "…",
    Status.HUSK: "○",
    Status.IN_PROGRESS: "⟳",
    Status.UNSAFE: "!",
    Status.UNKNOWN: "?",
}
# What each status means for the person deciding what to delete (help screen, details view).
MEANING: dict[Status, str] = {
    Status.COMPLETE: "every shard present and intact: resumable",
    Status.INCOMPLETE: "shards or files missing: cannot be resumed",
    Status.CORRUPT: "a file fails its checks (CRC, size, format): cannot be resumed",
    Status.UNCOMMITTED: "newer than the tracker: resume does not load it",
    Status.HUSK: "nothing resumable left in it",
    Status.IN_PROGRESS: "being written now: judged on a later scan, never deleted",
    Status.UNSAFE: "a pickle in it reaches code outside the allowlist: resuming would run it; kept until you select it",
    Status.UNKNOWN: "something inside could not be read (permissions, I/O, a link out of the root): no evidence "
    "it is disposable, so it is never deleted",
}


def badge(status: Status) -> Text:
    label, style = BADGE[status]
    return Text(label, style=style)


def status_counts(statuses) -> Text:
    """'3✓ 1✗' in the badge colours, statuses in a fixed order."""
    out = Text()
    for status in Status:
        n = sum(1 for s in statuses if s is status)
        if n:
            if out:
                out.append(" ")
            out.append(f"{n}{SHORT[status]}", style=BADGE[status][1])
    return out


def age(ns: int | None, now_ns: int) -> str:
    """'3d', '5h', '12m', '40s' or '-': the CLI's ages (`units.format_age`), so both front ends print alike."""
    return format_age(ns, now_ns)


def crc(ok: bool | None) -> Text:
    if ok is None:
        return Text("-", style="dim")
    return Text("ok", style="green") if ok else Text("BAD", style="bold red")


def severity(sev: Severity) -> Text:
    return Text(sev.label, style=SEVERITY_STYLE[sev])
