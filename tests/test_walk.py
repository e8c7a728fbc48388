"""The walk (scan.walk) on small trees made here: what it lists, what it cannot, and the run file lists cut from it."""

from __future__ import annotations

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
