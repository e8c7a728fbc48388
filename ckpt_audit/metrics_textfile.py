"""`scan --metrics-file`: a scan as node_exporter textfile-collector metrics (Prometheus text format).

Per run (labels `run`, the run directory, and `name`, project/experiment): checkpoints by status, bytes, the
newest complete step with its mtime and age, findings by severity and code, the oldest content verification of
its files. Per scan: duration, bytes and files hashed, files reused, bytes scrubbed, the scrub period and when it
finished. Written with prometheus_client's `write_to_textfile` (a temporary file renamed over the target), so the
collector never reads half a file. prometheus_client is imported here only, so scan's start-up stays light.
Sample alert rules: docs/alerts.yml.
"""

from __future__ import annotations

import os
from collections import Counter

from ckpt_audit.models import ScanResult, Status

PREFIX = "ckpt_audit"


def build_registry(result: ScanResult, *, now_ns: int, scrub_period_ns: int | None):
    """A CollectorRegistry holding the scan's metrics."""
    from prometheus_client import CollectorRegistry, Gauge

    reg = CollectorRegistry()
    labels = ["run", "name"]

    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", doc, [*labels, *extra], registry=reg)

    ckpts = gauge("checkpoints", "Checkpoints of the run by status.", ("status",))
    size = gauge("run_bytes", "Bytes of every checkpoint of the run.")
    latest = gauge("latest_complete_step", "Step of the newest complete checkpoint (absent: none).")
    latest_ts = gauge("latest_complete_timestamp_seconds", "mtime of the newest complete checkpoint.")
    latest_age = gauge("latest_complete_age_seconds", "Age of the newest complete checkpoint at scan time.")
    found = gauge("findings", "Findings of the run's latest scan by severity and code.", ("severity", "code"))
    verified = gauge(
        "oldest_verification_timestamp_seconds",
        "When the run's least recently verified file was last read by content (0: one never was).",
    )
    unverified = gauge("unverified_files", "Files of the run never read by content in full.")
    for run in result.runs:
        lv = (run.path, run.name)
        by_status = Counter(c.status for c in run.checkpoints)
        for st in Status:
            ckpts.labels(*lv, st.value).set(by_status.get(st, 0))
        size.labels(*lv).set(run.size_bytes)
        if (done := run.latest_complete) is not None:
            latest.labels(*lv).set(done.step)
            latest_ts.labels(*lv).set(done.mtime_ns / 1e9)
            latest_age.labels(*lv).set(max(0.0, (now_ns - done.mtime_ns) / 1e9))
        every = [*run.findings, *(f for c in run.checkpoints for f in c.all_findings)]
        for (sev, code), n in Counter((f.severity.label, f.code) for f in every).items():
            found.labels(*lv, sev, code).set(n)
        times = [
            result.file_facts[f.path].verified_ns
            for c in run.checkpoints
            for f in c.all_files
            if f.path in result.file_facts
        ]
        known = [t for t in times if t is not None]
        verified.labels(*lv).set(0 if len(known) < len(times) or not known else min(known) / 1e9)
        unverified.labels(*lv).set(len(times) - len(known))
    outside = Gauge(
        f"{PREFIX}_scan_findings",
        "Findings of the scan outside any run, by severity and code.",
        ["severity", "code"],
        registry=reg,
    )
    for (sev, code), n in Counter((f.severity.label, f.code) for f in result.findings).items():
        outside.labels(sev, code).set(n)
    scan_values = {
        "scan_duration_seconds": ("Wall time of the scan.", (result.finished_ns - result.started_ns) / 1e9),
        "scan_timestamp_seconds": ("When the scan finished.", result.finished_ns / 1e9),
        "scan_bytes_hashed": ("Bytes read by content this scan.", result.bytes_hashed),
        "scan_files_hashed": ("Files read by content this scan.", result.files_hashed),
        "scan_files_reused": ("Files whose catalogued hash was reused by stat.", result.files_reused),
        "scan_bytes_scrubbed": ("Bytes of reusable files re-read on purpose (scrub).", result.bytes_scrubbed),
        "scan_runs": ("Runs found under the scanned roots.", len(result.runs)),
    }
    if scrub_period_ns is not None:
        scan_values["scrub_period_seconds"] = (
            "Every cached byte is re-read once per this period.",
            scrub_period_ns / 1e9,
        )
    for name, (doc, value) in scan_values.items():
        Gauge(f"{PREFIX}_{name}", doc, registry=reg).set(value)
    return reg


def write_metrics(path: str | os.PathLike[str], result: ScanResult, *, now_ns: int, scrub_period_ns: int | None):
    """Write the textfile atomically (OSError when its directory is not writable)."""
    from prometheus_client import write_to_textfile

    write_to_textfile(os.fspath(path), build_registry(result, now_ns=now_ns, scrub_period_ns=scrub_period_ns))
