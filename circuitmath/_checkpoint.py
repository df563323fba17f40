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
in every shard's metadata and in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ._config import Config
from ._errors import ConfigError, InputError, StateDictError
from ._state import check_config_fits, entries_checked_elsewhere, expected_shapes, validate_state_dict
from ._files import CONFIG_KEY, PICKLE_SUFFIXES, UnsafeFormatError, _about, read_config, read_header, read_json
from ._hf import Layout, _Source, hf_layout

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
    tensor = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
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
        return self.fetch(*self.entries[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def fetched_by(self, fetch) -> "_Tensors":
        return _Tensors(self.entries, fetch)


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
    """

    path: Path
    cfg: Config
    layout: Layout
    tensors: _Tensors

    def __post_init__(self):
        with _about(self.path):
            self.source = self.layout.source(self.tensors)
            placeheld = self.layout.source(self.tensors.fetched_by(_placeholder))
            whole = self.layout.embed(placeheld) | self.layout.final(placeheld)
            for layer in range(self.cfg.n_layers):
                whole |= self.layout.block(placeheld, layer)
            placeheld.all_used()
            with entries_checked_elsewhere():  # the entries are checked as each part is read
                self.dtype = validate_state_dict(whole, self.cfg)

    def ends(self) -> dict[str, torch.Tensor]:
        with _about(self.path):
            return self.layout.embed(self.source) | self.layout.final(self.source)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        with _about(self.path):
            return self.layout.block(self.source, layer)

    def load(self) -> tuple[dict[str, torch.Tensor], Config]:
        """The whole state dict in memory, validated (what :func:`circuitmath.io.load_hf_directory` returns)."""
        with _about(self.path):
            return self.layout.convert(self.tensors.fetched_by(_read))


def open_checkpoint(path: str | os.PathLike, config=None) -> Checkpoint:
    """Open a checkpoint without reading its tensors: a folder or a ``.safetensors`` file.

    A folder holds ``model.safetensors.index.json`` and the shards it names, or
    ``model.safetensors``; its config is the circuitmath config in the index's (or the file's)
    metadata, else ``config.json`` (a Hugging Face config, converted by the converter of its
    ``model_type``, or a circuitmath :class:`~circuitmath.Config` as JSON). A file carries its
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
        with _about(path, CONFIG_KEY):
            config = Config.from_json(metadata[CONFIG_KEY])
    with _about(path):
        if isinstance(config, Config):  # a config claiming 10**9 layers is refused before its shapes are listed
            check_config_fits(entries, config)
        layout = circuitmath_layout(config) if isinstance(config, Config) else hf_layout(config)
    return Checkpoint(path, layout.cfg, layout, _Tensors(entries))


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """Write ``tensors`` (CPU) to ``path`` in the safetensors format, each straight from its
    memory (no copy of the shard is assembled); returns the bytes of tensor data."""
    header: dict = {"__metadata__": dict(metadata)}
    position = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [position, position + size]}
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for tensor in tensors.values():
            if tensor.numel():
                handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return position


class CheckpointWriter:
    """A checkpoint folder written part by part: ``with CheckpointWriter(folder, parts) as out:
    out.write(tensors, cfg)`` once per part, then the index. The folder is built under a
    temporary name beside ``folder`` and renamed when the block ends without an error; on any
    error or interruption it is removed, so ``folder`` holds a whole checkpoint or nothing."""

    def __init__(self, folder: str | os.PathLike, parts: int):
        self.folder, self.parts = Path(folder), parts
        if self.folder.exists() or self.folder.is_symlink():
            raise InputError(f"{self.folder} exists; circuitmath does not overwrite a checkpoint")
        if not self.folder.parent.is_dir():
            raise InputError(f"{self.folder.parent}: no such folder to write {self.folder.name} in")
        self.temporary = self.folder.with_name(f".{self.folder.name}.{os.getpid()}.partial")
        self.weight_map: dict[str, str] = {}
        self.total, self.cfg = 0, None

    def __enter__(self) -> "CheckpointWriter":
        try:
            self.temporary.mkdir()
        except OSError as error:
            raise InputError(f"{self.temporary}: cannot be created ({error.strerror or error})") from None
        except BaseException:  # interrupted once the folder exists: __exit__ will not run, so remove it here
            self._remove()
            raise
        return self

    def write(self, tensors: Mapping[str, torch.Tensor], cfg: Config) -> None:
        """One shard holding ``tensors`` (CPU); ``cfg``, the whole model's config, in its metadata."""
        self.cfg = cfg
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}-of-{self.parts:05d}.safetensors"
        try:
            self.total += _write_safetensors(self.temporary / name, tensors, {CONFIG_KEY: cfg.to_json(), "format": "pt"})
        except OSError as error:  # a full disk, a quota: the folder is removed on the way out
            raise InputError(f"{self.folder}: {name} cannot be written ({error.strerror or error})") from None
        self.weight_map |= dict.fromkeys(tensors, name)

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:
                index = {"metadata": {"total_size": self.total, CONFIG_KEY: self.cfg.to_json()}, "weight_map": self.weight_map}
                (self.temporary / INDEX).write_text(json.dumps(index, indent=2))
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
