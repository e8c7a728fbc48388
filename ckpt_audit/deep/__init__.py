"""Deep checks: the torch side of `verify`.

Safe loading (`weights_only=True` plus an explicit allowlist), the cross-rank and optimizer rules, DCP byte ranges
and safetensors headers. Imported lazily: the cron path (`scan`, `ls`, `prune`) never loads torch.
"""
