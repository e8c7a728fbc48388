"""Export: a checkpoint merged into a HuggingFace model directory, checked, and put in place whole.

`orchestrator.export_checkpoint` runs it: `guard` says where it may write and re-reads the source, `sources` finds
and plans the weights, `stream_engine` (default, no torch) or `torch_engine` (the oracle) writes them, `model`
checks the result is the model config.json describes, `placement` puts it at `--to` by one rename. `result` holds
what it hands back. docs/design.md maps every module.
"""
