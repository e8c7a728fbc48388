"""The scan: walk, read, reuse, reduce.

    walk     (scan.walk)     list a root without following links out of it; what is where, with each file's stat
    read     (scan.read)     everything one file tells without judging its neighbours (hash, CRC, structure, text)
    reuse    (scan.reuse)    the one place that decides, per file, read or reuse: kept run verdicts
                             (scan.verdicts), the stat cache, the scrub (scan.scrub)
    reduce   (scan.reduce)   merge the roots' partials and let the layouts judge the runs not kept

`scan.pipeline` strings them together: `scan_partial(root)` is the map half (one root, or one node's copy of it),
`reduce(partials)` the judging half, `scan(roots)` both for a local scan.
"""

from ckpt_audit.roots import ScanError, check_root
from ckpt_audit.scan.pipeline import (
    focus_of,
    only_checkpoints,
    scan,
    scan_partial,
)
from ckpt_audit.scan.read import Progress, Reader, read_all, read_file
from ckpt_audit.scan.reduce import merge_partials, reduce
from ckpt_audit.scan.reuse import Caches
from ckpt_audit.scan.walk import walk

__all__ = [
    "Caches",
    "Progress",
    "Reader",
    "ScanError",
    "check_root",
    "focus_of",
    "merge_partials",
    "only_checkpoints",
    "read_all",
    "read_file",
    "reduce",
    "scan",
    "scan_partial",
    "walk",
]
