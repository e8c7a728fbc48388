"""What torch.save's pickles name: storage classes, dtypes, tensor rebuild functions, DTensor types, and from them
`KNOWN_SAFE_GLOBALS`, the one pickle allowlist.

The scan judges every pickle by it (`unsafe-pickle`), and verify's torch.load(weights_only=True) admits its non-torch
names and nothing more (`deep.safe_load`). The unpickler's pure data constructors are part of it by construction, so
a global the unpickler turns into a value can never be one the allowlist refuses. No torch import.
"""

from __future__ import annotations

from ckpt_audit.readers.unpickler import DATA_CONSTRUCTORS

# storage class name -> (dtype name, item size in bytes)
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexDoubleStorage": ("complex128", 16),
    "ComplexFloatStorage": ("complex64", 8),
    "QInt8Storage": ("qint8", 1),
    "QUInt8Storage": ("quint8", 1),
    "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1),
    "QUInt2x4Storage": ("quint2x4", 1),
    "UntypedStorage": ("uint8", 1),  # numel counts bytes; the tensor's dtype comes from _rebuild_tensor_v3
}

# dtype name (as in `torch.<name>` globals) -> item size
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex128": 16,
    "cdouble": 16,
    "complex64": 8,
    "cfloat": 8,
    "complex32": 4,
    "chalf": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
}
DTYPE_ALIASES = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cdouble": "complex128",
    "cfloat": "complex64",
    "chalf": "complex32",
}

REBUILD_V2 = ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor")
REBUILD_V3 = "torch._utils._rebuild_tensor_v3"
REBUILD_PARAM = ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state")
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
REBUILD_WRAPPER = "torch._utils._rebuild_wrapper_subclass"
REBUILD_META = "torch._utils._rebuild_meta_tensor_no_storage"
DTENSOR_TYPES = (
    "torch.distributed.tensor.DTensor",
    "torch.distributed._tensor.api.DTensor",
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed._tensor.DTensor",
)
OTHER_REBUILDS = (
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch._utils._rebuild_xla_tensor",
    "torch._utils._rebuild_mtia_tensor",
)

# numpy RNG state (np.random.get_state() in extra_state) and numpy scalars, in numpy 1.x and 2.x spellings
NUMPY_DATA_GLOBALS = (
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)
# DeepSpeed's own data classes in its optimizer pickles (deepspeed 0.19.x, ZeRO 1-3; read off the GLOBAL opcodes of
# files DeepSpeed itself wrote): a loss-scale record, an int enum and a (start, numel) pair. Nothing of DeepSpeed is
# ever imported for them: the unpickler keeps a record of their state, verify's torch.load an inert stand-in
# (deep/safe_load.py).
RECORD_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# Plain values a state dict may hold, pickled through their type: calling these builds data and runs nothing else.
_DATA_BUILTINS = (
    "set",
    "frozenset",
    "list",
    "tuple",
    "dict",
    "slice",
    "complex",
    "bytearray",
    "bytes",
    "int",
    "float",
    "str",
    "bool",
)
# torch's own tensor reconstructors and type names that its weights-only unpickler accepts too
_TORCH_DATA_ONLY = (
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch.storage.TypedStorage",
    "torch.per_tensor_affine",
    "torch.per_channel_affine",
    "torch.per_tensor_symmetric",
    "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
    "torch.qint8",
    "torch.quint8",
    "torch.qint32",
    "torch.quint4x2",
    "torch.quint2x4",
    "torch.bits1x8",
    "torch.bits2x4",
    "torch.bits4x2",
    *(f"torch.{k}int{n}" for k in ("", "u") for n in range(1, 8)),
    *(
        f"torch.{mod}{t}Tensor"
        for mod in ("", "cuda.", "sparse.", "cuda.sparse.")
        for t in ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
        if not (t == "Bool" and "sparse" in mod)
    ),
    *(f"torch.cuda.{n}" for n in STORAGE_DTYPES if n not in ("UntypedStorage",) and not n.startswith("Q")),
)

# THE allowlist: the data-only globals torch.save emits for tensors, DTensors, optimizer/scheduler state and the
# RNG / dataloader state verl keeps in extra_state and data.pt. A pickle that names anything else would run code
# when loaded the way verl loads extra_state and data.pt, so the scan reports it (`unsafe-pickle`, an error) and
# verify never hands the file to torch; verify's torch.load(weights_only=True) admits the non-torch names of this
# same set and nothing more (deep/safe_load.py). Scan and verify read this one set.
KNOWN_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        *(f"torch.{n}" for n in STORAGE_DTYPES),
        "torch.storage.UntypedStorage",
        *(f"torch.{n}" for n in DTYPE_ITEMSIZE),
        *REBUILD_V2,
        REBUILD_V3,
        *REBUILD_PARAM,
        REBUILD_FROM_TYPE,
        REBUILD_WRAPPER,
        REBUILD_META,
        *DTENSOR_TYPES,
        *_TORCH_DATA_ONLY,
        # what the unpickler builds as plain values (OrderedDict, torch.Size, set, ...): owned by its table
        *(f"{module}.{name}" for module, name in DATA_CONSTRUCTORS),
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "collections.Counter",
        *(f"{m}.{n}" for m in ("builtins", "__builtin__") for n in _DATA_BUILTINS),
        "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.tensor._dtensor_spec.TensorMeta",
        "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
        "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor.placement_types.Replicate",
        "torch.distributed.tensor.placement_types.Partial",
        "torch.distributed.tensor.placement_types._StridedShard",
        "torch.distributed.tensor.placement_types._Partial",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
        # numpy RNG state and scalars in extra_state / data.pt: data-only reconstructors
        *NUMPY_DATA_GLOBALS,
        *RECORD_GLOBALS,
    }
)
