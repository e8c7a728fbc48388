"""Scale-out on a Ray cluster (optional extra `ray`): node-local placement of the scan's map half.

Ray is imported only inside `ckpt_audit.cluster.ray_scan`'s functions, so `ckpt-audit scan` without --ray never
imports it. The pure parts (node-root mapping, rebasing a partial) live in `noderoots` and need no Ray.
"""
