"""Files beneath :mod:`circuitmath.io`: safetensors headers validated before any tensor is read,
regular files and bounded JSON only. The Hugging Face converters are :mod:`circuitmath._hf`.
:mod:`circuitmath.io` is the public face; the checkpoint reader (:mod:`circuitmath._checkpoint`)
builds on these modules, not on ``io``, so nothing imports in a circle.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ._config import MAX_JSON_BYTES, Config, parse_json
from ._errors import ConfigError, InputError, StateDictError
from ._state import StateDict, validate_state_dict

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.

CONFIG_KEY = "circuitmath.config"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


class UnsafeFormatError(InputError):
    """The file is not a safetensors file: a pickle or a zip archive (refused unread: unpickling
    runs arbitrary code), or anything else; circuitmath reads safetensors only."""


# ---------------------------------------------------------------------------------------------
# files

#: The largest safetensors header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000

#: Bytes per element of each safetensors dtype circuitmath can read into torch.
_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


#: torch's name of each safetensors dtype code, read or not (an error names a dtype as torch does).
_TORCH_NAMES = {
    "BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "F8_E5M2": "torch.float8_e5m2",
    "F8_E4M3": "torch.float8_e4m3fn", "I16": "torch.int16", "U16": "torch.uint16", "F16": "torch.float16",
    "BF16": "torch.bfloat16", "I32": "torch.int32", "U32": "torch.uint32", "F32": "torch.float32",
    "I64": "torch.int64", "U64": "torch.uint64", "F64": "torch.float64", "C64": "torch.complex64",
    "C128": "torch.complex128", "F8_E8M0": "torch.float8_e8m0fnu", "F4": "torch.float4_e2m1fn_x2",
}


def _dtype_name(code) -> str:
    """A safetensors dtype code as torch names it (``'C64'`` -> ``torch.complex64 ('C64')``)."""
    return f"{_TORCH_NAMES[code]} ({code!r})" if isinstance(code, str) and code in _TORCH_NAMES else repr(code)


def _regular_file(path: Path) -> int:
    """The size of the regular file at ``path``; anything else (absent, a folder, a FIFO, a
    device such as /dev/zero) is refused before it is opened, so no read can block or run on."""
    try:
        status = path.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None
    except ValueError as error:  # a NUL byte in the name, which no file can have
        raise InputError(f"{str(path)!r} is not a file name ({error})") from None
    if stat.S_ISDIR(status.st_mode):
        raise InputError(f"{path} is a folder, not a file")
    if not stat.S_ISREG(status.st_mode):
        raise InputError(f"{path} is not a regular file (a FIFO, a device or a socket); circuitmath reads files only")
    return status.st_size


def _read_prefix(path: Path, limit: int) -> bytes:
    """The first ``limit + 1`` bytes at most of a regular file (the extra byte tells it is longer)."""
    _regular_file(path)
    try:
        with open(path, "rb") as handle:
            return handle.read(limit + 1)
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None


def read_json(path: str | os.PathLike, what: str = "JSON file"):
    """The JSON value in the regular file at ``path`` (at most :data:`MAX_JSON_BYTES` of UTF-8,
    nested at most :data:`~circuitmath._config.MAX_JSON_DEPTH` deep); :class:`ConfigError` naming
    the file otherwise."""
    path = Path(path)
    text = _read_prefix(path, MAX_JSON_BYTES)
    if len(text) > MAX_JSON_BYTES:
        raise ConfigError(f"{path}: {what} is over the limit of {MAX_JSON_BYTES} bytes")
    return parse_json(text, f"{path} ({what})")


def read_config(path: str | os.PathLike):
    """A model's config from a JSON file: a :class:`~circuitmath.Config` (its :meth:`to_json`), or a
    Hugging Face ``config.json`` returned as a dict (it has a ``model_type``) for :func:`~circuitmath._hf.from_hf`."""
    path = Path(path)
    data = read_json(path, "config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config is a JSON {type(data).__name__}, not an object")
    if "model_type" in data:
        return data
    with naming_file(path):
        return Config.from_dict(data)


@contextlib.contextmanager
def naming_file(path: Path, key: str | None = None) -> Iterator[None]:
    """Name ``path`` (and the metadata ``key``) in any input error raised within."""
    try:
        yield
    except InputError as error:
        where = f"{path}" + (f", metadata {key!r}" if key else "")
        if str(error).startswith(str(path)):
            raise
        raise type(error)(f"{where}: {error}") from None


def _not_safetensors(path: Path, head: bytes, why: str) -> UnsafeFormatError:
    looks = (
        f"has the suffix {path.suffix!r} of a PyTorch pickle" if path.suffix.lower() in PICKLE_SUFFIXES
        else "starts like a pickle" if head[:1] == b"\x80"
        else "starts like a zip archive (PyTorch's format holds a pickle)" if head[:2] == b"PK"
        else None
    )
    if looks:
        return UnsafeFormatError(
            f"{path} is not a safetensors file ({why}) and {looks}; circuitmath never unpickles (it can run"
            " arbitrary code). Convert it to safetensors where you trust it, e.g. with"
            " safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
        )
    return UnsafeFormatError(f"{path} is not a safetensors file ({why})")


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """The tensor entries and the string metadata of a safetensors file, every one validated.

    A file is taken for safetensors when its header parses: an 8-byte little-endian length, then
    that many bytes of a JSON object. Any other file is refused with :class:`UnsafeFormatError`
    (saying so when it looks like a pickle or a zip archive), whatever its first byte: a valid
    header may start with any byte. A header that parses but describes tensors the file does not
    hold (offsets outside the data, sizes that do not match the shape, an unknown dtype) raises
    :class:`~circuitmath.StateDictError` naming the tensor. Reads the header only.
    """
    path = Path(path)
    size = _regular_file(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise _not_safetensors(path, head, f"{size} bytes, shorter than the 8-byte header length")
            length = int.from_bytes(head, "little")
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise _not_safetensors(path, head, f"a header length of {length} bytes in a file of {size}")
            text = handle.read(length)
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        header = parse_json(text, "header", limit=MAX_HEADER_BYTES)
    except ConfigError as error:
        raise _not_safetensors(path, head, str(error)) from None
    if not isinstance(header, dict) or not header:
        raise _not_safetensors(path, head, "its header is not a JSON object of tensors")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is no metadata; [], 0 or "" is no mapping
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise StateDictError(f"{path}: its __metadata__ is not a mapping of strings to strings")
    data_bytes, spans = size - 8 - length, []
    for name, entry in header.items():
        problem = _entry_problem(entry, data_bytes)
        if problem:
            raise StateDictError(f"{path}: tensor {name!r} {problem}")
        spans.append((*entry["data_offsets"], name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise StateDictError(f"{path}: tensor {name!r} starts at byte {begin} of the data, not {position}: the tensors overlap or leave gaps")
        position = end
    if position != data_bytes:
        raise StateDictError(f"{path}: the tensors fill {position} bytes of data but the file holds {data_bytes} (truncated or padded)")
    return header, metadata


def _entry_problem(entry, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return "is not described by exactly a dtype, a shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ITEM_BYTES:
        return (f"has dtype {_dtype_name(dtype)}, not one circuitmath reads"
                f" ({', '.join(_TORCH_NAMES[code].removeprefix('torch.') for code in _ITEM_BYTES)})")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape):
        return f"has shape {shape!r}, not a list of sizes (each at least 0 and below 2**63)"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        return f"has data_offsets {offsets} outside the {data_bytes} bytes of data"
    if end - begin != math.prod(shape) * _ITEM_BYTES[dtype]:
        return (f"of shape {shape} and dtype {_TORCH_NAMES[dtype]} needs {math.prod(shape) * _ITEM_BYTES[dtype]} bytes,"
                f" its offsets hold {end - begin}")
    return None


def load_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file at ``path`` and its string metadata.

    The header is validated first (:func:`read_header`): a pickle, a zip archive or any other
    file is refused with :class:`UnsafeFormatError` without being interpreted, and a damaged
    safetensors file with :class:`~circuitmath.StateDictError` naming the tensor.
    """
    path = Path(path)
    header, metadata = read_header(path)
    largest = max(header, key=lambda name: _bytes(header[name]))
    _refuse_beyond_memory(path, header, largest)
    reading = largest  # safe_open maps the whole file: a failure there is the largest tensor's
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {}
            for reading in header:
                tensors[reading] = handle.get_tensor(reading)
    except (SafetensorError, OSError, RuntimeError, MemoryError) as error:
        entry = header[reading]
        raise StateDictError(
            f"{path}: tensor {reading!r} ({_TORCH_NAMES[entry['dtype']]}, shape {entry['shape']}, {_bytes(entry):,}"
            f" bytes) cannot be read into memory: {error}; the file's tensors take {_total(header):,} bytes"
        ) from None
    return tensors, metadata


def _bytes(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def _total(header: dict) -> int:
    return sum(_bytes(entry) for entry in header.values())


def _memory_limit() -> tuple[int, str] | None:
    """The bytes this process can hold at most, and why: the address-space limit (``ulimit -v``)
    or the machine's memory, whichever is smaller (``None`` when neither is known)."""
    limits = []
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, "this process's address-space limit (ulimit -v)"))
    except (ImportError, OSError, ValueError):
        pass
    try:
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"))
    except (OSError, ValueError, AttributeError):
        pass
    return min(limits) if limits else None


def _refuse_beyond_memory(path: Path, header: dict, largest: str) -> None:
    """Refuse, naming the largest tensor, a file whose tensors cannot all be held in memory at once."""
    limit = _memory_limit()
    total = _total(header)
    if limit is None or total <= limit[0]:
        return
    entry = header[largest]
    raise StateDictError(
        f"{path}: its tensors take {total:,} bytes, more than {limit[1]} ({limit[0]:,} bytes), the largest"
        f" {largest!r} ({_TORCH_NAMES[entry['dtype']]}, shape {entry['shape']}, {_bytes(entry):,} bytes): a"
        " file is read whole; check a checkpoint folder (read a block at a time) or use a machine with more memory")


def stored_config(path: str | os.PathLike, metadata: Mapping[str, str]) -> Config | None:
    """The config :func:`save` stored in a file's ``metadata`` (``None`` if it has none)."""
    if CONFIG_KEY not in metadata:
        return None
    with naming_file(Path(path), CONFIG_KEY):
        return Config.from_json(metadata[CONFIG_KEY])


def save(
    path: str | os.PathLike, state_dict: StateDict, cfg: Config, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``state_dict`` (validated against ``cfg``) and ``cfg`` to a safetensors file.

    ``cfg`` is stored as JSON under the metadata key ``"circuitmath.config"``; ``metadata`` adds
    other string entries. The file name must end in ``.safetensors``. The file is written under
    a temporary name and renamed, so a failed or interrupted save leaves nothing behind.
    """
    if isinstance(path, Mapping) and isinstance(state_dict, (str, os.PathLike)):
        raise InputError(
            "io.save takes (path, state_dict, cfg): the path comes first (safetensors.torch.save_file"
            " takes the tensors first)"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"io.save: path must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if path.suffix != ".safetensors":
        raise InputError(f"{path}: circuitmath writes safetensors only; use a name ending in .safetensors")
    extra = dict(metadata or {})
    if CONFIG_KEY in extra:
        raise InputError(f"{path}: metadata key {CONFIG_KEY!r} is reserved for the config")
    bad = [k for k, v in extra.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise InputError(f"{path}: metadata keys and values must be strings; not so for {bad}")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such folder to write {path.name} in")
    validate_state_dict(state_dict, cfg)
    tensors = {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, str(temporary), metadata={CONFIG_KEY: cfg.to_json(), **extra})
        os.replace(temporary, path)
    except (OSError, SafetensorError) as error:
        raise InputError(f"{path}: cannot be written ({getattr(error, 'strerror', None) or error})") from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def load(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Config]:
    """Read a file written by :func:`save`: ``(state_dict, cfg)``, validated against each other.

    >>> import tempfile, torch
    >>> from circuitmath import Config, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3)
    >>> sd = random_state_dict(cfg, seed=0)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save(f"{folder}/m.safetensors", sd, cfg)
    ...     back, back_cfg = load(f"{folder}/m.safetensors")
    >>> back_cfg == cfg and all(torch.equal(back[k], sd[k]) for k in sd)
    True
    """
    path = Path(path)
    _, metadata = read_header(path)
    cfg = stored_config(path, metadata)
    if cfg is None:
        raise StateDictError(
            f"{path} has no {CONFIG_KEY!r} metadata, so it was not written by circuitmath.io.save; read it with"
            " load_tensors and convert it (e.g. from_hf), or pass its config (--config on the command line)"
        )
    tensors, _ = load_tensors(path)
    with naming_file(path):
        validate_state_dict(tensors, cfg)
    return tensors, cfg
