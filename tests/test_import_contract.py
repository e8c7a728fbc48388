"""The house's shape, enforced: arrows between packages only point down, and nothing imports in a circle.

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
    ),
    ("ckpt_audit.readers",),
    ("ckpt_audit.rules", "ckpt_audit.continuity"),
    ("ckpt_audit.layouts",),
    ("ckpt_audit.scanner", "ckpt_audit.scrub", "ckpt_audit.verdict_cache"),
    ("ckpt_audit.deep", "ckpt_audit.lifecycle"),
    ("ckpt_audit.verify",),
    ("ckpt_audit.catalog", "ckpt_audit.report", "ckpt_audit.metrics_textfile"),  # metrics: a rendering of a scan
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


def layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer) of the most specific match
    for index, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
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
    assert layer("ckpt_audit.scanner") < layer("ckpt_audit.cli.scan")
    assert layer("ckpt_audit.deep.rules") > layer("ckpt_audit.rules.status")
