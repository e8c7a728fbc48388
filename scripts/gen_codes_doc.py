"""Write docs/codes.md, the finding-code table, from the code registry (`ckpt_audit.codes.CODES`).

The registry is the one source: a code added there without regenerating this page fails `tests/test_docs.py`.

    python scripts/gen_codes_doc.py           # rewrite docs/codes.md
    python scripts/gen_codes_doc.py --check   # exit 1 if docs/codes.md is not what the registry gives
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckpt_audit.codes import CODES

DOC = Path(__file__).resolve().parent.parent / "docs" / "codes.md"
COMMAND = "python scripts/gen_codes_doc.py"

HEADER = f"""# Finding codes

<!-- Generated from ckpt_audit/codes/ by `{COMMAND}`; do not edit by hand. -->

Every finding ckpt-audit reports (`scan`, `verify`, `continuity`, and in JSON as `"code"`) has a stable slug,
registered once in the registry [`ckpt_audit/codes/`](../ckpt_audit/codes/__init__.py) with its severity and what it
means. Findings at or above `--fail-on` (default `error`) make a command exit 1 ([exit codes](cli.md#exit-codes)).

**status** marks the codes whose `error` makes a checkpoint `corrupt` (damaged bytes). Any other error makes it
`incomplete`, except `unsafe-pickle` (`unsafe`) and the codes for an entry that could not be read (`unknown`, never
deleted); see [statuses](scan.md#statuses). Which check emits each code, and when: [scan](scan.md),
[verify](verify.md), [continuity](continuity.md).

| code | severity | status | meaning and consequence |
|---|---|---|---|
"""


def _cell(text: str) -> str:
    """Markdown-safe table cell: a pipe would split the cell, a star would start emphasis."""
    return text.replace("|", "\\|").replace("*", "\\*")


def render() -> str:
    rows = [
        f"| `{c.code}` | {c.severity.label} | {'corrupt' if c.corrupts else ''} | {_cell(c.explanation)} |"
        for c in CODES.values()
    ]
    return HEADER + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC} ({len(CODES)} codes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
