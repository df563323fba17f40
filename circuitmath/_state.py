"""Which tensors a config implies, and validation of state dicts against it."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping

import torch

from ._config import Config, config_expected
from ._errors import InputError, StateDictError

__all__ = [
    "attention_names",
    "per_query_head",
    "key_value_groups",
    "expected_shapes",
    "validate_state_dict",
    "entries_checked_elsewhere",
    "entries_checked_here",
    "check_config_fits",
    "validated_once",
    "not_finite",
    "usable_device",
    "StateDict",
]

StateDict = Mapping[str, torch.Tensor]

def usable_device(device, option: str) -> torch.device:
    """``device`` (a name or a :class:`torch.device`; ``None``: the CPU) as a device this machine
    can compute on, else an :class:`InputError` naming ``option`` (the CLI's ``--device``, a
    function's ``device``), raised before anything is read or written.

    >>> usable_device(None, "device")
    device(type='cpu')
    >>> usable_device("meta", "--device")
    Traceback (most recent call last):
    ...
    circuitmath._errors.InputError: --device meta: not a device this machine can compute on (a meta tensor holds no values to compute with)
    """
    try:
        chosen = torch.device("cpu" if device is None else device)
        if chosen.type == "meta":
            raise RuntimeError("a meta tensor holds no values to compute with")
        torch.empty(1, device=chosen)  # a device this torch build or machine lacks is refused here
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, AssertionError, ImportError, ...
        raise InputError(f"{option} {device}: not a device this machine can compute on ({error})") from None
    return chosen


_CHECK_ENTRIES = contextvars.ContextVar("circuitmath_check_entries", default=True)


@contextlib.contextmanager
def entries_checked_elsewhere() -> Iterator[None]:
    """Within this block :func:`validate_state_dict` checks names, shapes and dtypes but not that
    every entry is finite: for a caller that checks the entries of what goes in and of what
    comes out itself (the processing pipeline), so its steps do not read every weight again."""
    token = _CHECK_ENTRIES.set(False)
    try:
        yield
    finally:
        _CHECK_ENTRIES.reset(token)


_VALIDATED = contextvars.ContextVar("circuitmath_validated", default=None)


@contextlib.contextmanager
def validated_once() -> Iterator[None]:
    """Within this block :func:`validate_state_dict` validates each state dict once: a state dict
    (the same object, with the same config) that passed already is not checked again. For a
    caller that hands the same validated weights through many transforms and forward passes (the
    diagnosis). Nothing is kept alive by it: a state dict is recognised by its tensors, held
    weakly (a check of GPT-2-small that went through 17 transforms held every transformed model
    to its end, 24 GB).
    A tensor whose entries were checked in the block is not checked again in another state dict
    (a dict of the same tensors converted to their own dtype is a new dict of the same tensors)."""
    token, finite = _VALIDATED.set({}), _FINITE.set({})
    try:
        yield
    finally:
        _FINITE.reset(finite)
        _VALIDATED.reset(token)


#: Within :func:`validated_once`, the tensors whose entries were found finite: ``id -> (weak
#: reference, version)``. A tensor met again in another state dict (a dict of the same tensors, or of some
#: of them) is not summed again unless it was modified in place since (its version changed).
_FINITE = contextvars.ContextVar("circuitmath_finite", default=None)


def _entries_not_finite(tensor: torch.Tensor) -> int:
    """:func:`not_finite`, remembered within :func:`validated_once`."""
    finite = _FINITE.get()
    if finite is None:
        return not_finite(tensor)
    hit = finite.get(id(tensor))
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        return 0
    bad = not_finite(tensor)
    if not bad:
        finite[id(tensor)] = (weakref.ref(tensor), tensor._version)  # weakly: not kept alive by it
    return bad


def entries_checked_here() -> bool:
    """Whether entries are checked by each call (``False`` within :func:`entries_checked_elsewhere`)."""
    return _CHECK_ENTRIES.get()


def all_finite(tensors) -> bool:
    """Whether every one of ``tensors`` (any shapes and dtypes, on one device) has only finite
    entries, decided with one synchronisation with the device: from the sum of each tensor of at
    least one dimension (an overflowing sum answers ``False``, so ``False`` may also mean
    "check the entries"), and from the value of each scalar (a sum taken already).

    >>> all_finite([torch.ones(3), torch.tensor([1.0, float("inf")])])
    False
    >>> all_finite([torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float64)])
    True
    >>> all_finite([])
    True
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        value = tensor if tensor.dim() == 0 else tensor.sum()
        groups.setdefault(value.dtype, []).append(value)
    flags = [torch.isfinite(torch.stack(values)).all() for values in groups.values()]
    return bool(torch.stack(flags).all()) if flags else True


def not_finite(tensor: torch.Tensor) -> int:
    """How many entries of ``tensor`` are NaN or Inf (one sum decides when the answer is 0)."""
    with torch.no_grad():
        if torch.isfinite(tensor.sum()):
            return 0
        return int((~torch.isfinite(tensor)).sum())


def _norm_shapes(prefix: str, kind, d_model: int) -> dict[str, tuple[int, ...]]:
    if kind == "LN":
        return {f"{prefix}.w": (d_model,), f"{prefix}.b": (d_model,)}
    if kind == "RMS":
        return {f"{prefix}.w": (d_model,)}
    return {}


def attention_names(cfg: Config, name: str) -> tuple[str, str, int]:
    """``(weight, bias, heads)`` for Q, K or V: ``("W_K", "b_K", n_heads)``, or for grouped-query
    keys and values ``("_W_K", "_b_K", n_key_value_heads)`` (TransformerLens's names)."""
    if name != "Q" and cfg.n_key_value_heads is not None:
        return f"_W_{name}", f"_b_{name}", cfg.n_key_value_heads
    return f"W_{name}", f"b_{name}", cfg.n_heads


def per_query_head(tensor: torch.Tensor, cfg: Config, heads: int, dim: int) -> torch.Tensor:
    """``tensor``, with ``heads`` key/value heads along axis ``dim``, repeated to one per query
    head (``n_heads``): each grouped-query key/value head serves the ``n_heads // heads`` query
    heads of its group, in order. ``tensor`` itself when ``heads == n_heads``."""
    return tensor.repeat_interleave(cfg.n_heads // heads, dim=dim) if heads != cfg.n_heads else tensor


def key_value_groups(cfg: Config) -> list[range]:
    """The query heads of each key/value head (one head each without grouped-query attention)."""
    kv_heads = cfg.n_key_value_heads or cfg.n_heads
    size = cfg.n_heads // kv_heads
    return [range(j * size, (j + 1) * size) for j in range(kv_heads)]


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name the config implies, with its shape (TransformerLens names)."""
    d, h, e = cfg.d_model, cfg.n_heads, cfg.d_head
    shapes: dict[str, tuple[int, ...]] = {"embed.W_E": (cfg.d_vocab, d)}
    if cfg.embedding_norm:
        shapes |= _norm_shapes("embed.ln", cfg.normalization_type, d)
    if cfg.positional_embedding_type in ("standard", "shortformer"):
        shapes["pos_embed.W_pos"] = (cfg.n_ctx, d)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        shapes |= _norm_shapes(f"{p}.ln1", cfg.normalization_type, d)
        for name in ("Q", "K", "V"):
            weight, bias, heads = attention_names(cfg, name)
            shapes[f"{p}.attn.{weight}"] = (heads, d, e)
            shapes[f"{p}.attn.{bias}"] = (heads, e)
            if cfg.positional_embedding_type == "shortformer_tables" and name != "V":
                shapes[f"{p}.attn.pos_{name}"] = (cfg.n_ctx, heads, e)
        if cfg.qk_norm:
            shapes[f"{p}.attn.q_norm.w"] = shapes[f"{p}.attn.k_norm.w"] = (e,)
        shapes[f"{p}.attn.W_O"] = (h, e, d)
        shapes[f"{p}.attn.b_O"] = (d,)
        if cfg.post_norms:
            shapes[f"{p}.ln1_post.w"] = (d,)
        if not cfg.attn_only:
            shapes |= _norm_shapes(f"{p}.ln2", cfg.normalization_type, d)
            shapes[f"{p}.mlp.W_in"] = (d, cfg.d_mlp)
            if cfg.gated_mlp:
                shapes[f"{p}.mlp.W_gate"] = (d, cfg.d_mlp)
            shapes[f"{p}.mlp.b_in"] = (cfg.d_mlp,)
            shapes[f"{p}.mlp.W_out"] = (cfg.d_mlp, d)
            shapes[f"{p}.mlp.b_out"] = (d,)
            if cfg.post_norms:
                shapes[f"{p}.ln2_post.w"] = (d,)
    if cfg.norm_position == "pre":
        shapes |= _norm_shapes("ln_final", cfg.normalization_type, d)
    shapes["unembed.W_U"] = (d, cfg.d_vocab)
    shapes["unembed.b_U"] = (cfg.d_vocab,)
    return shapes


#: The floating dtypes circuitmath computes in (float8 formats and complex numbers are refused).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_config_fits(state_dict: Mapping, cfg) -> None:
    """Refuse (:class:`StateDictError`) a ``cfg`` that cannot describe ``state_dict``, before
    anything proportional to the config is built: call it before :func:`expected_shapes` on a
    config read from a file."""
    problem = _config_problem(state_dict, cfg)
    if problem:
        raise StateDictError(problem)


def _config_problem(state_dict: Mapping, cfg) -> str | None:
    """Why ``cfg`` cannot describe ``state_dict``, decided before anything proportional to the
    config is built (a config read from a file may claim 10**9 layers)."""
    if not isinstance(cfg, Config):
        return config_expected(cfg, state_dict, "validate_state_dict(state_dict, cfg)")
    # Every layer has at least 8 attention tensors, so more layers than tensors cannot fit.
    if 8 * cfg.n_layers > len(state_dict):
        layers = {key.split(".")[1] for key in state_dict if isinstance(key, str) and key.startswith("blocks.")}
        return (
            f"the config says n_layers={cfg.n_layers}, but the state dict has {len(state_dict)} tensors"
            f" in {len(layers)} blocks: the config does not describe these weights"
        )
    return None


def validate_state_dict(state_dict: StateDict, cfg: Config) -> torch.dtype:
    """Check names, shapes, dtypes, devices and finiteness; return the common floating dtype.

    Raises :class:`StateDictError` listing every problem found. Its work is bounded by the state
    dict, whatever the config claims. Within :func:`validated_once` a state dict that passed
    with this config already is not checked again.
    """
    seen = _VALIDATED.get()
    if seen is None:
        return _validate(state_dict, cfg)
    hit = seen.get(id(state_dict))
    if hit is not None and hit[1] == cfg and entries_checked_here() <= hit[3] and _same_tensors(hit[0], state_dict):
        return hit[2]
    dtype = _validate(state_dict, cfg)
    seen[id(state_dict)] = ({name: weakref.ref(t) for name, t in state_dict.items()}, cfg, dtype, entries_checked_here())
    return dtype


def _same_tensors(refs: dict, state_dict: StateDict) -> bool:
    """Whether ``state_dict`` holds, under the same names, the tensors ``refs`` refers to (weakly:
    a state dict that passed is not kept alive by having passed; one made since at the same
    address passes again only if it holds the very tensors that passed)."""
    return len(refs) == len(state_dict) and all(
        (ref := refs.get(name)) is not None and ref() is tensor for name, tensor in state_dict.items())


def _validate(state_dict: StateDict, cfg: Config) -> torch.dtype:
    """:func:`validate_state_dict`'s checks, every time."""
    if isinstance(state_dict, Config):
        raise StateDictError(config_expected(cfg, state_dict, "validate_state_dict(state_dict, cfg)"))
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"expected a mapping of names to tensors, got {type(state_dict).__name__}")
    check_config_fits(state_dict, cfg)
    not_names = [repr(name) for name in state_dict if not isinstance(name, str)]
    if not_names:
        raise StateDictError(f"parameter names must be strings, got {', '.join(not_names[:5])}")
    shapes = expected_shapes(cfg)
    problems = []
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected} (does the config match the weights?)")
    dtypes, devices = {}, {}
    for name in sorted(set(shapes) & set(state_dict)):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
            continue
        if tuple(tensor.shape) != shapes[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the config implies {shapes[name]}")
        if tensor.dtype not in DTYPES:
            problems.append(
                f"{name} has dtype {tensor.dtype}; circuitmath computes in {', '.join(map(str, DTYPES))}"
            )
            continue
        if tensor.is_meta:
            problems.append(f"{name} is on the meta device: it holds no values to check or rewrite")
            continue
        dtypes.setdefault(tensor.dtype, name)
        devices.setdefault(tensor.device, name)
        # A finite sum proves every entry finite (a NaN or Inf entry makes it NaN or Inf) at a
        # fraction of the cost of isfinite; only a sum that is not finite needs the count.
        if _CHECK_ENTRIES.get():
            bad = _entries_not_finite(tensor)
            if bad:
                problems.append(f"{name} has {bad} NaN or Inf entries")
    if len(dtypes) > 1:
        problems.append(
            "mixed dtypes (" + ", ".join(f"{name} is {dtype}" for dtype, name in dtypes.items()) + "); use one floating dtype"
        )
    if len(devices) > 1:
        problems.append(
            "tensors on several devices (" + ", ".join(f"{name} on {device}" for device, name in devices.items()) + ")"
        )
    if problems:
        raise StateDictError("state dict does not match its config: " + "; ".join(problems))
    return next(iter(dtypes)) if dtypes else torch.get_default_dtype()
