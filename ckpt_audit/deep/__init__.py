"""Deep checks: the torch side of `verify`.

One module of checks per format, each named by its layout (`Layout.deep_checks`, the shape in `check`), and what
they share: safe loading (`weights_only=True` plus an explicit allowlist), the per-rank views and the pure
cross-rank rules over them. Imported lazily: the cron path (`scan`, `ls`, `prune`) never loads torch.
"""
