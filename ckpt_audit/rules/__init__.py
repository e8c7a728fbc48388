"""Shallow rules: pure functions of a file's facts, a component, a checkpoint or a run -> tuple[Finding].

No IO and no torch: layouts call them with what the walk and the readers observed, and a checkpoint's status is
derived from its findings (`status.judge`). Deep rules that need tensors live in `deep/` (verify).
"""
