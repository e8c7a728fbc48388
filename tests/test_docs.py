"""The docs are held to the code (as sqlite-utils does): every command `ckpt-audit --help` lists has help with an
`Example:` and a docs entry, every exit code and JSON document is documented, the finding-code table is the one the
registry generates, and every relative link in README.md and docs/ resolves.

Commands are listed and their help read through the installed entry point in a subprocess, so plug-in commands
(tui, demo, train, resume-test) count exactly as a user sees them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit

from ckpt_audit.exitcodes import ExitCode

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
CLI_DOC = REPO / "docs" / "cli.md"
# commands that must be listed: a plug-in that stops registering is a failure, not a shorter loop
EXPECTED_AT_LEAST = {
    "scan",
    "ls",
    "show",
    "verify",
    "prune",
    "export",
    "continuity",
    "tui",
    "demo",
    "train",
    "resume-test",
}


@pytest.fixture(scope="module")
def commands() -> list[str]:
    out = ckpt_audit("--help", cwd=REPO)
    assert out.returncode == 0, out.stderr
    listing = out.stdout.split("\nCommands:\n", 1)[1]
    names = [m.group(1) for m in re.finditer(r"^  (\S+)", listing, re.MULTILINE)]
    assert EXPECTED_AT_LEAST <= set(names), f"commands missing from ckpt-audit --help: {EXPECTED_AT_LEAST - set(names)}"
    return names


@pytest.fixture(scope="module")
def helps(commands) -> dict[str, str]:
    found = {}
    for name in commands:
        out = ckpt_audit(name, "--help", cwd=REPO)
        assert out.returncode == 0, f"ckpt-audit {name} --help exited {out.returncode}: {out.stderr}"
        found[name] = out.stdout
    return found


def prose(text: str) -> str:
    """Markdown without fenced code, inline code and HTML comments (links and headings there are not real)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [line for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def names_command(line: str, name: str) -> bool:
    """`ckpt-audit NAME ...` or `NAME` in backticks (a heading such as "# `ckpt-audit scan`, `ls`, `show`")."""
    return re.search(rf"`(ckpt-audit )?{re.escape(name)}( [^`]*)?`", line) is not None


def readme_rows() -> dict[str, str]:
    """The README command table: command name -> the row."""
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `ckpt-audit ([a-z][a-z-]*)", line)
        if m:
            rows[m.group(1)] = line
    return rows


def example_block(help_text: str) -> str:
    """The indented lines under `Example:` in a command's help ('' when there is none)."""
    m = re.search(r"^\s*Example:\s*\n((?:[ \t]+\S.*\n?)+)", help_text, re.MULTILINE)
    return m.group(1) if m else ""


def test_every_command_has_help_with_an_example(helps):
    missing = [n for n, text in helps.items() if not re.search(rf"ckpt-audit {n}(\s|$)", example_block(text))]
    assert missing == [], f"--help without an 'Example:' block that runs the command: {missing}"


def test_every_command_has_a_docs_heading(commands):
    texts = {page.name: headings(page.read_text()) for page in DOCS}
    missing = [n for n in commands if not any(names_command(h, n) for hs in texts.values() for h in hs)]
    assert missing == [], f"no heading in docs/*.md names these commands: {missing}"


def test_every_option_is_documented(helps):
    """Each --option in a command's help is named on a docs page with a heading for that command (or in cli.md,
    which documents the shared ones: --json, -q/--quiet, --fail-on, --catalog)."""
    pages = [(page, page.read_text()) for page in DOCS]
    undocumented = []
    for name, text in helps.items():
        options = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", text.split("\nOptions:\n", 1)[1], re.M))
        own = [t for page, t in pages if page == CLI_DOC or any(names_command(h, name) for h in headings(t))]
        undocumented += [f"{name} {opt}" for opt in sorted(options - {"--help"}) if not any(opt in t for t in own)]
    assert undocumented == [], f"options in --help that no docs page of the command names: {undocumented}"


def test_every_command_has_a_readme_row_linking_its_docs_page(commands):
    rows = readme_rows()
    assert set(commands) - set(rows) == set(), f"README command table lacks rows for {set(commands) - set(rows)}"
    assert set(rows) - set(commands) == set(), (
        f"README command table names unknown commands {set(rows) - set(commands)}"
    )
    for name in commands:
        pages = re.findall(r"\]\((docs/[\w-]+\.md)\)", rows[name])
        assert pages, f"README row for {name} links no docs page"
        page = REPO / pages[0]
        assert any(names_command(h, name) for h in headings(page.read_text())), f"{pages[0]} has no heading for {name}"


def exit_code_rows(text: str) -> list[tuple[int, str]]:
    """Rows `| N | ... |` of tables whose first header cell is `code` (exit-code tables; finding codes are slugs)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if re.match(r"\|\s*code\s*\|", line):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and (m := re.match(r"\|\s*(\d+)\s*\|(.*)", line)):
            rows.append((int(m.group(1)), m.group(2)))
    return rows


def test_every_exit_code_is_documented_in_readme_and_docs():
    values = {int(c) for c in ExitCode}
    readme = {code for code, _ in exit_code_rows(README.read_text())}
    assert readme == values, f"README exit code table: missing {values - readme}, unknown {readme - values}"
    cli_rows = dict(exit_code_rows(CLI_DOC.read_text()))
    assert set(cli_rows) == values, (
        f"docs/cli.md exit codes: missing {values - set(cli_rows)}, unknown {set(cli_rows) - values}"
    )
    for code in ExitCode:
        assert f"`{code.name}`" in cli_rows[int(code)], (
            f"docs/cli.md row {int(code)} does not name ExitCode.{code.name}"
        )


def test_no_docs_page_names_an_exit_code_that_does_not_exist():
    values = {int(c) for c in ExitCode}
    for page in DOCS:
        unknown = {code for code, _ in exit_code_rows(page.read_text())} - values
        assert unknown == set(), f"{page.name} documents exit codes {unknown} that ckpt_audit/exitcodes.py lacks"


@pytest.fixture(scope="module")
def empty_scan(tmp_path_factory) -> tuple[dict, Path]:
    """A real `scan --json` of an empty root into a fresh catalog: its document and the catalog it created."""
    tmp = tmp_path_factory.mktemp("docs")
    (tmp / "empty").mkdir()
    out = ckpt_audit("scan", "--json", "--catalog", str(tmp / "catalog.db"), str(tmp / "empty"), cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), tmp / "catalog.db"


def test_every_json_document_is_documented(helps, empty_scan):
    version = empty_scan[0]["schema_version"]
    for page in (README, CLI_DOC):
        assert f'"schema_version": {version}' in page.read_text(), f"{page.name} does not give schema_version {version}"
    section = CLI_DOC.read_text().split("## JSON documents", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    with_json = [name for name, text in helps.items() if re.search(r"^\s+--json\b", text, re.M)]
    missing = [n for n in with_json if not any(f"`{n}`" in cell for cell in first_cells)]
    assert missing == [], f"commands with --json missing from docs/cli.md 'JSON documents': {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to dashes."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for h in headings(page.read_text()):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def test_every_catalog_table_and_view_is_documented(empty_scan):
    with sqlite3.connect(empty_scan[1]) as db:
        names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
    docs = "".join(page.read_text() for page in DOCS)
    missing = [n for n in names if not n.startswith(("_", "sqlite_")) and f"`{n}`" not in docs]
    assert missing == [], f"catalog tables/views named in no docs page: {missing}"


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *DOCS, REPO / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a URL: upstream issues and sources are fine
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or REPO not in dest.parents:
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_quick_start_is_two_commands_and_ci_runs_them():
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip() for b in re.findall(r"^```\n(.*?)^```", section, re.DOTALL | re.MULTILINE)]
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), (
        f"the quick start is two one-line commands: {blocks}"
    )
    setup_and_demo, tests = blocks
    assert setup_and_demo.endswith("&& .venv/bin/ckpt-audit demo")
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert tests in ci, ".ci/run must run the README's test command verbatim"
    for step in setup_and_demo.split(" && ")[:-1]:  # the set-up, minus the demo; CI installs quietly (-q)
        assert any(line.replace(" -q", "") == step for line in ci), f".ci/run lacks the quick start's `{step}`"


def test_every_cited_repository_path_exists():
    """A path in backticks (`ckpt_audit/readers/hashing.py`) is a citation too: a moved file must not leave it stale."""
    stale = []
    for page in [README, *DOCS, REPO / "bench" / "README.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
        for cited in re.findall(r"`((?:ckpt_audit|tests|bench|scripts|harness|tui|docs)/[^`\s]*)`", text):
            path = cited.split("::")[0]
            if not (REPO / path).exists():
                stale.append(f"{page.relative_to(REPO)}: {cited}")
    assert stale == [], "cited paths not in the repository:\n" + "\n".join(stale)


def test_every_cited_markdown_file_is_in_the_repository():
    """A `.md` named anywhere, in the docs or in a code comment, must be one the reader has: in the repository,
    relative to the page or to the root. Upstream sources are cited by URL instead."""
    stale = []
    code = [
        p for top in ("ckpt_audit", "tui", "harness", "tests", "bench", "scripts") for p in (REPO / top).rglob("*.py")
    ]
    for page in [README, *DOCS, REPO / "bench" / "README.md", *code]:
        text = re.sub(r"https?://\S+", "", page.read_text())
        for cited in set(re.findall(r"[\w./-]+\.md\b", text)):
            if not any((base / cited).exists() for base in (page.parent, REPO, REPO / "docs")):
                stale.append(f"{page.relative_to(REPO)}: {cited}")
    assert stale == [], "markdown files cited that are not in the repository:\n" + "\n".join(sorted(stale))


def test_codes_doc_is_generated_from_the_registry():
    spec = importlib.util.spec_from_file_location("gen_codes_doc", REPO / "scripts" / "gen_codes_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    current = (REPO / "docs" / "codes.md").read_text()
    assert current == gen.render(), (
        "docs/codes.md differs from ckpt_audit/codes/: run `python scripts/gen_codes_doc.py`"
    )


def _layout_block() -> str:
    """The code map of docs/design.md: its "Layout of the code" section."""
    text = (REPO / "docs" / "design.md").read_text()
    return text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]


def test_design_names_every_package_and_top_level_module():
    """docs/design.md's code map is the code as it is: every package under ckpt_audit/ (as `name/`) and every
    top-level module (as a word) is in it, so a package or module added without a line there fails here."""
    block = _layout_block()
    core = REPO / "ckpt_audit"
    packages = sorted(p.name for p in core.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.stem for p in core.glob("*.py") if not p.stem.startswith("_"))
    missing = [f"{p}/" for p in packages if f"{p}/" not in block]
    missing += [m for m in modules if not re.search(rf"(?<![\w.]){m}(?![\w/])", block)]
    assert len(packages) >= 10 and len(modules) >= 10 and missing == []
