"""Re-scan of an unchanged tree, whole process and in parts, as ratios against a plain os.scandir walk.

Builds N small shards in torch's zip layout (no torch needed) spread over K verl runs (W=8) under one root, scans
once into a fresh catalog (the first scan: time, CPU, peak RSS and catalog size printed), then times the re-scan the
cron job makes: `ckpt-audit scan -q` as a fresh process (interpreter start, imports, manifest read, walk, reuse every
hash by stat, judge, record the scan; CPU and peak RSS of the child), and the same steps in this process, split.
Goals (issues 16 and 27): whole process < 0.5 s at 10k files, < 3 s at 100k, < 10 s at 1M; runs with --files
10000/100000/1000000 and --runs N/10000 give the growth with the same shape.

    python bench/bench_rescan.py [--files 10000] [--runs 1] [--repeat 3]
    nice -n 10 python bench/bench_rescan.py --files 1000000 --runs 100 --dir /tmp/rescan-1m/n1m --prepare
    python bench/bench_rescan.py --files 1000000 --runs 100 --dir /tmp/rescan-1m/n1m --repeat 2 --label before

--dir keeps the tree and the first scan's catalog (first.db) there; each measurement works on a copy of it named by
--label, so another version of ckpt-audit (--other-src, on PYTHONPATH, timed whole-process and interleaved) or a
later commit starts from the same catalog.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

PER_STEP = 3 * 8 + 2  # W=8: model/optim/extra_state per rank + fsdp_config + data.pt


def per_step(world: int) -> int:
    return 3 * world + 2


_SID = b"0" * 16  # placeholder serialization id, replaced per file so that no two files hash alike


def zip_template(stem: str) -> tuple[bytes, int, tuple[int, ...]]:
    """A tiny archive shaped like torch.save's (stored entries under the file stem: data.pkl, byteorder, version,
    .data/serialization_id), and where its serialization id and that entry's two CRC-32 copies lie."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{stem}/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        z.writestr(f"{stem}/byteorder", "little")
        z.writestr(f"{stem}/version", "3\n")
        z.writestr(f"{stem}/.data/serialization_id", _SID)
    data = buf.getvalue()
    crc = struct.pack("<I", zlib.crc32(_SID))
    crc_at = tuple(i for i in range(len(data) - 3) if data[i : i + 4] == crc)
    assert data.count(_SID) == 1 and len(crc_at) == 2, "template: id or CRC not unique"  # local + central header
    return data, data.index(_SID), crc_at


def write_zip(path: Path, template: tuple[bytes, int, tuple[int, ...]]) -> None:
    """The template with a fresh serialization id and its CRC-32 patched in: a valid zip, ~3x faster than zipfile."""
    data, at, crc_at = template
    b = bytearray(data)
    sid = os.urandom(8).hex().encode()
    b[at : at + 16] = sid
    crc = struct.pack("<I", zlib.crc32(sid))
    for o in crc_at:
        b[o : o + 4] = crc
    with open(path, "wb") as f:
        f.write(b)


def build(root: Path, n_files: int, runs: int = 1, world: int = 8) -> list[Path]:
    """`runs` verl runs of n_files/runs files each under root/proj (one run keeps the old path, proj/exp), each
    step `world` ranks' shards (3 files a rank) plus fsdp_config.json and data.pt."""
    steps = max(1, n_files // runs // per_step(world))
    stems = [f"{kind}_world_size_{world}_rank_{r}" for r in range(world) for kind in ("model", "optim", "extra_state")]
    templates = {s: zip_template(s) for s in [*stems, "data"]}
    out = []
    for k in range(runs):
        run = root / "proj" / ("exp" if runs == 1 else f"exp_{k:04d}")
        for s in range(1, steps + 1):
            actor = run / f"global_step_{s}" / "actor"
            actor.mkdir(parents=True)
            for stem in stems:
                write_zip(actor / f"{stem}.pt", templates[stem])
            (actor / "fsdp_config.json").write_text(f'{{\n    "FSDP_version": 2,\n    "world_size": {world}\n}}')
            write_zip(run / f"global_step_{s}" / "data.pt", templates["data"])
        (run / "latest_checkpointed_iteration.txt").write_text(str(steps))
        out.append(run)
    return out


def walk_baseline(root: str) -> int:
    n = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    e.stat(follow_symlinks=False)
                    n += 1
    return n


def child_env(work: Path, src: str | None = None) -> dict[str, str]:
    # children load cached bytecode, as an installed package does (see bench_startup.py), and this checkout's
    # source from PYTHONPATH, as --other-src's: both sides find their package the same way
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    env["PYTHONPATH"] = src or str(Path(__file__).resolve().parents[1])
    return env


def timed_scan(db: Path, root: Path, env: dict[str, str], extra: tuple[str, ...] = ()) -> dict[str, float]:
    """`ckpt-audit scan -q` in a fresh process: wall, CPU (user+sys) and peak RSS (from /usr/bin/time when there:
    a child's own ru_maxrss would include this big process's high-water mark, inherited across fork/exec)."""
    cmd = [sys.executable, "-m", "ckpt_audit", "scan", "-q", "--in-progress-window", "0", *extra, "--catalog"]
    fd, rss_file = tempfile.mkstemp(prefix="bench-rescan-rss-")
    os.close(fd)
    pre = ["/usr/bin/time", "-f", "%M", "-o", rss_file] if os.path.exists("/usr/bin/time") else []
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    # cwd: the catalog's folder, so that `-m` finds ckpt_audit on PYTHONPATH or installed, not in the repository
    proc = subprocess.run([*pre, *cmd, str(db), str(root)], capture_output=True, text=True, env=env, cwd=db.parent)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss = Path(rss_file).read_text().strip().splitlines()[-1] if pre else ""
    os.unlink(rss_file)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"wall": wall, "cpu": cpu, "rss_mib": int(rss) / 1024 if rss.isdigit() else float("nan")}


def prepare(work: Path, n_files: int, runs: int, world: int = 8) -> dict:
    """Build the tree and first-scan it whole-process into work/first.db; the figures go to work/first_scan.json."""
    root = work / "root"
    t, c = time.perf_counter(), time.process_time()
    build(root, n_files, runs, world)
    built = {"build_wall": time.perf_counter() - t, "build_cpu": time.process_time() - c}
    warm = work / "warmup"  # one small untimed scan writes the bytecode, so the first scan is not timed compiling
    build(warm / "root", PER_STEP)
    timed_scan(warm / "c.db", warm / "root", child_env(work))
    shutil.rmtree(warm)
    db = work / "first.db"
    first = timed_scan(db, root, child_env(work), ("--fail-on", "warning"))  # the bench tree must scan clean
    info = {
        "files": walk_baseline(str(root)),
        "runs": runs,
        **built,
        **{f"first_{k}": v for k, v in first.items()},
        "first_catalog_mib": db.stat().st_size / 2**20,
        "load": os.getloadavg()[0],
    }
    (work / "first_scan.json").write_text(json.dumps(info, indent=1))
    return info


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=1, help="spread the files over this many runs under one root")
    ap.add_argument("--world", type=int, default=8, help="ranks per step (3 files a rank, 2 more a step)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="keep the tree and first catalog here (built when absent)")
    ap.add_argument("--prepare", action="store_true", help="with --dir: only build and first-scan (run it niced)")
    ap.add_argument("--label", default="c", help="with --dir: the catalog copy this run measures (LABEL.db)")
    ap.add_argument("--other-src", default=None, help="also time this source tree whole-process, interleaved")
    ap.add_argument("--other-label", default="other", help="the catalog copy --other-src uses (LABEL.db)")
    ap.add_argument("--no-parts", action="store_true", help="skip the in-process split (whole process only)")
    args = ap.parse_args()

    tmp = None if args.dir else tempfile.TemporaryDirectory()
    work = Path(args.dir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not (work / "first_scan.json").exists():
            info = prepare(work, args.files, args.runs, args.world)
        else:
            info = json.loads((work / "first_scan.json").read_text())
        print(
            f"first scan of {info['files']} files in {info['runs']} runs: wall {info['first_wall']:.1f} s, "
            f"CPU {info['first_cpu']:.1f} s, peak RSS {info['first_rss_mib']:.0f} MiB, catalog "
            f"{info['first_catalog_mib']:.1f} MiB (tree built in {info['build_wall']:.0f} s; load {info['load']:.1f})"
        )
        if args.prepare:
            return
        measure(work, args)
    finally:
        if tmp:
            tmp.cleanup()


def measure(work: Path, args: argparse.Namespace) -> None:
    from ckpt_audit.catalog import open_catalog, read_previous
    from ckpt_audit.scan import scan

    try:  # the cron scan's path since the per-run verdict cache: the manifest loads lazily, verdicts are reused
        from ckpt_audit.catalog.manifest import LazyManifest
        from ckpt_audit.catalog.verdicts import CatalogVerdicts
    except ImportError:
        LazyManifest = CatalogVerdicts = None

    root = work / "root"
    dbs = {"this": work / f"{args.label}.db"}
    envs = {"this": child_env(work)}
    if args.other_src:
        dbs["other"], envs["other"] = work / f"{args.other_label}.db", child_env(work, args.other_src)
    for db in dbs.values():
        if not db.exists():
            shutil.copyfile(work / "first.db", db)
    n = walk_baseline(str(root))
    for k in dbs:  # writes the bytecode, migrates a copied catalog; not timed
        timed_scan(dbs[k], root, envs[k])
    db = dbs["this"]
    parts: dict[str, list[float]] = {"manifest": [], "scan": [], "record": []}
    cpu: dict[str, list[float]] = {"manifest": [], "scan": [], "record": []}
    base, bare = [], []
    whole: dict[str, list[dict[str, float]]] = {k: [] for k in dbs}
    res = None
    for _ in range(args.repeat):
        t = time.perf_counter()
        walk_baseline(str(root))
        base.append(time.perf_counter() - t)
        if not args.no_parts:
            c0, t0 = time.process_time(), time.perf_counter()
            if CatalogVerdicts is None:
                prev, verdicts = read_previous(db), {}
            else:
                prev, verdicts = LazyManifest(db), {"verdicts": CatalogVerdicts(db)}
            c1, t1 = time.process_time(), time.perf_counter()
            res = scan([root], previous=prev, in_progress_window_s=0, **verdicts)
            c2, t2 = time.process_time(), time.perf_counter()
            with open_catalog(db) as cat:
                cat.record_scan(res)
            c3, t3 = time.process_time(), time.perf_counter()
            for k, v, c in zip(parts, (t1 - t0, t2 - t1, t3 - t2), (c1 - c0, c2 - c1, c3 - c2)):
                parts[k].append(v)
                cpu[k].append(c)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=envs["this"])
        bare.append(time.perf_counter() - t)
        for k in dbs:  # interleaved: both versions see the same box
            whole[k].append(timed_scan(dbs[k], root, envs[k]))
    print(f"files in tree: {n}; load {os.getloadavg()[0]:.1f}")
    if res is not None:
        cached = (
            "no verdict cache (manifest read up front)"
            if CatalogVerdicts is None
            else f"runs reused from the verdict cache {len(res.runs_reused)} of {len(res.runs)}; "
            f"manifest loaded lazily: {'yes' if prev.loaded else 'no'}"
        )
        print(f"in-process: reused by stat {res.files_reused}; hashed {res.files_hashed}; {cached}")
    print(f"plain os.scandir walk + stat: {med(base) * 1000:.0f} ms (median of {args.repeat})")
    if not args.no_parts:
        r = [sum(v) for v in zip(*parts.values())]
        print(
            f"in-process re-scan (manifest read, walk, reuse, judge, record): {med(r) * 1000:.0f} ms "
            f"(min {min(r) * 1000:.0f}, max {max(r) * 1000:.0f}); parts: "
            + ", ".join(f"{k} {med(v) * 1000:.0f} ms" for k, v in parts.items())
            + f"; ratio to the walk {med(r) / med(base):.1f}x"
        )
        print(
            "in-process CPU (user+sys; steadier than wall time on a loaded box): "
            + ", ".join(f"{k} {med(v) * 1000:.0f} ms" for k, v in cpu.items())
        )
    goal = 0.5 if n <= 20_000 else 3.0 if n <= 200_000 else 10.0 * n / 1_000_000  # issues 16 and 27
    for k, runs in whole.items():
        name = args.label if k == "this" else f"{args.other_label} ({args.other_src})"
        w, c, rss = ([x[f] for x in runs] for f in ("wall", "cpu", "rss_mib"))
        print(
            f"whole process `ckpt-audit scan -q` [{name}]: wall {med(w) * 1000:.0f} ms (min {min(w) * 1000:.0f}); "
            f"CPU {med(c) * 1000:.0f} ms (min {min(c) * 1000:.0f}); peak RSS {med(rss):.0f} MiB; catalog "
            f"{dbs[k].stat().st_size / 2**20:.1f} MiB; goal < {goal:.1f} s: {'met' if med(w) < goal else 'MISSED'}"
        )
    print(f"bare python {med(bare) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
