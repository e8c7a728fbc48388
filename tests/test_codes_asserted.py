"""Every registered finding code is asserted by some test, read from the tests' syntax trees.

A code string that merely appears in a test (a comment, a docstring, an `assert ... not in`, a case name) proves
nothing; a code counts as asserted only where a test would fail if the code were not produced:
- inside an `assert` statement, unless it is asserted absent: under `not`, on either side of `not in`, `!=` or
  `is not`, or in a comparison with an empty literal (`assert [f for f in fs if f.code == "x"] == []`);
- compared with `==`/`in` to a finding's `.code` or `["code"]` where a miss fails: in an unpacking assignment
  (`[f] = [f for f in fs if f.code == "x"]`) or a one-argument `next(...)`;
- passed to a parameter that feeds an assert: a `parametrize` value of such a test, or a constant argument of a
  helper such as test_verify's `one(root, code)`, which asserts that a finding with that code exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ckpt_audit
from ckpt_audit.codes import CODES

TESTS = Path(__file__).parent
NEGATIVE = (ast.NotIn, ast.NotEq, ast.IsNot)


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _positive_strings(test: ast.expr) -> set[str]:
    """String constants of an assert's test, less those on either side of a negative comparison."""
    out: set[str] = set()

    def visit(node: ast.AST, negated: bool) -> None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            negated = True
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            against_empty = any(_is_empty(s) for s in sides)
            for i, side in enumerate(sides):
                around = node.ops[max(i - 1, 0) : i + 1]  # the operators this operand takes part in
                visit(side, negated or against_empty or any(isinstance(op, NEGATIVE) for op in around))
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not negated:
            out.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, negated)

    visit(test, False)
    return out


def _is_empty(node: ast.expr) -> bool:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        return not (node.keys if isinstance(node, ast.Dict) else node.elts)
    return isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("set", "list", "dict") and not node.args


def _is_code(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "code"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "code"


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _fails_when_empty(node: ast.AST) -> bool:
    """An unpacking assignment (`[f] = ...`) or `next(gen)` without a default: both raise when nothing matches."""
    if isinstance(node, ast.Assign):
        return any(isinstance(t, (ast.Tuple, ast.List)) for t in node.targets)
    return isinstance(node, ast.Call) and getattr(node.func, "id", "") == "next" and len(node.args) == 1


def _code_comparisons(node: ast.AST) -> set[str]:
    """Strings compared with `==`/`in` to a `.code` anywhere inside `node`."""
    out: set[str] = set()
    for cmp in ast.walk(node):
        if isinstance(cmp, ast.Compare) and all(isinstance(op, (ast.Eq, ast.In)) for op in cmp.ops):
            sides = [cmp.left, *cmp.comparators]
            if any(_is_code(s) for s in sides):
                literals = [s for s in sides if isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set))]
                out |= set().union(*map(_strings, literals))
    return out


def _asserting_params(fn: ast.FunctionDef) -> list[str]:
    """The parameters of `fn` that flow (through assignments in its body) into the test of one of its asserts;
    "" in the place of each parameter that does not."""
    read = set().union(*(_names(a.test) for a in ast.walk(fn) if isinstance(a, ast.Assert)))
    assigns = [(n.value, n.targets) for n in ast.walk(fn) if isinstance(n, ast.Assign)]
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    out = []
    for p in params:
        reach, grew = {p}, True
        while grew:
            grew = False
            for value, targets in assigns:
                new = set().union(*map(_names, targets)) - reach if _names(value) & reach else set()
                reach |= new
                grew |= bool(new)
        out.append(p if reach & read else "")
    return out


def _parametrized(fn: ast.FunctionDef) -> set[str]:
    """Strings in `@pytest.mark.parametrize` values bound to a parameter that an assert of `fn` reads."""
    asserting = set(_asserting_params(fn)) - {""}
    out: set[str] = set()
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize" and len(deco.args) > 1):
            continue
        names = ast.literal_eval(deco.args[0])
        names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
        for row in getattr(deco.args[1], "elts", []):
            values = row.elts if len(names) > 1 and isinstance(row, (ast.Tuple, ast.List)) else [row]
            out |= {s for name, v in zip(names, values) if name in asserting for s in _strings(v)}
    return out


def asserted_strings(source: str) -> set[str]:
    """Every string constant that `source` (a test module) asserts, by the rules in this module's docstring."""
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    helpers = {fn.name: _asserting_params(fn) for fn in functions if any(_asserting_params(fn))}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            found |= _positive_strings(node.test)
        elif _fails_when_empty(node):
            found |= _code_comparisons(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
            params = helpers[node.func.id]
            bound = list(zip(params, node.args)) + [(k.arg, k.value) for k in node.keywords]
            found |= {v.value for p, v in bound if p and isinstance(v, ast.Constant) and isinstance(v.value, str)}
        elif isinstance(node, ast.FunctionDef):
            found |= _parametrized(node)
    return found


def _asserted_codes() -> set[str]:
    found = set().union(*(asserted_strings(p.read_text()) for p in sorted(TESTS.glob("*.py"))))
    return found & set(CODES)


def test_the_reader_counts_assertions_not_mentions():
    source = '''
"""A docstring naming mentioned-in-docstring."""
CASES = {"case-name-only": 1}

def one(root, code):
    found, _ = findings(root, code)
    match = [f for f in found if f.rank == 0]
    assert match, "none"

def findings(root, code):
    return [f for f in scan(root) if f.code == code], None

@pytest.mark.parametrize("content,code", [(1, "by-parametrize"), (2, "by-parametrize-too")])
def test_p(content, code):
    assert code in codes(scan(content))

@pytest.mark.parametrize("case", ["unasserted-parameter"])
def test_q(case):
    scan(case)
    assert True

def test_r():
    # mentioned-in-comment
    assert "in-assert" in codes(r) and "absent" not in codes(r)
    assert codes(r) != {"negated-set"}
    assert not [f for f in r.findings if f.code == "under-not"]
    assert [f for f in r.findings if f.code == "equal-to-empty"] == []
    assert findings(root, "found-nothing")[0] == []
    [behind] = [f for f in r.findings if f.code == "by-code-filter"]
    first = next(f for f in r.findings if f.code in ("by-next", "by-next-too"))
    maybe = next((f for f in r.findings if f.code == "next-with-default"), None)
    some = [f for f in r.findings if f.code == "filtered-only"]
    one(root, "by-helper")
    one(root, code="by-helper-keyword")
    label = "plain-string"
'''
    assert asserted_strings(source) == {
        "by-parametrize",
        "by-parametrize-too",
        "in-assert",
        "by-code-filter",
        "by-next",
        "by-next-too",
        "by-helper",
        "by-helper-keyword",
    }


def test_every_code_the_scanner_can_emit_is_registered():
    pkg = Path(ckpt_audit.__file__).parent
    sources = [*sorted((pkg / "scan").glob("*.py")), pkg / "layouts" / "verl_fsdp.py"]
    sources += sorted((pkg / "rules").glob("*.py"))
    emitted = {m for p in sources for m in re.findall(r'finding\(\s*"([a-z0-9-]+)"', p.read_text())}
    assert len(emitted) > 30 and sorted(emitted - set(CODES)) == []


def test_no_code_is_registered_in_two_families():
    """CODES is one dict over the families' tables (codes/shards.py, codes/deep.py, ...): a slug entered in two of
    them would silently keep only the later entry."""
    from ckpt_audit.codes import FAMILIES

    slugs = [c.code for family in FAMILIES for c in family.TABLE]
    assert len(slugs) > 100 and sorted({s for s in slugs if slugs.count(s) > 1}) == []


def test_every_code_flag_names_registered_codes():
    """The flag sets beside the registry (unread, unsafe, zip-rule, ...) name only registered codes: a misspelt
    code in one would silently never match a finding."""
    from ckpt_audit.codes import FLAG_SETS

    assert len(FLAG_SETS) >= 5
    assert {name: sorted(flagged - set(CODES)) for name, flagged in FLAG_SETS.items()} == {n: [] for n in FLAG_SETS}


def test_every_registered_code_is_asserted_by_a_test():
    """A code no test asserts is undocumented behaviour waiting to rot."""
    asserted = _asserted_codes()
    assert sorted(set(CODES) - asserted) == []
