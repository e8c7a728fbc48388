"""The structure of a torch file, read without torch and without running its pickles.

`read_pt_structure` reads a torch file in any container torch.load accepts: a torch.save zip (the pickle in
`data.pkl`), the legacy non-zip format (five pickles, then raw storages) or a raw pickle stream, each pickle through
the restricted unpickler (`unpickler`). The pickle gives the key tree, and each tensor record
(`torch._utils._rebuild_tensor_v2`, DTensor's `_rebuild_from_type_v2`) gives dtype, shape, stride, storage key, numel
and location, checked against the stored bytes. Every global any of its pickles names is recorded and judged against
`torch_globals.KNOWN_SAFE_GLOBALS`, the one allowlist, by the scan and by verify. No torch import (the scan path uses
this).

`read` holds the three containers, `walk` the tensor records, `structure` what is reported.
"""

from ckpt_audit.readers.pt.read import read_pt_structure, read_zip_structure
from ckpt_audit.readers.pt.structure import PtStructure, StorageRef, TensorInfo

__all__ = ["PtStructure", "StorageRef", "TensorInfo", "read_pt_structure", "read_zip_structure"]
