"""Read a pickle without running it: a restricted unpickler that resolves no globals.

Every GLOBAL / STACK_GLOBAL / INST becomes a `Stub` class named for (module, name); calling it (REDUCE), NEWOBJ and
BUILD on it only record their arguments and state. So nothing named by the file is imported or executed: a
`posix.system` in a pickle is a record, not a call. A handful of pure data constructors (`DATA_CONSTRUCTORS`:
`collections.OrderedDict`, `torch.Size`, `builtins.set`, `_codecs.encode`, ...) produce the plain Python value they
stand for, because callers want dicts and tuples, and building those runs no code from the file.

Generic: it knows no file format (`pt` reads torch files with it, `deep.dcp_check` DCP's `.metadata`).
No torch import.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from ckpt_audit.readers.problem import Problem

# Stubs: what the restricted unpickler builds instead of importing anything


class _GlobalMeta(type):
    _qualname: str

    def __repr__(cls) -> str:
        return f"<global {cls._qualname}>"


class Stub(metaclass=_GlobalMeta):
    """An object the pickle asked for. `args` are the REDUCE/NEWOBJ arguments, `state` what BUILD passed,
    `setitems`/`appended` what SETITEM(S)/APPEND(S) added. Attribute access falls back to the fields of the state,
    so a dataclass pickled by NEWOBJ+BUILD (DCP's Metadata) reads like the real object: `meta.state_dict_metadata`.
    """

    __slots__ = ("args", "kwargs", "state", "setitems", "appended")
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    setitems: dict[Any, Any] | None
    appended: list[Any] | None
    _module: str = ""
    _name: str = ""
    _qualname: str = ""
    _plain: Callable[..., Any] | None = None  # pure data constructor that stands in for this global

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._plain is not None:
            try:
                return cls._plain(*args, **kwargs)
            except (TypeError, ValueError, LookupError, OverflowError):
                pass  # odd arguments: keep the record instead
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state = None
        self.setitems = None
        self.appended = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    # BUILD
    def __setstate__(self, state: Any) -> None:
        self.state = state

    # SETITEM(S) on an object that is not a dict (e.g. a stubbed mapping type)
    def __setitem__(self, key: Any, value: Any) -> None:
        if self.setitems is None:
            self.setitems = {}
        self.setitems[key] = value

    # APPEND(S)
    def append(self, value: Any) -> None:
        if self.appended is None:
            self.appended = []
        self.appended.append(value)

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    # REDUCE whose callable is itself a built record (e.g. the result of a stubbed getattr)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = stub_class("<call>", "")
        out = call(*args, **kwargs)
        out.state = {"callee": self}
        return out

    @property
    def qualname(self) -> str:
        return type(self)._qualname

    @property
    def fields(self) -> dict[str, Any]:
        """The BUILD state as one dict: a plain state dict, or the merge of a (dict, slots) pair."""
        st = self.state
        if isinstance(st, dict):
            return {str(k): v for k, v in st.items()}
        if isinstance(st, tuple) and len(st) == 2:
            out: dict[str, Any] = {}
            for part in st:
                if isinstance(part, dict):
                    out.update({str(k): v for k, v in part.items()})
            return out
        return {}

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return self.fields[attr]
        except KeyError:
            raise AttributeError(f"{self.qualname} record has no field {attr!r}") from None

    def __repr__(self) -> str:
        inner = ", ".join(repr(a) for a in self.args)
        if self.state is not None:
            inner += (", " if inner else "") + f"state={self.state!r}"
        text = f"{self.qualname}({inner})"
        return text if len(text) < 300 else text[:297] + "..."


class StateDict(dict):
    """A mapping the pickle built as an OrderedDict; a BUILD state (a state_dict's `_metadata`) lands in `.state`."""

    __slots__ = ("state",)

    def __setstate__(self, state: Any) -> None:
        self.state = state


class PickleBoundError(Exception):
    """The pickle asks for more than any checkpoint holds (a huge constructor size, nesting past MAX_PICKLE_DEPTH):
    refused before the work is done. Not a ValueError, so Stub.__new__ does not swallow it into a record."""


MAX_CONSTRUCTED = 64 * 1024 * 1024  # bytes / items a data constructor may build from a size or a string
MAX_PICKLE_DEPTH = 10_000  # real state dicts nest < 20 deep; hashing a tuple 1M deep overflows the C stack


def _bounded(make: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A data constructor that refuses sizes past MAX_CONSTRUCTED: `bytearray(2**31)` would allocate 2 GiB, and a
    long string turned into a list of characters takes 8 bytes per character."""

    def build(*args: Any, **kwargs: Any) -> Any:
        arg = args[0] if args else None
        size = None
        if make in (bytes, bytearray) and isinstance(arg, int):  # bytes(n): n zero bytes
            size = arg
        elif make not in (bytes, bytearray) and isinstance(arg, (str, bytes, bytearray)):  # one item per character
            size = len(arg)
        if size is not None and size > MAX_CONSTRUCTED:
            raise PickleBoundError(f"{name}({size}) asks for more than {MAX_CONSTRUCTED} bytes or items")
        return make(*args, **kwargs)

    return build


def _bytes_from_codecs(text: str, encoding: str = "utf-8") -> bytes:
    if encoding.replace("-", "").replace("_", "").lower() not in ("latin1", "utf8", "ascii", "iso88591"):
        raise LookupError(encoding)  # only plain text codecs: no codec lookup on the file's say-so
    return text.encode(encoding)


def _device_str(kind: str, index: int | None = None) -> str:
    if not isinstance(kind, str):
        raise TypeError("device")
    return kind if index is None or ":" in kind else f"{kind}:{int(index)}"


def _plain_str(value: str) -> str:
    if not isinstance(value, str):
        raise TypeError("layout")
    return value


# Pure data constructors: building these values runs no code from the file.
DATA_CONSTRUCTORS: dict[tuple[str, str], Callable[..., Any]] = {
    ("collections", "OrderedDict"): StateDict,
    ("collections", "defaultdict"): lambda *a: StateDict(),
    ("builtins", "set"): _bounded(set, "set"),
    ("builtins", "frozenset"): _bounded(frozenset, "frozenset"),
    ("builtins", "list"): _bounded(list, "list"),
    ("builtins", "tuple"): _bounded(tuple, "tuple"),
    ("builtins", "dict"): dict,
    ("builtins", "bytearray"): _bounded(bytearray, "bytearray"),
    ("builtins", "bytes"): _bounded(bytes, "bytes"),
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("__builtin__", "set"): _bounded(set, "set"),
    ("__builtin__", "frozenset"): _bounded(frozenset, "frozenset"),
    ("_codecs", "encode"): _bytes_from_codecs,
    ("torch", "Size"): _bounded(tuple, "torch.Size"),
    ("torch", "device"): _device_str,
    ("torch.serialization", "_get_layout"): _plain_str,
}

_STUB_CACHE: dict[tuple[str, str], type[Stub]] = {}


def stub_class(module: str, name: str) -> type[Stub]:
    key = (module, name)
    cls = _STUB_CACHE.get(key)
    if cls is None:
        qual = f"{module}.{name}" if module and name else (module or name)
        made = _GlobalMeta(
            "Stub",
            (Stub,),
            {
                "__slots__": (),
                "_module": module,
                "_name": name,
                "_qualname": qual,
                "_plain": DATA_CONSTRUCTORS.get(key),
            },
        )
        cls = cast(type[Stub], made)
        _STUB_CACHE[key] = cls
    return cls


def global_name(obj: Any) -> str | None:
    """`module.name` of a stubbed global (the class itself, as for dtypes: `torch.float32`), else None."""
    if isinstance(obj, type) and issubclass(obj, Stub):
        return obj._qualname
    return None


def is_record(obj: Any, *qualnames: str) -> bool:
    """True if obj is a record built from one of the given globals (or any global when none are given)."""
    return isinstance(obj, Stub) and (not qualnames or type(obj)._qualname in qualnames)


@dataclass(frozen=True, slots=True)
class PersistentRef:
    """A persistent id in the pickle (torch: a storage); what it names is resolved by the caller, never here."""

    pid: Any


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(file, encoding="latin1")
        self.seen: set[str] = set()
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add(f"{module}.{name}")
        return stub_class(str(module), str(name))

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid) if self._persistent is not None else PersistentRef(pid)


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    root: Any
    globals_seen: frozenset[str]


def restricted_load(
    data: bytes | bytearray | memoryview | BinaryIO, *, persistent_load: Callable[[Any], Any] | None = None
) -> Any:
    """Unpickle `data` into plain Python values and `Stub` records; nothing from the file is imported or run.

    Raises pickle.UnpicklingError (or ValueError/EOFError on garbage). For DCP `.metadata`:
    `meta = restricted_load(open(p, "rb"))`; `meta.state_dict_metadata` is the dict of the real Metadata.
    """
    return restricted_load_ex(data, persistent_load=persistent_load).root


def restricted_load_ex(
    data: bytes | bytearray | memoryview | BinaryIO, *, persistent_load: Callable[[Any], Any] | None = None
) -> Loaded:
    """restricted_load plus the set of globals the pickle referenced."""
    root, seen, error = unpickle(data, persistent_load)
    if error is not None:
        raise error
    return Loaded(root=root, globals_seen=seen)


def unpickle(
    data: bytes | bytearray | memoryview | BinaryIO, persistent_load: Callable[[Any], Any] | None
) -> tuple[Any, frozenset[str], Exception | None]:
    """(root, globals seen, the failure or None). The globals named before a failure count too: a real unpickler
    would have called them before it reached the damage."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if (deep := _too_deep_quick(data)) is not None:
            return None, frozenset(), deep
        f: BinaryIO = io.BytesIO(data)
    else:
        f = data  # a stream of pickles (torch's legacy format): the caller walks each one with too_deep first
    u = _RestrictedUnpickler(f, persistent_load)
    try:
        return u.load(), frozenset(u.seen), None
    except RecursionError:
        return None, frozenset(u.seen), PickleBoundError("nests deeper than the unpickler can follow")
    except Exception as exc:  # noqa: BLE001 - any failure of a hostile or damaged pickle is reported, not raised here
        return None, frozenset(u.seen), exc


# opcodes that make a new object able to hold others (each level of nesting is one): no pickle nests deeper than one
# plus the count of these bytes, opcodes or not
_NESTING_OPS = tuple(bytes([b]) for b in b"]}tld\x85\x86\x87\x8f\x91R\x81\x92ioPQ")


def _too_deep_quick(data: bytes) -> PickleBoundError | None:
    """A PickleBoundError when the pickle nests deeper than MAX_PICKLE_DEPTH, found before the C unpickler hashes a
    tuple so deep that the process dies (a 1 MB pickle does it). Counting the bytes of the nesting opcodes bounds
    the depth at C speed; only a pickle where that count passes the bound has its opcodes walked."""
    if len(data) <= MAX_PICKLE_DEPTH or sum(data.count(op) for op in _NESTING_OPS) <= MAX_PICKLE_DEPTH:
        return None
    return too_deep(data)


def too_deep(data: bytes | BinaryIO) -> PickleBoundError | None:
    """A PickleBoundError when the pickle at `data` nests deeper than MAX_PICKLE_DEPTH, by walking its opcodes (a
    stream is left after its STOP): for a stream of pickles (torch's legacy format), whose lengths are known only by
    walking them."""
    depth = _max_depth(data)
    if depth > MAX_PICKLE_DEPTH:
        return PickleBoundError(f"nests more than {MAX_PICKLE_DEPTH} levels deep")
    return None


_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})


def _max_depth(data: bytes | BinaryIO) -> int:
    """The deepest nesting the pickle builds, from its opcodes' stack effects; stops past the bound. Exact for what
    is built bottom-up, as tuples and frozensets (the only containers hashed, so the only ones that can overflow the
    C stack) always are; a list or dict filled through the memo after it was placed can nest deeper than counted,
    which no hashing reaches and readers.pt's walk cuts at 200 levels. A pickle pickletools cannot walk gives 0:
    the unpickler then reports it as damaged."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    deepest = 0
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name in _MEMO_PUT or name == "MEMOIZE":
                memo[arg if name != "MEMOIZE" else len(memo)] = stack[-1] if stack else 0
                continue
            if name in _MEMO_GET:
                stack.append(memo.get(arg, 0))
                continue
            before = op.stack_before
            popped: list[int] = []
            if pickletools.markobject in before:
                m = marks.pop()
                popped = stack[m:]
                del stack[m:]
                for _ in range(before.index(pickletools.markobject)):
                    popped.insert(0, stack.pop())
            elif before:
                popped = stack[-len(before) :]
                del stack[-len(before) :]
            if not op.stack_after:
                continue
            if name in _IN_PLACE:  # the container below the items: one level above its deepest item
                new = max(popped[0], max(popped[1:], default=-1) + 1)
            else:
                new = max(popped, default=-1) + 1
            stack.extend([new] * len(op.stack_after))
            if new > deepest:
                deepest = new
                if deepest > MAX_PICKLE_DEPTH:
                    break
    except (ValueError, IndexError, KeyError):
        return 0
    return deepest


def unpickle_problem(what: str, error: Exception) -> Problem:
    """The finding for a pickle `unpickle` could not read: over a bound (pickle-over-bounds), or damaged."""
    if isinstance(error, PickleBoundError):
        return Problem("pickle-over-bounds", f"{what} {error}: not unpickled, loading it would exhaust the loader")
    return Problem("bad-pickle", f"{what} does not unpickle: {first_line(error)}")


def first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
