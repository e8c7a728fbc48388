"""The walk (scan.walk) on small trees made here: what it lists, what it cannot, and the run file lists cut from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_proc import unprivileged

from ckpt_audit.scan.walk import files_under, walk


def _touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_each_directory_lists_its_subtree_whatever_sorts_beside_its_name(tmp_path):
    """`exp-2` and `exp.txt` sort between `exp` and `exp/...`, and a file of a directory can sort after one of its
    subdirectories' files: each list is exactly the directory's files at or below it, sorted."""
    root = tmp_path / "root"
    for rel in ("exp/b.pt", "exp/a/x.pt", "exp/a/y/z.pt", "exp/a-b.pt", "exp-2/a.pt", "exp.txt", "exp/zz/q.pt", "z"):
        _touch(root / rel)
    tree, stats, found = walk(str(root))
    assert found == []
    dirs = list(tree.dirs)
    lists = files_under(dirs, stats)
    assert lists == {d: sorted(tree.files_below(d)) for d in dirs}
    below_exp = ("exp/a-b.pt", "exp/a/x.pt", "exp/a/y/z.pt", "exp/b.pt", "exp/zz/q.pt")
    assert lists[str(root / "exp")] == [str(root / p) for p in below_exp]
    assert files_under([str(root / "exp/zz")], stats)[str(root / "exp/zz")] == [str(root / "exp/zz/q.pt")]
    assert all(any(p is k for k in stats) for p in lists[str(root)])  # the walk's own strings, not copies


WALK_AS_USER = r"""
import json, sys
from ckpt_audit.scan.walk import walk
tree, stats, found = walk(sys.argv[1])
print(json.dumps({
    "dirs": {d: list(s) for d, s in tree.dirs.items()},
    "files": {d: list(f) for d, f in tree.files.items()},
    "mtimes": sorted(tree.dir_mtime_ns),
    "stats": sorted(stats),
    "found": sorted([f.code, f.path] for f in found),
}))
"""


@pytest.mark.skipif(unprivileged() is None, reason="running as root without setpriv: chmod cannot be enforced")
def test_directories_that_cannot_be_listed_or_searched_become_findings(tmp_path):
    """A directory without read permission (listed by no one) and one without search permission (its names listed,
    none of its entries stat'ed): each says so, as `unreadable`, and the rest of the tree is walked."""
    root = tmp_path / "root"
    _touch(root / "ok" / "a.pt")
    _touch(root / "nolist" / "b.pt")
    _touch(root / "nosearch" / "c.pt")
    _touch(root / "nosearch" / "d.pt")
    (root / "nolist").chmod(0o300)
    (root / "nosearch").chmod(0o600)
    try:
        out = subprocess.run(
            [*unprivileged(), sys.executable, "-c", WALK_AS_USER, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    finally:
        (root / "nolist").chmod(0o700)
        (root / "nosearch").chmod(0o700)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    r = str(root)
    assert got["found"] == [
        ["unreadable", f"{r}/nolist"],
        ["unreadable", f"{r}/nosearch/c.pt"],
        ["unreadable", f"{r}/nosearch/d.pt"],
    ]
    assert got["dirs"] == {r: ["nolist", "nosearch", "ok"], f"{r}/ok": [], f"{r}/nolist": [], f"{r}/nosearch": []}
    assert got["files"][f"{r}/nolist"] == [] and got["files"][f"{r}/nosearch"] == []
    assert got["stats"] == [f"{r}/ok/a.pt"]
    assert got["mtimes"] == sorted([r, f"{r}/ok", f"{r}/nolist", f"{r}/nosearch"])  # each stat'ed, listed or not
