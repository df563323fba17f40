"""The training text: the Python standard library's own source, read byte by byte.

Every machine with Python has it, offline. The corpus is the concatenation, in the order listed,
of the UTF-8 bytes of the top-level modules below, read from ``sysconfig.get_paths()["stdlib"]``.
Each token is one byte (``d_vocab = 256``). The modules are pure Python, present in CPython 3.10
to 3.14 and not patched by Linux distributions; their text still changes between Python releases,
so the model cards record the Python version and a SHA-256 of each split, and training refuses a
corpus whose hash differs from the one it is asked to reproduce.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import torch

from .._errors import InputError

__all__ = ["TRAIN_MODULES", "HELDOUT_MODULES", "corpus_bytes", "corpus_tokens", "corpus_description"]

TRAIN_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "dis", "doctest", "enum", "fractions", "ftplib", "functools",
    "gettext", "heapq", "inspect", "ipaddress", "locale", "mailbox", "numbers", "optparse", "pathlib",
    "pickle", "pprint", "queue", "random", "shlex", "shutil", "smtplib", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing",
    "uuid", "warnings", "weakref", "zipfile",
)
HELDOUT_MODULES = ("fnmatch", "glob", "gzip", "hmac", "linecache", "sched", "selectors", "socketserver")


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_bytes(split: str = "train") -> bytes:
    """The raw corpus: ``"train"`` (:data:`TRAIN_MODULES`) or ``"heldout"`` (:data:`HELDOUT_MODULES`)."""
    modules = {"train": TRAIN_MODULES, "heldout": HELDOUT_MODULES}.get(split)
    if modules is None:
        raise InputError(f"split must be 'train' or 'heldout', got {split!r}")
    paths = [_stdlib() / f"{name}.py" for name in modules]
    missing = [path for path in paths if not path.is_file()]
    if missing:
        raise InputError(
            f"the {split} corpus needs the standard library's source, and {missing[0]} is not there"
            f" ({len(missing)} of its {len(paths)} modules missing): this Python was installed without"
            " its .py files"
        )
    return b"".join(path.read_bytes() for path in paths)


def corpus_tokens(split: str = "train") -> torch.Tensor:
    """The corpus as byte tokens, an int64 tensor ``[n_bytes]`` with values in ``[0, 256)``."""
    return torch.frombuffer(bytearray(corpus_bytes(split)), dtype=torch.uint8).long()


def corpus_description() -> dict:
    """What the corpus is on this machine: Python version, modules, sizes and SHA-256 digests."""
    out = {
        "source": "top-level modules of the Python standard library (sysconfig stdlib path), concatenated in order",
        "tokenisation": "bytes of the UTF-8 source, one token per byte (d_vocab 256)",
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }
    for split, modules in (("train", TRAIN_MODULES), ("heldout", HELDOUT_MODULES)):
        data = corpus_bytes(split)
        out[split] = {"modules": list(modules), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return out
