"""Rules for saves that finish out of order: async saves and remote copies (docs/verl-format.md §1.2, §2.4).

verl's synchronous save writes the tracker last, so the tracker is its commit marker. Three ways that breaks:

- FSDP `async_save`: the trainer never writes the tracker (verl #7952), so complete checkpoints sit in a run whose
  `resume_mode=auto` trains from step 0 and then overwrites them (`untracked-complete`).
- Megatron's async queue can publish the tracker before the files it names are finished (verl #8000, PR #7363):
  files in the named checkpoint newer than the tracker and still changing (`tracker-published-early`).
- The same queue copies the checkpoint to HDFS (`trainer.default_hdfs_dir`): a remote copy configured while the
  checkpoint it was made for is not complete locally (`remote-copy-unfinished`).

Pure: the layout passes the tracker's mtime, the judged checkpoints and the run's saved config text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ckpt_audit.codes import finding
from ckpt_audit.models import Checkpoint, Finding, Severity, Status
from ckpt_audit.rules.status import is_husk

# where a verl run's resolved config may be saved beside its checkpoints (Hydra's output dir, or a copy)
CONFIG_NAMES = ("config.yaml", ".hydra/config.yaml")

_HDFS_YAML = re.compile(r"^\s*default_hdfs_dir\s*:\s*(.*?)\s*(?:#.*)?$", re.MULTILINE)
_UNSET = frozenset({"", "null", "~", "none", "None", "''", '""'})


def hdfs_dir(config_text: str | None) -> str | None:
    """The `trainer.default_hdfs_dir` a saved config sets, or None when unset (null) or absent."""
    if not config_text:
        return None
    for m in _HDFS_YAML.finditer(config_text):
        value = m.group(1).strip()
        if value not in _UNSET:
            return value.strip("'\"")
    return None


def resumable(ckpt: Checkpoint) -> bool:
    """Whole enough to resume from: complete, or whole but newer than a lagging tracker (no error, shards left and
    the dataloader state written, which verl writes after every role)."""
    if ckpt.status is Status.COMPLETE:
        return True
    return (
        ckpt.status is Status.UNCOMMITTED
        and not is_husk(ckpt)
        and not any(f.severity is Severity.ERROR or f.code == "missing-dataloader-state" for f in ckpt.all_findings)
    )


def check_run(
    run_dir: str,
    *,
    tracker_path: str,
    tracker_step: int | None,
    tracker_mtime_ns: int | None,
    tracker_known: bool,
    checkpoints: Sequence[Checkpoint],
    changed_paths: frozenset[str],
    now_ns: int,
    in_progress_window_ns: int,
    configs: Mapping[str, str],
) -> tuple[Finding, ...]:
    """The save-order findings of one run. `configs`: path -> text of the run's saved configs (CONFIG_NAMES)."""
    found: list[Finding] = []
    whole = [c for c in checkpoints if resumable(c)]
    if not tracker_known and whole:
        steps = ", ".join(str(c.step) for c in whole[-5:])
        found.append(
            finding(
                "untracked-complete",
                tracker_path,
                f"{len(whole)} complete checkpoint(s) (step {steps}) but no tracker (FSDP async_save never writes it, "
                "verl #7952): resume_mode=auto trains from step 0 and overwrites them as it saves; "
                "run `ckpt-audit fix-tracker` or resume with resume_path",
            )
        )
    named = next((c for c in checkpoints if tracker_step is not None and c.step == tracker_step), None)
    if named is not None and tracker_mtime_ns is not None:
        later = [f for f in named.all_files if f.mtime_ns > tracker_mtime_ns]
        changing = any(f.path in changed_paths for f in named.all_files) or (
            now_ns - named.mtime_ns < in_progress_window_ns
        )
        if later and changing:
            found.append(
                finding(
                    "tracker-published-early",
                    tracker_path,
                    f"the tracker names step {tracker_step}, but {len(later)} of its file(s) were written after the "
                    "tracker and are still changing (an async save published it early, verl #8000): a crash now "
                    "resumes from a half-written checkpoint",
                )
            )
    remote = next((v for v in (hdfs_dir(configs.get(p)) for p in sorted(configs)) if v), None)
    if remote is not None and checkpoints:
        target = named if named is not None else (checkpoints[-1] if tracker_step is None else None)
        if target is None:
            what, step = "missing locally", tracker_step
        elif not resumable(target):
            what, step = f"{target.status.value} locally", target.step
        else:
            what = None
        if what is not None:
            found.append(
                finding(
                    "remote-copy-unfinished",
                    run_dir,
                    f"the run copies every save to {remote} (default_hdfs_dir), but step {step} is {what}: its "
                    "remote copy was made from an unfinished save (verl #8000); do not resume from it unchecked",
                )
            )
    return tuple(found)
