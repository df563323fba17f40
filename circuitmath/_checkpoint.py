"""Checkpoints larger than memory: safetensors read lazily, one layer at a time, and written in shards.

:func:`open_checkpoint` opens a Hugging Face model folder (``config.json`` with
``model.safetensors``, or with ``model.safetensors.index.json`` and its shards), a folder this
module wrote (its index carries the circuitmath config) or a circuitmath safetensors file. Only
the headers are read (each validated by :func:`circuitmath.io.read_header`, the index with the
JSON limits of :func:`circuitmath.io.read_json`); a tensor is fetched by name as a memory map of
its bytes, which is unmapped when the last view of it goes. The converters' :class:`Layout`
turns the fetched tensors into circuitmath's names one part at a time
(:meth:`Checkpoint.ends`, :meth:`Checkpoint.block`), and the whole structure (names, shapes,
dtypes, tensors no converter uses) is checked on placeholders that hold no memory before a
single weight is read.

:class:`CheckpointWriter` writes parts as they come: one safetensors shard per part, the config
in every shard's metadata and in ``model.safetensors.index.json``, in circuitmath's names or in
a Hugging Face architecture's (:mod:`circuitmath._stored`); tensors kept as stored are copied by
the kernel.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ._config import Config
from ._errors import ConfigError, InputError, StateDictError
from ._state import check_config_fits, expected_shapes, validated
from ._files import CONFIG_KEY, PICKLE_SUFFIXES, UnsafeFormatError, naming_file, read_config, read_header, read_json
from ._hf import Layout, _Source, hf_layout
from ._processing._memory import in_memory, new_tensor
from ._stored import LAYOUT_KEY, processed_layout, viewers

__all__ = ["Checkpoint", "open_checkpoint", "CheckpointWriter", "INDEX", "circuitmath_layout"]

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"

#: torch's dtype of each safetensors dtype name.
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64,
    "U64": torch.uint64, "F64": torch.float64,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _mapped(path: Path, offset: int, entry: dict) -> torch.Tensor:
    """The tensor ``entry`` (a validated header entry) whose data starts at byte ``offset`` of
    ``path``, as a private memory map: pages are read when touched, and unmapped with the tensor."""
    dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    start = offset + begin
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        with open(path, "rb") as handle:
            buffer = mmap.mmap(handle.fileno(), start - aligned + end - begin, access=mmap.ACCESS_COPY, offset=aligned)
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: cannot be mapped ({error})") from None
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=start - aligned).view(shape)


def _read(path: Path, offset: int, entry: dict) -> torch.Tensor:
    """The tensor ``entry`` read into memory of its own (no map, no file left open)."""
    begin, end = entry["data_offsets"]
    try:
        tensor = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
    except (RuntimeError, MemoryError) as error:
        raise InputError(f"{path}: cannot be held in memory ({error})") from None
    try:
        with open(path, "rb") as handle:
            handle.seek(offset + begin)
            got = handle.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) if end > begin else 0
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None
    if got != end - begin:
        raise StateDictError(f"{path}: the file ended inside a tensor (it changed while being read)")
    return tensor


def _placeholder(path: Path, offset: int, entry: dict) -> torch.Tensor:
    """A zero-stride tensor of the entry's shape and dtype: no memory, for checking a structure."""
    return torch.zeros((), dtype=DTYPES[entry["dtype"]]).expand(entry["shape"])


class _Tensors(Mapping):
    """The tensors of one or more safetensors files by name, each fetched from disk when looked
    up by ``fetch`` (:func:`_mapped` by default; nothing is kept: a tensor lives as long as its
    views, a memory map with it)."""

    def __init__(self, entries: dict[str, tuple[Path, int, dict]], fetch=_mapped):
        self.entries, self.fetch = entries, fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        path, offset, entry = self.entries[name]
        try:
            return self.fetch(path, offset, entry)
        except InputError as error:  # name the tensor too: a map or a read of it failed
            raise type(error)(f"{error}: tensor {name!r} ({DTYPES[entry['dtype']]}, shape {entry['shape']},"
                              f" {entry['data_offsets'][1] - entry['data_offsets'][0]:,} bytes)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def fetched_by(self, fetch) -> "_Tensors":
        return _Tensors(self.entries, fetch)

    @property
    def holds_values(self) -> bool:
        """False for placeholders (:func:`_placeholder`): a structure, no values."""
        return self.fetch is not _placeholder


def _entries(path: Path, names: set[str] | None = None) -> tuple[dict[str, tuple[Path, int, dict]], dict[str, str]]:
    """The validated header entries of the safetensors file ``path`` (``names``: the tensors an
    index says it holds, checked) and its metadata."""
    header, metadata = read_header(path)
    if names is not None and set(header) != names:
        extra, missing = sorted(set(header) - names), sorted(names - set(header))
        raise StateDictError(
            f"{path}: the index lists {sorted(missing)[:5]} in this shard but it does not hold them" if missing else
            f"{path}: holds tensors the index does not list: {extra[:5]}"
        )
    with open(path, "rb") as handle:  # read_header checked it: the data starts after the header
        offset = 8 + int.from_bytes(handle.read(8), "little")
    return {name: (path, offset, entry) for name, entry in header.items()}, metadata


def _read_index(folder: Path) -> tuple[dict[str, tuple[Path, int, dict]], dict]:
    """Every tensor of the shards named by ``folder``'s index, and the index's metadata."""
    index_path = folder / INDEX
    index = read_json(index_path, "safetensors index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ConfigError(f"{index_path}: not an index (a JSON object with a 'weight_map' object)")
    metadata = index.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise ConfigError(f"{index_path}: 'metadata' is not an object")
    shards: dict[str, set[str]] = {}
    for name, file in index["weight_map"].items():
        # a name relative to the folder, in it or in a folder below it (as transformers joins them)
        if (not isinstance(file, str) or not file.endswith(".safetensors") or "\\" in file
                or any(part in ("", ".", "..") for part in file.split("/"))):
            raise ConfigError(f"{index_path}: weight_map[{name!r}] is {file!r}, not the name of a .safetensors file"
                              " in the folder or below it")
        shards.setdefault(file, set()).add(name)
    entries: dict[str, tuple[Path, int, dict]] = {}
    for file, names in shards.items():
        entries |= _entries(folder / file, names)[0]
    return entries, metadata


def circuitmath_layout(cfg: Config) -> Layout:
    """The :class:`~circuitmath.io.Layout` of a checkpoint already in circuitmath's names and shapes."""
    shapes = expected_shapes(cfg)

    def pick(src: _Source, keep) -> dict:
        return {name: src.take(name, *shape) for name, shape in shapes.items() if keep(name)}

    return Layout(
        cfg, (), None,
        embed=lambda src: pick(src, lambda name: name.startswith(("embed.", "pos_embed."))),
        block=lambda src, layer: pick(src, lambda name: name.startswith(f"blocks.{layer}.")),
        final=lambda src: pick(src, lambda name: name.startswith(("ln_final.", "unembed."))),
    )


@dataclass
class Checkpoint:
    """A model on disk, read a part at a time; its structure was checked when it was opened.

    ``cfg`` is the converted model's config; :meth:`ends` returns the tensors outside the blocks
    (embedding, positions, final norm, unembed), :meth:`block` those of one block, in circuitmath
    names and shapes, as views of memory maps (``contiguous()`` copies them into memory).
    ``native`` is the converter of the architecture whose names the checkpoint stores (``None``
    for circuitmath's names) and ``hf_config`` its ``config.json``, for writing a processed model
    in the same layout (:mod:`circuitmath._stored`).
    """

    path: Path
    cfg: Config
    layout: Layout
    tensors: _Tensors
    native: Layout | None = None
    hf_config: dict | None = None

    def __post_init__(self):
        with naming_file(self.path):
            self.source = self.layout.source(self.tensors)
            placeheld = self.layout.source(self.tensors.fetched_by(_placeholder))
            whole = self.layout.embed(placeheld) | self.layout.final(placeheld)
            for layer in range(self.cfg.n_layers):
                whole |= self.layout.block(placeheld, layer)
            placeheld.all_used()
            # the entries are checked as each part is read
            self.dtype = validated(whole, self.cfg, entries=False).dtype

    def ends(self) -> dict[str, torch.Tensor]:
        with naming_file(self.path):
            return self.layout.embed(self.source) | self.layout.final(self.source)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        with naming_file(self.path):
            return self.layout.block(self.source, layer)

    def stored(self, layer: int | None) -> dict[str, list[str]]:
        """The stored tensors part ``layer`` (``None``: the ends) is converted from, by their names
        in the checkpoint, in its order, each with the circuitmath names ``native`` takes as views of it."""
        # fetched once: a view is told by the address of its stored tensor's placeholder
        return viewers(self.native, dict(self.tensors.fetched_by(_placeholder)), layer)

    def load(self) -> tuple[dict[str, torch.Tensor], Config]:
        """The whole state dict in memory, validated (what :func:`circuitmath.io.load_hf_directory` returns)."""
        with naming_file(self.path):
            return self.layout.convert(self.tensors.fetched_by(_read))


def open_checkpoint(path: str | os.PathLike, config=None) -> Checkpoint:
    """Open a checkpoint without reading its tensors: a folder or a ``.safetensors`` file.

    A folder holds ``model.safetensors.index.json`` and the shards it names, or
    ``model.safetensors``; its config is the circuitmath config in the index's (or the file's)
    metadata, else ``config.json`` (a Hugging Face config, converted by the converter of its
    ``model_type``, or a circuitmath :class:`~circuitmath.Config` as JSON). A processed folder
    written in its architecture's layout (the metadata's ``circuitmath.layout``) is read by
    ``config.json``'s converter as the processed model its metadata describes. A file carries its
    config in its metadata (written by :func:`circuitmath.io.save`). ``config`` (a
    :class:`~circuitmath.Config` or a Hugging Face config) overrides both. A folder with only
    pickled weights is refused unread (:class:`~circuitmath.io.UnsafeFormatError`); every
    error names the file and the tensor or field at fault.
    """
    path = Path(path)
    metadata: dict = {}
    if path.is_dir():
        if (path / INDEX).exists():
            entries, metadata = _read_index(path)
        elif (path / WEIGHTS).exists():
            entries, metadata = _entries(path / WEIGHTS)
        else:
            pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise UnsafeFormatError(f"{path} has only pickled weights {pickles}; circuitmath reads safetensors only")
            raise InputError(f"{path} has neither {WEIGHTS} nor {INDEX}")
        if config is None and CONFIG_KEY not in metadata:
            config = read_config(path / "config.json")
    elif path.exists():
        entries, metadata = _entries(path)
    else:
        raise InputError(f"{path}: no such file or folder")
    if config is None:
        if CONFIG_KEY not in metadata:
            raise StateDictError(f"{path} carries no circuitmath config in its metadata: pass its config")
        if not isinstance(metadata[CONFIG_KEY], str):
            raise ConfigError(f"{path}: metadata {CONFIG_KEY!r} is not a string")
        with naming_file(path, CONFIG_KEY):
            config = Config.from_json(metadata[CONFIG_KEY])
    hf_config = None
    with naming_file(path):
        if isinstance(config, Config) and path.is_dir() and metadata.get(LAYOUT_KEY) is not None:
            if metadata[LAYOUT_KEY] != "config.json":
                raise ConfigError(f"metadata {LAYOUT_KEY!r} is {metadata[LAYOUT_KEY]!r}; circuitmath writes 'config.json'")
            hf_config = read_config(path / "config.json")
            if not isinstance(hf_config, dict):
                raise ConfigError(f"{path / 'config.json'}: a circuitmath config, but the metadata's {LAYOUT_KEY!r}"
                                  " says the tensors are a Hugging Face architecture's")
            native = hf_layout(hf_config)
            # in the architecture's names a block may be as few as 6 stored tensors (Phi-3's and
            # Falcon's fused projections): each reads at least one, and the two configs agree
            if not config.n_layers == native.cfg.n_layers <= len(entries):
                raise StateDictError(
                    f"the circuitmath config in the metadata says n_layers={config.n_layers}, config.json"
                    f" {native.cfg.n_layers}, and the folder stores {len(entries)} tensors: they do not describe these weights")
            layout = processed_layout(native, config)
        elif isinstance(config, Config):  # a config claiming 10**9 layers is refused before its shapes are listed
            check_config_fits(entries, config)
            layout, native = circuitmath_layout(config), None
        else:
            layout = native = hf_layout(config)
            hf_config = config if isinstance(config, dict) else None
    return Checkpoint(path, layout.cfg, layout, _Tensors(entries), native, hf_config)


#: What a shard holds: each tensor's name with its dtype and shape.
Specs = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
#: Gives a shard's tensors: called with a buffer of each name's shape and dtype (uninitialised,
#: contiguous), it returns each name's tensor, contiguous: its buffer written into, or any tensor.
Fill = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]

# errors of posix_fallocate that say the file system (or the file: a pipe, a device) cannot reserve space
_CANNOT_RESERVE = {errno.EOPNOTSUPP, errno.ENODEV, errno.ESPIPE, errno.EINVAL, errno.ENOSYS}


def _write_safetensors(path: Path, specs: Specs, fill: Fill, buffers: dict[str, torch.Tensor],
                       metadata: Mapping[str, str], copied: Mapping[str, tuple[Path, int]] | None = None) -> int:
    """Write the safetensors file ``path`` holding the tensors ``specs`` lists; returns the bytes
    of tensor data. Those in ``copied`` (each the file and byte offset of its bytes, as stored in
    a checkpoint) are copied by the kernel (``copy_file_range``: no pass through this process);
    the others are what ``fill(buffers)`` returns, each written straight from its memory. The
    file's space is reserved first (``posix_fallocate``, where the file system can): a full disk
    fails before anything is written, and the writes do not allocate blocks a page at a time.
    """
    copied = copied or {}
    header: dict = {"__metadata__": dict(metadata)}
    position, computed = 0, [name for name in specs if name not in copied]
    for name in [*computed, *copied]:
        dtype, shape = specs[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tensors = fill(buffers)
    for name in computed:
        tensor, (dtype, shape) = tensors[name], specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise RuntimeError(f"{path.name}: {name} is a {tensor.dtype} {tuple(tensor.shape)} tensor, not {dtype} {tuple(shape)}"
                               " contiguous on the CPU")  # cannot happen: a fill gives what the specs say
    with open(path, "wb") as handle:
        try:
            os.posix_fallocate(handle.fileno(), 0, 8 + len(text) + position)
        except OSError as error:
            if error.errno not in _CANNOT_RESERVE:
                raise
        handle.write(len(text).to_bytes(8, "little") + text)
        for name in computed:
            if tensors[name].numel():
                handle.write(tensors[name].reshape(-1).view(torch.uint8).numpy().data)
        del tensors
        handle.flush()
        for name, (source, offset) in copied.items():
            begin, end = header[name]["data_offsets"]
            _copy_bytes(source, offset, end - begin, handle)
    return position


def _copy_bytes(source: Path, offset: int, count: int, handle) -> None:
    """Append ``count`` bytes of ``source`` from ``offset`` to the open file ``handle``: in the
    kernel where it can (``copy_file_range``), else read and written a block at a time."""
    with open(source, "rb") as reading:
        done = 0
        try:
            while done < count:
                moved = os.copy_file_range(reading.fileno(), handle.fileno(), count - done, offset + done)
                if moved == 0:
                    raise StateDictError(f"{source}: the file ended inside a tensor (it changed while being read)")
                done += moved
        except OSError as error:
            if error.errno not in {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF} or done:
                raise
            reading.seek(offset)
            while done < count:
                block = reading.read(min(count - done, 1 << 24))
                if not block:
                    raise StateDictError(f"{source}: the file ended inside a tensor (it changed while being read)") from None
                handle.write(block)
                done += len(block)


class CheckpointWriter:
    """A checkpoint folder written part by part: ``with CheckpointWriter(folder, parts) as out:
    out.write(tensors, cfg)`` once per part, then the index. The folder is built under a
    temporary name beside ``folder`` and renamed when the block ends without an error; on any
    error or interruption it is removed, so ``folder`` holds a whole checkpoint or nothing.

    With ``hf_config`` (a Hugging Face ``config.json``), the parts come in that architecture's
    names (:meth:`write_stored`): the config is written beside them, and the index says so
    (:data:`~circuitmath._stored.LAYOUT_KEY`)."""

    def __init__(self, folder: str | os.PathLike, parts: int, hf_config: dict | None = None):
        self.folder, self.parts, self.hf_config = Path(folder), parts, hf_config
        if self.folder.exists() or self.folder.is_symlink():
            raise InputError(f"{self.folder} exists; circuitmath does not overwrite a checkpoint")
        if not self.folder.parent.is_dir():
            raise InputError(f"{self.folder.parent}: no such folder to write {self.folder.name} in")
        self.temporary = self.folder.with_name(f".{self.folder.name}.{os.getpid()}.partial")
        self.weight_map: dict[str, str] = {}
        self.total, self.cfg = 0, None
        # the last shard's buffers, by dtype, shape and count: the next shard of the same kind
        # (a block) reuses them (new memory costs the kernel a fault and the zeroing of every page)
        self.buffers: dict[tuple, torch.Tensor] = {}

    def __enter__(self) -> "CheckpointWriter":
        try:
            self.temporary.mkdir()
        except OSError as error:
            raise InputError(f"{self.temporary}: cannot be created ({error.strerror or error})") from None
        except BaseException:  # interrupted once the folder exists: __exit__ will not run, so remove it here
            self._remove()
            raise
        return self

    def _metadata(self, cfg: Config) -> dict[str, str]:
        layout = {} if self.hf_config is None else {LAYOUT_KEY: "config.json"}
        return {CONFIG_KEY: cfg.to_json(), **layout}

    def write(self, tensors: Mapping[str, torch.Tensor], cfg: Config) -> None:
        """One shard holding ``tensors`` (CPU, any strides); ``cfg``, the whole model's config, in its metadata."""
        def fill(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {name: t if t.is_contiguous() else in_memory(t, buffers[name]) for name, t in tensors.items()}

        self.write_stored({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, fill, cfg)

    def write_stored(self, specs: Specs, fill: Fill, cfg: Config, copied: Mapping[str, tuple[Path, int]] | None = None) -> None:
        """One shard holding the tensors ``specs`` lists, given by ``fill`` but for those
        ``copied`` from a checkpoint's bytes (see :func:`_write_safetensors`); ``cfg`` as :meth:`write`.
        The buffers ``fill`` gets are those of the shard before where it had as many tensors of the
        same shape and dtype (a buffer ``fill`` does not write into takes no memory)."""
        self.cfg = cfg
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}-of-{self.parts:05d}.safetensors"
        keys, seen = {}, {}
        for n, spec in specs.items():  # each (dtype, shape) numbered by its order in the shard
            if not (copied and n in copied):
                keys[n] = (*spec, seen.setdefault(spec, [0])[0])
                seen[spec][0] += 1
        self.buffers = {key: self.buffers.get(key) for key in keys.values()}  # the others are freed
        for key in keys.values():
            if self.buffers[key] is None:
                self.buffers[key] = new_tensor(key[1], key[0], torch.device("cpu"))
        try:
            self.total += _write_safetensors(self.temporary / name, specs, fill, {n: self.buffers[k] for n, k in keys.items()},
                                             {**self._metadata(cfg), "format": "pt"}, copied)
        except OSError as error:  # a full disk, a quota: the folder is removed on the way out
            raise InputError(f"{self.folder}: {name} cannot be written ({error.strerror or error})") from None
        self.weight_map |= dict.fromkeys(specs, name)

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:
                index = {"metadata": {"total_size": self.total, **self._metadata(self.cfg)}, "weight_map": self.weight_map}
                (self.temporary / INDEX).write_text(json.dumps(index, indent=2))
                if self.hf_config is not None:
                    (self.temporary / "config.json").write_text(json.dumps(self.hf_config, indent=2))
                os.replace(self.temporary, self.folder)
        except OSError as error:
            raise InputError(f"{self.folder}: cannot be written ({error.strerror or error})") from None
        finally:
            self._remove()

    def _remove(self) -> None:
        if self.temporary.exists():
            for file in self.temporary.iterdir():
                file.unlink()
            self.temporary.rmdir()
