"""The Textual front end of ckpt-audit: browse runs, inspect checkpoints, prune with a live plan, export.

It has no logic of its own and reaches the core only through `ckpt_audit.session`, as the CLI does: runs from
`browse` and the catalog reads, deletion plans from the pure `session.terms.plan_prune` (the CLI's planner),
deletions from `Session.prune`, exports from `Session.export`.
Start it with `ckpt-audit tui [--catalog PATH] [ROOT...]`.
"""
