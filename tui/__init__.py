"""The Textual front end of ckpt-audit: browse runs, inspect checkpoints, prune with a live plan, export.

It has no logic of its own: runs come from the scanner and the catalog, deletion plans from
`ckpt_audit.lifecycle.retention.plan_prune`, deletions from `ckpt_audit.lifecycle.prune.execute`, exports from
`ckpt_audit.lifecycle.export.export_checkpoint`. Start it with `ckpt-audit tui [--catalog PATH] [ROOT...]`.
"""
