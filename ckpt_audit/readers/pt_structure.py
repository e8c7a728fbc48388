"""Moved to ckpt_audit.readers.pt; this name stays only for scanner.py until the scan/ package imports readers.pt
(issue 27: then delete this file)."""

from ckpt_audit.readers.pt import PtStructure, StorageRef, TensorInfo, read_pt_structure

__all__ = ["PtStructure", "StorageRef", "TensorInfo", "read_pt_structure"]
