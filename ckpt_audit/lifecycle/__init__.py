"""Lifecycle: what happens to checkpoints after they are judged.

`retention` plans (pure: `plan_prune` -> `PrunePlan`), `survivors` re-reads what a plan keeps before anything goes,
`prune` executes a plan crash-safely. Export is its own package, ckpt_audit.export.
"""
