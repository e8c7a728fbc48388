"""The one service layer under every front end (the CLI, the TUI, the harness's commands): a catalog held under its
lock, with the actions as calls, and the reads that never wait for it.

The CLI and the TUI do the same thing for the same action because both call these: `scan`, `verify`,
`plan_prune` then `prune` (the preview handed back whole), `export`, `plan_fix_tracker` then `fix_tracker` (and
`record` for a scan made elsewhere). Every catalog write a front end makes goes through a `Session`, which exists
only while its lock (ckpt_audit/lock.py) is held, so a write never overlaps a cron run. Front ends only parse, call,
render and map errors to exit codes; nothing here prints. tests/test_import_contract.py holds them to it: below the
session a front end imports only shared nouns and renderings.

Cut by concern:
- core: `Session`, `open_session`, the errors; scan, verify, prune, export, fix-tracker.
- reads: `browse`, `latest` (the resume gate), `reading` and the catalog facts viewers show; none waits for the lock.
- cluster: scan --ray and prune --ray, with ckpt_audit.cluster as the injected reader and executor.
- continuity: `ckpt-audit continuity`'s audit of a metrics log, with the catalog's checkpoints.
- stores: s3:// roots as the CLI reaches them: compare, the scan's switches, a remote prune's plan.
- terms (scan_terms, export_terms, tracker_terms): the nouns a front end passes in or matches on (prune policies,
  the scrub policy, outcome kinds, errors), each module imported only by the command that needs it.
"""

from ckpt_audit.session.core import (
    Locked,
    PlanError,
    Progress,
    Session,
    SessionError,
    open_session,
    preview_of,
    run_named,
)
from ckpt_audit.session.reads import browse, catalog_nodes, catalog_runs, latest, reading, record_if_free

__all__ = [
    "Locked",
    "PlanError",
    "Progress",
    "Session",
    "SessionError",
    "browse",
    "catalog_nodes",
    "catalog_runs",
    "latest",
    "open_session",
    "preview_of",
    "reading",
    "record_if_free",
    "run_named",
]
