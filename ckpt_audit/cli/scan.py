"""`ckpt-audit scan`, `ls` and `show`: hash and judge checkpoints; answer from the catalog."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from ckpt_audit.cli.common import (
    DURATION,
    SIZE,
    Bar,
    CommandError,
    catalog_option,
    check_junit_writable,
    emit_json,
    junit_option,
    ray_option,
    require_torch,
    resolve_catalog,
    session,
    write_junit_report,
    write_metrics_file,
)
from ckpt_audit.exitcodes import ExitCode
from ckpt_audit.models import IN_PROGRESS_WINDOW_S

if TYPE_CHECKING:
    pass


def scan_options(f):
    """The options scan and verify share."""
    for option in reversed(
        [
            click.option(
                "--json", "as_json", is_flag=True, help="Print one JSON document (with schema_version) to stdout."
            ),
            click.option(
                "-q", "--quiet", is_flag=True, help="Print nothing when clean; else only the failing findings."
            ),
            click.option(
                "--fail-on",
                type=click.Choice(["info", "warning", "error"]),
                default="error",
                show_default=True,
                help="Exit 1 when a finding at or above this severity is present.",
            ),
            click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True, help="Reader threads."),
            click.option(
                "--rehash",
                is_flag=True,
                help="Re-read every file, and report content that changed under an unchanged stat (hash-drift).",
            ),
            click.option(
                "--in-progress-window",
                type=click.FloatRange(0),
                default=IN_PROGRESS_WINDOW_S,
                show_default=True,
                metavar="SECONDS",
                help="An uncommitted checkpoint written this recently is in-progress, not broken.",
            ),
            catalog_option,
            junit_option,
        ]
    ):
        f = option(f)
    return f


def scrub_options(f):
    """scan's scrub: re-read a rolling share of the files the stat cache would reuse (ckpt_audit/scan/scrub.py)."""
    for option in reversed(
        [
            click.option(
                "--scrub-period",
                type=DURATION,
                default="7d",
                show_default=True,
                help="Re-read every cached byte by content at least once per this period (e.g. 7d, 12h; 0s: "
                "every scan).",
            ),
            click.option(
                "--scrub-budget",
                type=SIZE,
                default=None,
                help="At most this many bytes re-read by the scrub per scan (e.g. 50GiB); default: no cap. "
                "Files left overdue are reported (scrub-overdue).",
            ),
            click.option("--no-scrub", is_flag=True, help="Reuse every cached file (trust the stat cache this run)."),
        ]
    ):
        f = option(f)
    return f


@click.command("scan")
@click.argument("roots", nargs=-1, required=True, type=click.Path())
@click.option("--deep", is_flag=True, help="Also run verify's deep checks (imports torch; per-file cost).")
@scan_options
@scrub_options
@click.option(
    "--metrics-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write Prometheus metrics here for node_exporter's textfile collector (written atomically; e.g. "
    "/var/lib/node_exporter/textfile/ckpt_audit.prom). Sample alerts: docs/alerts.yml.",
)
@ray_option(
    "Scan on a Ray cluster: each node its own disk's copy of each root, or all nodes one shared root "
    "(--placement; docs/ray.md; needs the "
    "extra: pip install 'ckpt-audit[ray]', else exit 2). Example: ckpt-audit scan --ray auto /ckpts"
)
@click.option(
    "--node-gone-after",
    type=DURATION,
    default="1d",
    show_default=True,
    help="With --ray: a node silent this long is gone; only checkpoints with files catalogued on it alone stay "
    "unknown (node-gone), the rest are judged without it (docs/ray.md).",
)
@click.option(
    "--placement",
    type=click.Choice(["auto", "node-local", "shared"]),
    default="auto",
    show_default=True,
    help="With --ray: node-local (each node scans its own disk's copy of each root), shared (one shared root's files "
    "are read by all nodes at once) or auto: shared only when the root is on a network filesystem and every node "
    "sees the same root directory (docs/ray.md).",
)
@click.option(
    "--store-checksums",
    is_flag=True,
    help="Also record each file's CRC-32C, CRC-64/NVME and CRC-32 (what S3 and GCS keep), so a remote scan or "
    "`compare` can check a bucket's copy without downloading it (docs/remote.md). Costs hashing speed.",
)
@click.option(
    "--read-data",
    is_flag=True,
    help="s3:// roots: download and read every object of each run (CRCs, structure) instead of judging it from "
    "its metadata (docs/remote.md).",
)
@click.pass_context
def scan_command(
    ctx: click.Context,
    roots,
    deep,
    store_checksums,
    read_data,
    scrub_period,
    scrub_budget,
    no_scrub,
    metrics_file,
    ray_address=None,
    node_gone_after=None,
    **options,
) -> None:
    """Hash, validate and catalog every checkpoint under ROOT... (cron-ready).

    Walks each root (links out of it are reported, not followed), hashes every file of every run with xxh3-128
    while checking the CRC-32 of each .pt zip entry, reads data.pkl without executing it, gives every checkpoint a
    status and records the scan in the catalog. Unchanged files (size, mtime, inode) reuse their recorded hash and
    findings, except a rolling share re-read by content (the scrub): the files last verified a --scrub-period ago,
    plus the period's pro-rata share since the last content read, oldest first, capped by --scrub-budget. Content
    that changed under an unchanged stat is hash-drift. `--deep` adds everything `ckpt-audit verify` checks.

    Exit codes: 0 clean, 1 findings at/above --fail-on, 2 usage, 3 error (bad root or catalog), 4 another run holds
    the catalog lock.

    \b
    Example:
        ckpt-audit scan /ckpts
        ckpt-audit scan -q --fail-on warning /ckpts /scratch/ckpts   # cron: mail only when something is wrong
        ckpt-audit scan --scrub-budget 200GiB /ckpts                 # cap the nightly re-read
        ckpt-audit scan -q --metrics-file /var/lib/node_exporter/textfile/ckpt_audit.prom /ckpts  # + Prometheus
        ckpt-audit scan --json --catalog ./catalog.db runs/ | jq .summary
        ckpt-audit scan --junit-xml scan.xml /ckpts                  # CI: one test case per checkpoint
    """
    from ckpt_audit.session.scan_terms import ScrubPolicy

    # for this command only (click closes them with its context: a test's CliRunner runs many in one process)
    if store_checksums:
        from ckpt_audit.session.stores import store_checksums_on

        ctx.with_resource(store_checksums_on())
    if read_data:
        from ckpt_audit.session.stores import read_data_on

        ctx.with_resource(read_data_on())
    scrub = None if no_scrub else ScrubPolicy(period_ns=scrub_period, budget_bytes=scrub_budget)
    placement = options.pop("placement")
    if ray_address is None and placement != "auto":
        raise click.UsageError("--placement needs --ray")
    if ray_address is not None:  # a shared store: the local scan with its reads spread over the nodes
        from ckpt_audit.cli.ray_shared import run_if_shared

        run_if_shared(
            ctx,
            roots,
            address=ray_address,
            placement=placement,
            deep=deep,
            scrub=scrub,
            metrics_file=metrics_file,
            run_scan=run_scan,
            **options,
        )  # returns only when the placement is node-local
    if ray_address is not None:  # Ray is loaded only here (ckpt_audit.cluster imports it lazily)
        from ckpt_audit.cli.ray import run_ray_scan

        return run_ray_scan(
            ctx,
            roots,
            address=ray_address,
            deep=deep,
            scrub=scrub,
            metrics_file=metrics_file,
            gone_after_ns=node_gone_after,
            **options,
        )
    run_scan(ctx, roots, deep=deep, scrub=scrub, metrics_file=metrics_file, **options)


def run_scan(
    ctx: click.Context,
    paths,
    *,
    deep: bool,
    as_json: bool,
    quiet: bool,
    fail_on: str,
    workers: int,
    rehash: bool,
    in_progress_window: float,
    catalog: str | None,
    scrub=None,
    metrics_file: str | None = None,
    reader=None,
    extra=None,
    junit_xml: str | None = None,
) -> None:
    """Scan (or verify) under the catalog lock, record, render, exit: the one body behind `scan` and `verify`.
    `scrub`: a scrub.ScrubPolicy, or None to reuse every cached file (verify re-reads everything instead).
    `reader`: who reads the files (scan --ray's shared placement); `extra`: a callable adding keys to the JSON."""
    command = ctx.info_name or "scan"  # the subcommand's name (scan or verify); None only for a hand-made context
    if deep:
        require_torch(f"{command} --deep" if command == "scan" else command)
    check_junit_writable(junit_xml)
    options = dict(workers=workers, rehash=rehash, in_progress_window_s=in_progress_window, scrub=scrub)
    with session(ctx, paths, catalog) as s:
        with Bar("hashing", enabled=not as_json and not quiet) as bar:
            progress = bar if bar.enabled else None
            done = (
                s.verify(paths, progress=progress, **options)
                if deep
                else s.scan(
                    progress=progress,
                    reader=reader,
                    cached_verdicts=True,
                    # only what the exit code and `-q` print need: the kept runs' summaries (a million files'
                    # models cost ~2 s to decode); --json, the text report and the textfiles walk every run
                    kept_models=as_json or not quiet or metrics_file is not None or junit_xml is not None,
                    **options,
                )
            )
    from ckpt_audit import report  # after the scan: rendering is not on the path to the first file read

    threshold = report.FAIL_ON[fail_on]  # fail_on is a click.Choice of FAIL_ON's keys
    result, scan_id, cat_path = done.result, done.scan_id, s.catalog_path
    if metrics_file is not None:
        write_metrics_file(metrics_file, result, scrub)
    code = ExitCode.FINDINGS if report.failing(result, threshold) else ExitCode.OK
    if junit_xml is not None:
        from ckpt_audit.report_junit import scan_suite

        write_junit_report(junit_xml, [scan_suite(result, threshold, name=command)])
    if as_json:
        doc = report.scan_document(result, scan_id=scan_id, catalog=os.fspath(cat_path), exit_code=int(code))
        emit_json({**doc, "command": command, "deep": deep, **(extra() if extra else {})})
    else:
        for line in report.render_text(result, quiet=quiet, fail_on=threshold):
            click.echo(line)
    ctx.exit(int(code))


@contextmanager
def _open(catalog: str | None):
    """The catalog through the session's read path (read-only, no lock: `ls` and `show` never wait for a cron run,
    and work for a user who can write neither the catalog nor its directory)."""
    from ckpt_audit.session import SessionError, reading

    try:
        with reading(resolve_catalog(catalog)) as cat:
            yield cat
    except SessionError as exc:
        raise CommandError(str(exc)) from None


@click.command("ls")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout.")
@catalog_option
def ls_command(run, as_json, catalog) -> None:
    """List runs from the catalog, or one RUN's checkpoints with status, size and age.

    RUN is a run directory or its `project/experiment` name.

    \b
    Example:
        ckpt-audit ls
        ckpt-audit ls demo/exp --json
    """
    from ckpt_audit.models import format_size
    from ckpt_audit.report import age_str

    with _open(catalog) as cat:
        runs = cat.runs()
        if run is None:
            if as_json:
                emit_json({"command": "ls", "runs": runs})
                return
            click.echo(f"{'run':<40} {'ckpts':>5} {'latest ok':>9} {'tracker':>7} {'size':>10}  statuses")
            for r in runs:
                st = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
                click.echo(
                    f"{r['name']:<40} {r['n_checkpoints']:>5} {_dash(r['latest_complete_step']):>9} "
                    f"{_dash(r['tracker_step']):>7} {format_size(r['size_bytes']):>10}  {st}"
                )
            return
        match = [r for r in runs if r["path"] == _target(run) or r["name"] == run.strip("/")]
        if not match:
            raise CommandError(f"no run {run!r} in the catalog")
        rows = cat.checkpoints(match[0]["path"])
        if as_json:
            emit_json({"command": "ls", "run": match[0], "checkpoints": rows})
            return
        click.echo(f"{match[0]['name']}  ({match[0]['path']})")
        with_nodes = any(c["nodes"] for c in rows)  # scan --ray recorded which node holds what
        click.echo(
            f"{'step':>8}  {'status':<12} {'W':>3} {'size':>10} {'age':>5} {'errors':>6} {'warnings':>8} "
            f"{'verified':>8}" + ("  nodes" if with_nodes else "")
        )
        for c in rows:
            click.echo(
                f"{c['step']:>8}  {c['status']:<12} {_dash(c['world_size']):>3} {format_size(c['size_bytes']):>10} "
                f"{age_str(c['mtime_ns']):>5} {c['errors']:>6} {c['warnings']:>8} {verified_ago(c['verified_ns']):>8}"
                + (f"  {node_list(c['nodes'])}" if with_nodes else "")
            )


@click.command("show")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout.")
@catalog_option
def show_command(path, as_json, catalog) -> None:
    """Show one checkpoint's files and findings, or one file's hash history, from the catalog.

    \b
    Example:
        ckpt-audit show /ckpts/proj/exp/global_step_40
        ckpt-audit show /ckpts/proj/exp/global_step_40/actor/model_world_size_8_rank_0.pt --json
    """
    from ckpt_audit.models import format_size

    target = _target(path)
    with _open(catalog) as cat:
        detail = cat.checkpoint_detail(target) or cat.checkpoint_detail(os.path.realpath(target))
        if detail is not None:
            if as_json:
                emit_json({"command": "show", "checkpoint": detail})
                return
            click.echo(
                f"{detail['path']}  step {detail['step']}  {detail['status']}  W {_dash(detail['world_size'])}"
                f"  {format_size(detail['size_bytes'])}  verified {verified_ago(detail['verified_ns'])}"
            )
            with_nodes = bool(detail["nodes"])  # scan --ray recorded which node holds each file
            for f in detail["files"]:
                crc = {True: "crc ok", False: "CRC BAD", None: ""}[f["crc_ok"]]
                click.echo(
                    f"  {f['kind']:<12} {_dash(f['rank']):>4} {format_size(f['size_bytes']):>10} "
                    f"{(f['hash'] or 'unreadable')[:16]:<16} {crc:<7} {verified_ago(f['verified_ns']):>5} "
                    + (f"{node_list(f['nodes']):<17} " if with_nodes else "")
                    + f["path"]
                )
            shown = set()
            for o in detail["optimizer_format"]:  # the same flags in each dist_ckpt of a role: once a role
                if (o["role"], o["distrib_optim_sharding_type"]) not in shown:
                    shown.add((o["role"], o["distrib_optim_sharding_type"]))
                    kind = o["distrib_optim_sharding_type"] or "-"
                    click.echo(f"  optimizer format ({o['role'] or o['path']}): {kind}: {o['resharding']}")
            for x in detail["findings"]:
                click.echo(f"  {x['severity']:<7} {x['code']:<24} {x['path']}: {x['message']}")
            return
        history = cat.file_history(target) or cat.file_history(os.path.realpath(target))
        if not history:
            raise CommandError(f"{target} is neither a catalogued checkpoint nor a catalogued file")
        if as_json:
            emit_json({"command": "show", "file": target, "history": history})
            return
        click.echo(target)
        for h in history:
            click.echo(f"  scan {h['scan_id']:>5}  {h['hash'] or 'unreadable'}  {format_size(h['size_bytes'])}")


def _target(path: str) -> str:
    """What the catalog keys `path` by: a URL as given (s3://…, docs/remote.md), a local path made absolute."""
    from ckpt_audit.session.stores import catalog_key

    return catalog_key(path)


def verified_ago(ns: int | None) -> str:
    """When content was last read in full, as an age ('3h ago'); 'never' for a file the catalog never read whole."""
    import time

    from ckpt_audit.units import format_ago

    return format_ago(ns, time.time_ns())


def node_list(nodes) -> str:
    """Ray node ids shortened to 8 characters (as `ray status` does), comma-joined; '-' for none."""
    return ",".join(n[:8] for n in nodes) or "-"


def _dash(v) -> str:
    return "-" if v is None else str(v)
