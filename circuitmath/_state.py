"""Which tensors a config implies, and validation of state dicts against it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ._config import Config, config_expected
from ._errors import InputError, StateDictError
from ._moe import mixture_shapes

__all__ = [
    "attention_names",
    "per_query_head",
    "key_value_groups",
    "expected_shapes",
    "validate_state_dict",
    "Validated",
    "validated",
    "vouched",
    "marked_as",
    "entries_known_finite",
    "check_config_fits",
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


class Validated(dict):
    """A state dict validated against ``cfg``: names, shapes, one floating ``dtype``, one device
    and, with ``entries``, every entry finite. Made by :func:`validated` at a public entry point,
    or by :func:`vouched` where internal code makes a state dict from validated ones (a
    transform's output, a copy in another dtype); :func:`validate_state_dict` passes it without
    reading it again. Changing it (setting, deleting, updating a key) takes the mark away: then it
    is a plain state dict, validated when it is next checked. It never leaves the package: public
    functions return plain dicts (a copy or a pickle of it is one).

    ``entries=False``: the caller checks the entries itself (the processing pipeline checks what
    goes in and what comes out, not every step's input).

    ``writers``: for a part of a model cut into parts, what the whole model's writers are, given
    by the caller that cut it (``circuitmath._streaming_check_model``): a function from the
    part's :func:`~circuitmath._processing.norms.writer_means` and
    :func:`~circuitmath._processing.norms.writer_scale` to those that
    :func:`~circuitmath._processing.norms.uncentered_writers` decides on (``None``: the state
    dict's own). A transform's output, and a copy in another dtype, carry their input's."""

    __slots__ = ("cfg", "dtype", "entries", "writers", "_intact")

    def __init__(self, tensors: Mapping, cfg: Config, dtype: torch.dtype, *, entries: bool = True,
                 writers: Callable[[dict, float], tuple[dict, float]] | None = None):
        super().__init__(tensors)
        self.cfg, self.dtype, self.entries, self.writers, self._intact = cfg, dtype, entries, writers, True

    def holds_for(self, cfg: Config) -> bool:
        """Whether this has not been changed since it was validated against a config that implies
        the names and shapes ``cfg`` implies (``cfg`` itself; one that differs in ``applied``, or
        in a norm without parameters: ``LNPre`` and ``RMSPre``)."""
        if not self._intact or not isinstance(cfg, Config):
            return False
        if self.cfg == cfg:
            return True
        return _config_problem(self, cfg) is None and expected_shapes(self.cfg) == expected_shapes(cfg)

    def _changed(self) -> None:
        self._intact = False

    def __setitem__(self, key, value):
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def clear(self):
        self._changed()
        super().clear()

    def update(self, *args, **kwargs):
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)

    def copy(self) -> dict:
        return dict(self)

    def __reduce__(self):
        return dict, (dict(self),)


def validated(state_dict: StateDict, cfg: Config, *, entries: bool = True) -> Validated:
    """``state_dict`` validated against ``cfg`` (:func:`validate_state_dict`; with
    ``entries=False`` not the entries, which the caller checks), as a :class:`Validated`: the one
    validation of an input, at the public entry point that takes it. A :class:`Validated` that
    holds for ``cfg`` (with its entries checked, when ``entries``) is returned as it is."""
    if isinstance(state_dict, Validated) and state_dict.holds_for(cfg) and (state_dict.entries or not entries):
        return state_dict
    return Validated(state_dict, cfg, _validate(state_dict, cfg, entries=entries), entries=entries)


def vouched(tensors: Mapping, cfg: Config, dtype: torch.dtype | None = None, *, entries: bool = True,
            writers: Callable[[dict, float], tuple[dict, float]] | None = None) -> Validated:
    """``tensors`` as a :class:`Validated` for ``cfg``, unread: for internal code that made them
    from validated tensors in a way that keeps names, shapes, dtype and device right for ``cfg``
    (a transform's output, the dict of another validated one's tensors). ``dtype`` defaults to
    the first tensor's; ``entries``: whether the entries are known finite; ``writers``: as
    :class:`Validated`'s."""
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype if tensors else torch.get_default_dtype()
    return Validated(tensors, cfg, dtype, entries=entries, writers=writers)


def marked_as(source: Mapping, tensors: Mapping, cfg: Config | None = None) -> dict:
    """``tensors``, a dict internal code made from ``source``'s tensors and other validated ones
    of the same dtype, with the names and shapes ``cfg`` (default: ``source``'s) implies: a
    :class:`Validated` (of ``source``'s dtype) when ``source`` is one that holds, else a plain dict."""
    if isinstance(source, Validated) and source._intact:
        return Validated(tensors, source.cfg if cfg is None else cfg, source.dtype, entries=source.entries,
                         writers=source.writers)
    return dict(tensors)


def entries_known_finite(state_dict: Mapping) -> bool:
    """Whether ``state_dict``'s entries are known finite: a plain state dict's are checked by
    :func:`validate_state_dict`; a :class:`Validated` says (``entries=False``: its maker checks
    them, the processing pipeline on its way out)."""
    return not isinstance(state_dict, Validated) or state_dict.entries


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
        if cfg.pre_norms:
            shapes |= _norm_shapes(f"{p}.ln1", cfg.normalization_type, d)
        for name in ("Q", "K", "V"):
            weight, bias, heads = attention_names(cfg, name)
            shapes[f"{p}.attn.{weight}"] = (heads, d, e)
            shapes[f"{p}.attn.{bias}"] = (heads, e)
            if cfg.positional_embedding_type == "shortformer_tables" and name != "V":
                shapes[f"{p}.attn.pos_{name}"] = (cfg.n_ctx, heads, e)
        if cfg.qk_norm and cfg.qk_norm_over == "head":
            shapes[f"{p}.attn.q_norm.w"] = shapes[f"{p}.attn.k_norm.w"] = (e,)
        elif cfg.qk_norm:  # one norm over each whole projection, a gain per entry
            shapes[f"{p}.attn.q_norm.w"], shapes[f"{p}.attn.k_norm.w"] = (h, e), (cfg.n_key_value_heads or h, e)
        if cfg.attn_sinks:
            shapes[f"{p}.attn.sinks"] = (h,)
        shapes[f"{p}.attn.W_O"] = (h, e, d)
        shapes[f"{p}.attn.b_O"] = (d,)
        if cfg.post_norms:
            shapes[f"{p}.ln1_post.w"] = (d,)
        if not cfg.attn_only:
            if cfg.pre_norms:
                shapes |= _norm_shapes(f"{p}.ln2", cfg.normalization_type, d)
            if cfg.n_experts is not None:
                shapes |= mixture_shapes(cfg, f"{p}.mlp")
            else:
                shapes[f"{p}.mlp.W_in"] = (d, cfg.d_mlp)
            if cfg.gated_mlp and cfg.n_experts is None:
                shapes[f"{p}.mlp.W_gate"] = (d, cfg.d_mlp)
            if cfg.n_experts is None:
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
    dict, whatever the config claims. A :class:`Validated` state dict that holds for ``cfg`` (one
    validated by the public function that took it, or made from such by internal code) is not
    read again.
    """
    if isinstance(state_dict, Validated) and state_dict.holds_for(cfg):
        return state_dict.dtype
    return _validate(state_dict, cfg)


def _validate(state_dict: StateDict, cfg: Config, *, entries: bool = True) -> torch.dtype:
    """:func:`validate_state_dict`'s checks, every time: the one full validation (``entries``:
    that every entry is finite too)."""
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
        if entries:
            bad = not_finite(tensor)
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
