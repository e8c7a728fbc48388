"""Invariants 3 and 4 of issue 11: cached verdicts age out (scrub), and a re-scan reuses, never forgets.

4. Every tree the tests build, clean and broken, is scanned through the real CLI into a real catalog three times:
   fresh, again (every unchanged file reused from the catalog, scrub off) and with --rehash. The statuses and the
   findings must be identical: whatever a verdict depends on (PtFacts, every per-file finding) survives the
   catalog round trip.
3. Bit rot that keeps size, mtime and inode (one flipped payload byte, mtime put back) is found by the scan's scrub
   within its period and by `verify` by default, and not by `verify --trust-cache`; the scrub's share is sized by
   the period, capped by its budget, and what it leaves overdue is reported.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from scan_trees import flip_payload_byte, rewrite_zip, shard, steps_of, write_torch_tree

from ckpt_audit.catalog import open_catalog, read_previous
from ckpt_audit.cli import cli
from ckpt_audit.readers import RULES
from ckpt_audit.scan import scan
from ckpt_audit.scan.scrub import DAY_NS, ScrubPlan, ScrubPolicy, plan_scrub

# -- the trees ------------------------------------------------------------------------------------------------


class _Payload:
    """Pickles as a call to os.system (never unpickled here)."""

    def __reduce__(self):
        return (os.system, ("true",))


def _first(run: Path) -> Path:
    return steps_of(run)[0]


def _truncated(run: Path) -> None:
    p = shard(_first(run), "optim", 1)
    os.truncate(p, p.stat().st_size // 2)


def _zero_byte(run: Path) -> None:
    os.truncate(shard(_first(run), "extra_state", 0), 0)


def _crc_flip(run: Path) -> None:
    flip_payload_byte(shard(_first(run), "model", 0))


def _mesh_mismatch(run: Path) -> None:
    """The W-rank set relabelled as a 2W-rank one: the DTensors' meshes (read from data.pkl) still say W."""
    actor = _first(run) / "actor"
    w = len(list(actor.glob("model_world_size_*")))
    for p in sorted(actor.glob("*_world_size_*")):
        kind, rank = p.name.split("_world_size_")[0], int(p.stem.rsplit("_", 1)[1])
        for r in (rank, rank + w):
            shutil.copy2(p, actor / f"{kind}_world_size_{2 * w}_rank_{r}.pt")
        p.unlink()
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2 * w}, indent=4))


def _missing_rank(run: Path) -> None:
    shard(steps_of(run)[-1], "model", 1).unlink()


def _garbage_shard(run: Path) -> None:
    shard(_first(run), "model", 0).write_bytes(os.urandom(4096))


def _legacy_format(run: Path) -> None:
    torch.save({"_num_yielded": 1}, _first(run) / "data.pt", _use_new_zipfile_serialization=False)


def _unsafe_pickle_zip(run: Path) -> None:
    rewrite_zip(shard(_first(run), "extra_state", 0), replace={"data.pkl": b"\x80\x02cos\nsystem\nq\x00."})


def _unsafe_pickle_legacy(run: Path) -> None:
    torch.save({"_num_yielded": 1, "hook": _Payload()}, _first(run) / "data.pt", _use_new_zipfile_serialization=False)


def _raw_pickle(run: Path) -> None:
    (_first(run) / "data.pt").write_bytes(b"cos\nsystem\n(S'true'\ntR.")


def _bad_pickle(run: Path) -> None:
    rewrite_zip(shard(_first(run), "extra_state", 1), replace={"data.pkl": b"not a pickle at all"})


def _no_data_pkl(run: Path) -> None:
    rewrite_zip(shard(_first(run), "optim", 0), drop="data.pkl")


def _short_storage(run: Path) -> None:
    rewrite_zip(shard(_first(run), "model", 0), shorten="data/0")


def _copied_shard(run: Path) -> None:
    shutil.copy2(shard(_first(run), "extra_state", 0), shard(_first(run), "extra_state", 1))


def _bad_central_directory(run: Path) -> None:
    p = shard(_first(run), "optim", 0)
    data = p.read_bytes()
    (cd_offset,) = struct.unpack_from("<I", data, data.rfind(b"PK\x05\x06") + 16)
    with open(p, "r+b") as f:
        f.seek(cd_offset)
        f.write(b"JUNK")


def _config_world_size(run: Path) -> None:
    (_first(run) / "actor" / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))


def _config_not_json(run: Path) -> None:
    (_first(run) / "actor" / "fsdp_config.json").write_text("{world_size: 2")


def _tracker_invalid(run: Path) -> None:
    (run / "latest_checkpointed_iteration.txt").write_text("twelve")


def _husk(run: Path) -> None:
    shutil.rmtree(_first(run) / "actor")


def _stale_world_size(run: Path) -> None:
    shutil.copy2(shard(_first(run), "model", 0), _first(run) / "actor" / "model_world_size_3_rank_0.pt")


def _links(run: Path) -> None:
    actor = _first(run) / "actor"
    outside = run.parent.parent.parent / "outside.pt"
    outside.write_bytes(b"x" * 10)
    (actor / "link_out.pt").symlink_to(outside)
    (actor / "broken.pt").symlink_to(actor / "nothing-here")
    (actor / "garbage.pt").write_bytes(os.urandom(300))


def _sft_missing_rank(run: Path) -> None:
    shard(_first(run), "model", 1).unlink()


def _megatron_common_missing(run: Path) -> None:
    (_first(run) / "actor" / "dist_ckpt" / "common.pt").unlink()


def _megatron_metadata_missing(run: Path) -> None:
    (_first(run) / "actor" / "dist_ckpt" / "metadata.json").unlink()


Case = tuple[str, Callable[[Path], None] | None]
CLEAN = ["verl_run", "verl_run_w3", "verl_run_hsdp", "verl_run_w1", "verl_run_critic", "verl_run_sft"]
BROKEN: dict[str, tuple[str, Callable[[Path], None]]] = {
    "truncated": ("verl_run", _truncated),
    "zero-byte": ("verl_run", _zero_byte),
    "crc-flip": ("verl_run", _crc_flip),
    "mesh-mismatch": ("verl_run", _mesh_mismatch),
    "missing-rank": ("verl_run", _missing_rank),
    "garbage-shard": ("verl_run", _garbage_shard),
    "legacy-format": ("verl_run", _legacy_format),
    "unsafe-pickle-zip": ("verl_run", _unsafe_pickle_zip),
    "unsafe-pickle-legacy": ("verl_run", _unsafe_pickle_legacy),
    "raw-pickle": ("verl_run", _raw_pickle),
    "bad-pickle": ("verl_run", _bad_pickle),
    "no-data-pkl": ("verl_run", _no_data_pkl),
    "short-storage": ("verl_run", _short_storage),
    "copied-shard": ("verl_run", _copied_shard),
    "bad-central-directory": ("verl_run", _bad_central_directory),
    "config-world-size": ("verl_run", _config_world_size),
    "config-not-json": ("verl_run", _config_not_json),
    "tracker-invalid": ("verl_run", _tracker_invalid),
    "husk": ("verl_run", _husk),
    "stale-world-size": ("verl_run", _stale_world_size),
    "links-and-garbage": ("verl_run", _links),
    "sft-missing-rank": ("verl_run_sft", _sft_missing_rank),
    "hsdp-crc-flip": ("verl_run_hsdp", _crc_flip),
    "megatron-common-missing": ("megatron", _megatron_common_missing),
    "megatron-metadata-missing": ("megatron", _megatron_metadata_missing),
}


def _source(request, name: str) -> Path:
    if name in ("megatron", "dcp"):
        return Path(request.getfixturevalue("dcp_trees")[name])
    return Path(request.getfixturevalue(name))


def _copy(src: Path, dst_root: Path) -> Path:
    dst = dst_root / "root" / src.parent.name / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _scan(root: Path, catalog: Path, *args: str) -> dict:
    res = CliRunner().invoke(
        cli, ["scan", "--json", "--in-progress-window", "0", "--catalog", str(catalog), *args, str(root)]
    )
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def _verdicts(doc: dict) -> tuple[dict[str, str], set[tuple[str, str, str, str]]]:
    """(checkpoint path -> status, every finding as (severity, code, path, message))."""
    found: set[tuple[str, str, str, str]] = set()

    def add(fs: list[dict]) -> None:
        found.update((f["severity"], f["code"], f["path"], f["message"]) for f in fs)

    statuses = {}
    add(doc["findings"])
    for run in doc["runs"]:
        add(run["findings"])
        for c in run["checkpoints"]:
            statuses[c["path"]] = c["status"]
            add(c["findings"])
            for comp in c["components"]:
                add(comp["findings"])
    return statuses, found


@pytest.mark.slow  # the cases read the trainer trees through request.getfixturevalue
@pytest.mark.parametrize("case", [*CLEAN, "torch-tree", "plain-dcp", *BROKEN])
def test_rescan_that_reuses_the_catalog_forgets_nothing(request, tmp_path, case):
    if case == "torch-tree":
        root = write_torch_tree(tmp_path / "root").parent.parent
    elif case == "plain-dcp":
        step = _source(request, "dcp")
        root = tmp_path / "root"
        shutil.copytree(step.parent, root / step.parent.name, symlinks=True)
    elif case in BROKEN:
        src, corrupt = BROKEN[case]
        run = _copy(_source(request, src), tmp_path)
        corrupt(run)
        root = run.parent.parent
    else:
        root = _copy(_source(request, case), tmp_path).parent.parent
    catalog = tmp_path / "c.db"
    fresh = _scan(root, catalog, "--no-scrub")
    again = _scan(root, catalog, "--no-scrub")
    rehashed = _scan(root, catalog, "--no-scrub", "--rehash")
    assert again["files_reused"] > 0 and rehashed["files_reused"] == 0
    assert _verdicts(again) == _verdicts(fresh)
    assert _verdicts(rehashed) == _verdicts(fresh)
    if case in BROKEN:  # a broken tree that scans clean would prove nothing here
        assert _verdicts(fresh)[1], "the corruption produced no finding"


# -- bit rot under an unchanged stat --------------------------------------------------------------------------


def _rot(path: Path) -> None:
    """One flipped payload byte, size, mtime and inode kept (`touch -r` back)."""
    st = path.stat()
    flip_payload_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _codes_at(doc: dict, path: Path) -> set[str]:
    return {code for _, code, p, _ in _verdicts(doc)[1] if p == str(path)}


def test_bit_rot_is_found_by_the_scrub_within_its_period(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    first = steps_of(run)[0]
    _scan(run, catalog)
    victim = shard(first, "model", 0)
    _rot(victim)
    trusted = _scan(run, catalog, "--no-scrub")
    assert _codes_at(trusted, victim) == set() and trusted["exit_code"] == 0  # the stat cache is blind to it
    scrubbed = _scan(run, catalog, "--scrub-period", "0s")  # the whole period has passed: everything is due
    assert {"hash-drift", "crc-mismatch"} <= _codes_at(scrubbed, victim)
    assert _verdicts(scrubbed)[0][str(first)] == "corrupt" and scrubbed["exit_code"] == 1
    assert scrubbed["files_scrubbed"] == trusted["files_reused"] and scrubbed["bytes_scrubbed"] > 0
    assert _codes_at(_scan(run, catalog, "--no-scrub"), victim) >= {"hash-drift"}  # and the cache now knows


def test_a_daily_scrub_rereads_every_byte_within_the_period_oldest_first(copy_run, verl_run, tmp_path):
    """Daily scans on a simulated clock with the default 7-day period: each reads a share, not everything at
    once, and by the seventh day every file has been re-read by content; a rotten file is found by then."""
    run = copy_run(verl_run)
    t0 = 1_700_000_000 * 10**9
    policy = ScrubPolicy()
    with open_catalog(tmp_path / "c.db") as cat:
        cat.record_scan(scan([run], in_progress_window_s=0, now_ns=t0))
        victim = shard(steps_of(run)[-1], "optim", 1)
        _rot(victim)
        every = set(read_previous(cat.db.conn))
        reread: set[str] = set()
        shares = []
        found_on = None
        for day in range(1, 8):
            r = scan(
                [run],
                in_progress_window_s=0,
                now_ns=t0 + day * DAY_NS,
                scrub=policy,
                previous=read_previous(cat.db.conn),
            )
            cat.record_scan(r)
            reread |= {p for p, f in r.file_facts.items() if f.verified_ns == t0 + day * DAY_NS}
            shares.append(r.bytes_scrubbed)
            if found_on is None and any(f.code == "hash-drift" for f in r.all_findings):
                found_on = day
    total = sum(f.size_bytes for f in read_previous(tmp_path / "c.db").values())
    assert every <= reread and found_on is not None
    assert max(shares[:6]) < total / 2  # spread over the days, not all at once
    assert sum(shares) >= total


def test_verify_rereads_by_default_and_trust_cache_does_not(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    _scan(run, catalog)
    victim = shard(steps_of(run)[0], "model", 0)
    _rot(victim)

    def verify(*args: str) -> dict:
        res = CliRunner().invoke(
            cli, ["verify", "--json", "--in-progress-window", "0", "--catalog", str(catalog), *args, str(run)]
        )
        assert res.exit_code in (0, 1), res.output
        return json.loads(res.stdout)

    trusted = verify("--trust-cache")
    assert _codes_at(trusted, victim) == set() and trusted["files_reused"] > 0
    checked = verify()
    assert {"hash-drift", "crc-mismatch"} <= _codes_at(checked, victim) and checked["exit_code"] == 1
    assert checked["files_reused"] == 0
    both = CliRunner().invoke(cli, ["verify", "--trust-cache", "--rehash", "--catalog", str(catalog), str(run)])
    assert both.exit_code == 2


def test_hash_drift_outside_every_crc_is_not_forgotten_by_a_later_read(copy_run, verl_run, tmp_path):
    """Only the hash sees a changed byte outside the CRC'd payload: once seen, re-reading the same rotten bytes
    (scrub, --rehash) and reusing the row (no scrub) all keep it."""
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    _scan(run, catalog)
    victim = shard(steps_of(run)[0], "model", 0)
    st = victim.stat()
    with open(victim, "r+b") as f:  # the local header's mod-time field
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "hash-drift" in _codes_at(_scan(run, catalog, "--rehash"), victim)
    for args in (["--rehash"], ["--scrub-period", "0s"], ["--no-scrub"]):
        doc = _scan(run, catalog, *args)
        assert "hash-drift" in _codes_at(doc, victim), args
        assert _verdicts(doc)[0][str(steps_of(run)[0])] == "corrupt"


def test_scrub_budget_caps_the_reread_and_reports_what_is_overdue(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    t0 = 1_700_000_000 * 10**9
    with open_catalog(tmp_path / "c.db") as cat:
        cat.record_scan(scan([run], in_progress_window_s=0, now_ns=t0))
        prev = read_previous(cat.db.conn)
    later = scan(
        [run], in_progress_window_s=0, now_ns=t0 + 8 * DAY_NS, previous=prev, scrub=ScrubPolicy(budget_bytes=1)
    )
    assert later.files_scrubbed == 1  # the one file that crosses the budget
    [overdue] = [f for f in later.findings if f.code == "scrub-overdue"]
    assert overdue.severity.label == "warning" and overdue.message.startswith(f"{later.files_reused} file(s)")


def test_verified_times_reach_the_catalog_ls_show_and_json(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    doc = _scan(run, catalog)
    ck = doc["runs"][0]["checkpoints"][0]
    assert ck["verified_ns"] and all(f["verified_ns"] == ck["verified_ns"] for f in ck["components"][0]["files"])
    assert {"files_scrubbed", "bytes_scrubbed"} <= set(doc)
    runner = CliRunner()
    rows = json.loads(runner.invoke(cli, ["ls", str(run), "--json", "--catalog", str(catalog)]).stdout)["checkpoints"]
    assert all(r["verified_ns"] for r in rows)
    assert "verified" in runner.invoke(cli, ["ls", str(run), "--catalog", str(catalog)]).output
    detail = json.loads(runner.invoke(cli, ["show", ck["path"], "--json", "--catalog", str(catalog)]).stdout)
    assert detail["checkpoint"]["verified_ns"] == min(f["verified_ns"] for f in detail["checkpoint"]["files"])
    scrubbed = _scan(run, catalog, "--scrub-period", "0s")
    with sqlite3.connect(catalog) as db:
        assert (
            db.execute("SELECT bytes_scrubbed FROM scans WHERE id = ?", [scrubbed["scan_id"]]).fetchone()[0]
            == (scrubbed["bytes_scrubbed"])
            > 0
        )
        db.execute("UPDATE files SET verified_ns = NULL WHERE path = ?", [ck["components"][0]["files"][0]["path"]])
    show = runner.invoke(cli, ["show", ck["path"], "--catalog", str(catalog)]).output
    assert "verified never" in show.splitlines()[0]


def test_a_row_never_verified_by_content_is_read_again(copy_run, verl_run, tmp_path):
    """A catalog row from before verified_ns and pt_facts existed cannot vouch for what the rules read."""
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    first = _scan(run, catalog)
    with sqlite3.connect(catalog) as db:
        db.execute("UPDATE files SET verified_ns = NULL, pt_facts = NULL")
    again = _scan(run, catalog, "--no-scrub")
    assert again["files_reused"] == 0 and _verdicts(again) == _verdicts(first)


def test_a_row_read_under_other_reader_rules_is_read_again(copy_run, verl_run, tmp_path):
    """An upgrade whose readers check more (readers.RULES) must not keep the older readers' word on bytes they
    passed: a row read under other rules vouches for nothing, so a flip the stat cache would hide is found."""
    run = copy_run(verl_run)
    catalog = tmp_path / "c.db"
    _scan(run, catalog)
    victim = shard(steps_of(run)[0], "model", 0)
    _rot(victim)
    assert _codes_at(_scan(run, catalog, "--no-scrub"), victim) == set()  # same rules: the stat cache vouches
    with sqlite3.connect(catalog) as db:  # as an older release left it (its run verdict keys held its RULES)
        db.execute("UPDATE files SET read_rules = ?", [RULES - 1])
        db.execute("DELETE FROM run_verdicts")
    again = _scan(run, catalog, "--no-scrub")
    assert again["files_reused"] == 0 and {"hash-drift", "crc-mismatch"} <= _codes_at(again, victim)
    with sqlite3.connect(catalog) as db:
        assert db.execute("SELECT DISTINCT read_rules FROM files WHERE present = 1").fetchall() == [(RULES,)]
    assert _scan(run, catalog, "--no-scrub")["files_reused"] > 0  # read under today's rules: vouched for again


# -- the plan (pure) ------------------------------------------------------------------------------------------


def _scrub(*specs: tuple[str, int, int], **options) -> ScrubPlan:
    """plan_scrub over files given as (path, size, verified day) specs."""
    sizes = {p: s for p, s, _v in specs}
    verified = {p: v * DAY_NS for p, _s, v in specs}
    return plan_scrub(verified, sizes.__getitem__, total_bytes=sum(sizes.values()), **options)


def test_plan_takes_the_pro_rata_share_oldest_first():
    files = (("a", 10, 3), ("b", 10, 1), ("c", 10, 2), ("d", 10, 4), ("e", 10, 5), ("f", 10, 6), ("g", 10, 7))
    plan = _scrub(*files, now_ns=8 * DAY_NS, policy=ScrubPolicy(), budget_bytes=None)  # 1 day of 7 since day 7
    assert plan == ScrubPlan(paths=frozenset({"b"}), bytes=10)


def test_plan_takes_everything_due_and_reports_what_the_budget_leaves():
    files = (("a", 10, 0), ("b", 10, 0), ("c", 10, 0), ("d", 10, 9))
    assert _scrub(*files, now_ns=10 * DAY_NS, policy=ScrubPolicy(), budget_bytes=None) == ScrubPlan(
        paths=frozenset({"a", "b", "c"}), bytes=30
    )
    assert _scrub(*files, now_ns=10 * DAY_NS, policy=ScrubPolicy(), budget_bytes=15) == ScrubPlan(
        paths=frozenset({"a", "b"}), bytes=20, overdue_files=1, overdue_bytes=10
    )


def test_plan_keeps_oldest_first_order_past_its_first_pick():
    # 300 due files (more than the plan's first linear pick), verified days shuffled, ties broken by path: the
    # budget takes exactly the oldest 100 and the rest are reported overdue
    specs = [(f"f{i:03d}", 1, (i * 7) % 150) for i in range(300)]
    plan = _scrub(*specs, now_ns=200 * DAY_NS, policy=ScrubPolicy(), budget_bytes=100)
    oldest = sorted(specs, key=lambda s: (s[2], s[0]))[:100]
    assert plan == ScrubPlan(
        paths=frozenset(p for p, _s, _v in oldest), bytes=100, overdue_files=200, overdue_bytes=200
    )
