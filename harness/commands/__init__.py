"""The harness's commands for the `ckpt-audit` CLI (demo, train, resume-test), plugged in through the
`ckpt_audit.commands` entry-point group in pyproject.toml, so ckpt_audit never imports the harness.

Kept out of the test fixtures' cache key (tests/conftest.py hashes harness/*.py only): this is flag parsing and
rendering around the trainer and never changes what trees it writes.
"""

# what the reference trainer imports (harness/launch.py warms them all): the `torch` extra
TRAINER_MODULES = ("torch", "torchdata", "transformers")
