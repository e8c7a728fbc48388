"""The house's shape, enforced: arrows between packages only point down, nothing imports in a circle, and the
front ends reach the core only through the session.

Every import counts, including those inside functions and under `TYPE_CHECKING`: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# lowest first; a module may import its own layer or any layer below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "ckpt_audit",
        "ckpt_audit.models",
        "ckpt_audit.tree",
        "ckpt_audit.codes",
        "ckpt_audit.units",
        "ckpt_audit.exitcodes",
        "ckpt_audit.killpoints",
        "ckpt_audit.lock",
        "ckpt_audit.durable",
        "ckpt_audit.remote",  # its __init__ alone: is_remote, the scanner's test of a root
        "ckpt_audit.roots",  # check_root: the session checks roots without loading the scan
    ),
    ("ckpt_audit.readers",),
    ("ckpt_audit.rules", "ckpt_audit.continuity"),
    ("ckpt_audit.layouts",),
    ("ckpt_audit.scan",),
    ("ckpt_audit.deep", "ckpt_audit.lifecycle", "ckpt_audit.export"),
    ("ckpt_audit.verify",),
    # report, report_junit, metrics: renderings of a result
    ("ckpt_audit.catalog", "ckpt_audit.report", "ckpt_audit.report_junit", "ckpt_audit.metrics_textfile"),
    # cluster: the scan's map half placed on Ray nodes; above the scanner it runs, below the session that drives it
    # object stores: the remote scan drives the scanner's reduce and readers (ckpt_audit.remote, docs/remote.md)
    (
        "ckpt_audit.cluster",
        "ckpt_audit.remote.scan",
        "ckpt_audit.remote.store",
        "ckpt_audit.remote.compare",
        "ckpt_audit.remote.prune",
    ),
    ("ckpt_audit.session", "ckpt_audit.answers"),  # answers: what the session's actions return
    ("ckpt_audit.cli", "ckpt_audit.__main__"),
)
# plug-ins above the core: they may import ckpt_audit; ckpt_audit never imports them.
PLUGINS = ("tui", "harness")

# Front ends parse, call the session, render and map errors to exit codes. Of the core they may import only the
# session layer, the nouns every layer shares and the renderings of a result; the rest is reached through
# ckpt_audit.session (which also names the nouns a front end passes in: ckpt_audit.session.terms).
FRONT_ENDS = ("ckpt_audit.cli", "ckpt_audit.__main__", "tui", "harness.commands")
FRONT_END_MAY_IMPORT = (
    "ckpt_audit",  # the package itself: __version__
    "ckpt_audit.session",
    "ckpt_audit.answers",
    "ckpt_audit.models",
    "ckpt_audit.codes",
    "ckpt_audit.units",
    "ckpt_audit.exitcodes",
    "ckpt_audit.report",
    "ckpt_audit.report_junit",
    "ckpt_audit.metrics_textfile",
    "ckpt_audit.continuity.plot",
    "ckpt_audit.continuity.sparkline",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of the first-party modules `path` imports (resolving relative imports)."""
    own = module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in found if n.split(".")[0] in ("ckpt_audit", *PLUGINS)}


def graph() -> dict[str, set[str]]:
    files = [p for top in ("ckpt_audit", *PLUGINS) for p in (REPO / top).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def _under(module: str, name: str) -> bool:
    """`module` is `name` or inside it; the bare package name stands only for ckpt_audit/__init__.py (else every
    module nobody placed would land in the lowest layer unnoticed)."""
    return module == name or (name != "ckpt_audit" and module.startswith(name + "."))


def layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer) of the most specific match
    for index, names in enumerate(LAYERS):
        for name in names:
            if _under(module, name):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    return None if best is None else best[1]


def test_every_core_module_has_a_layer():
    unplaced = sorted(m for m in graph() if m.split(".")[0] == "ckpt_audit" and layer(m) is None)
    assert unplaced == []


def test_no_arrow_points_up():
    upward = sorted(
        f"{src} -> {dst}"
        for src, deps in graph().items()
        for dst in deps
        if (dst.split(".")[0] in PLUGINS and src.split(".")[0] == "ckpt_audit")
        or (layer(src) is not None and layer(dst) is not None and layer(dst) > layer(src))
    )
    assert upward == []


def is_front_end(module: str) -> bool:
    return any(_under(module, f) for f in FRONT_ENDS)


def front_end_bypasses(g: dict[str, set[str]]) -> list[str]:
    """Every import by a front end of a core module below the session that is not on the allowed list."""
    return sorted(
        f"{src} -> {dst}"
        for src, deps in g.items()
        if is_front_end(src)
        for dst in deps
        if dst.split(".")[0] == "ckpt_audit"
        and not is_front_end(dst)
        and not any(_under(dst, a) for a in FRONT_END_MAY_IMPORT)
    )


def test_front_ends_reach_the_core_only_through_the_session():
    assert front_end_bypasses(graph()) == []


def test_no_import_circle():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert circles == []


def test_contract_sees_a_real_upward_arrow():
    """The checker itself can fail: a scanner importing the CLI is caught."""
    assert layer("ckpt_audit.scan.pipeline") < layer("ckpt_audit.cli.scan")
    assert layer("ckpt_audit.deep.rules") > layer("ckpt_audit.rules.status")
    assert layer("ckpt_audit.not_placed") is None  # an unplaced top-level module is caught, not put in layer 0
    # a front end reaching past the session is caught; the session's own terms are not
    g = {"tui.app": {"ckpt_audit.lifecycle.prune", "ckpt_audit.session.terms"}, "harness.trainer": {"ckpt_audit.deep"}}
    assert front_end_bypasses(g) == ["tui.app -> ckpt_audit.lifecycle.prune"]
