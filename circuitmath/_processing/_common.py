"""What every transform shares: the readers of each norm and the precondition checks."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import torch

from .._config import Config, config_expected
from .._errors import NOT_APPLIED, AlreadyAppliedError, OverflowedError, Precondition, PreconditionError, StateDictError
from .._moe import mixture_readers
from .._state import Validated, attention_names, entries_known_finite, not_finite, vouched

__all__ = [
    "readers", "require", "refuse_reapplication", "rewrite", "undone_by",
    "NOT_APPLIED", "PRE_NORM", "NORM_READ_LINEARLY", "NOT_ROTARY", "NO_QK_NORM", "NO_LOGIT_SOFTCAP", "NO_ATTN_SOFTCAP", "qk_normed", "untied",
    "NO_POST_NORMS", "POST_NORM_GAINS_EQUAL", "require_even_post_norms", "DENSE_MLP", "require_dense_mlp",
    "NO_ATTN_SINKS", "require_no_sinks",
]

#: Shared by the transforms that need them (each identity lists the ones its transform raises).
PRE_NORM = Precondition("pre-norm", "pre-norm: every sub-layer and the unembed read the residual stream through a norm")
NORM_READ_LINEARLY = Precondition(
    "norm output read only by linear maps",
    "each norm's output is read only by linear maps: no shortformer W_pos added to it before W_Q and W_K",
)
NOT_ROTARY = Precondition(
    "keys and queries are not rotated by position", "queries and keys are not rotated by position (no rotary embeddings)"
)

NO_QK_NORM = Precondition(
    "no QK-norm",
    "queries and keys are not normalised after their projection (no QK-norm): each score is bilinear in the stream",
)

def qk_normed(cfg: Config) -> str:
    """What the QK-norm of ``cfg`` normalises, in words, for a refusal's detail."""
    if cfg.qk_norm_over == "projection":
        return ("the whole query and key projections, every head's entries together, each entry with a gain of its own"
                " (QK-norm over the projection)")
    return "each head's queries and keys (QK-norm)"


NO_LOGIT_SOFTCAP = Precondition(
    "no logit softcap",
    "the logits reach the softmax as they are: no softcap cap * tanh(l / cap), which is not shift-invariant",
)
NO_ATTN_SOFTCAP = Precondition(
    "no attention-score softcap",
    "the scores reach the softmax as they are: no softcap cap * tanh(s / cap), which is not shift-invariant",
)
NO_POST_NORMS = Precondition(
    "no sandwich norms",
    "each sub-layer writes its output to the residual stream as it is, not through a norm of its own (post_norms)",
)

POST_NORM_GAINS_EQUAL = Precondition(
    "each sandwich norm's gain is one number",
    "every sandwich norm (post_norms) applies the same gain to every dimension: a gain diag(g) after the norm commutes"
    " with an orthogonal Q only when g is constant",
)

NO_ATTN_SINKS = Precondition(
    "no attention sinks",
    "every row of every attention pattern sums to 1: no attention sink (a logit per head in each softmax whose"
    " weight is dropped)",
)


def require_no_sinks(identity: str, cfg: Config, detail: str) -> None:
    """Refuse (:data:`NO_ATTN_SINKS`) a model with attention sinks (``cfg.attn_sinks``), saying ``detail``."""
    require(identity, NO_ATTN_SINKS, not cfg.attn_sinks, detail)


DENSE_MLP = Precondition(
    "every MLP is one dense MLP",
    "every MLP is one dense MLP, not a mixture of experts (whose experts a router chooses per token)",
)


def require_dense_mlp(identity: str, cfg: Config) -> None:
    """Refuse (:data:`DENSE_MLP`) a model whose MLPs are mixtures of experts (``cfg.n_experts``)."""
    require(identity, DENSE_MLP, cfg.n_experts is None,
            f"each MLP is a mixture of {cfg.n_experts} experts chosen per token by a router: {identity} rewrites"
            " one dense MLP per layer")


def require_even_post_norms(identity: str, state_dict, cfg: Config) -> None:
    """Refuse (:data:`POST_NORM_GAINS_EQUAL`) a model with sandwich norms (``cfg.post_norms``) one
    of whose gains ``[d_model]`` is not one number: a rotation of the stream does not commute with it."""
    uneven = [name for name in state_dict if name.endswith(("ln1_post.w", "ln2_post.w"))
              and bool((state_dict[name] != state_dict[name][0]).any())] if cfg.post_norms else []
    require(identity, POST_NORM_GAINS_EQUAL, not uneven,
            f"the sandwich norms {uneven[:3]} apply a gain that differs between dimensions after normalising each"
            " write, and diag(g) Q != Q diag(g)")


def _same(given, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``given`` passed through (detached or not): already checked."""
    return isinstance(given, torch.Tensor) and (given is tensor or (given.requires_grad and given.data_ptr() == tensor.data_ptr()
                                                                       and given.shape == tensor.shape))


#: For an identity whose record a later rewrite can make false: its transform, and the
#: identities whose rewrites do (:func:`undone_by`).
_UNDONE_BY: dict[str, tuple[Callable, set[str]]] = {}


def undone_by(transform: Callable, *later: Callable) -> None:
    """Declare that each of the transforms ``later`` can make ``transform``'s record false (it
    rewrites what ``transform`` established: the LayerNorm fold adds ``ln1.b @ W_V`` to the
    value biases that :func:`~circuitmath.fold_value_biases` set to zero). When one of them
    rewrites a model that records ``transform``, ``transform`` is applied again to its output,
    and its record stays where it was: ``cfg.applied`` stays true of the weights, and stays the
    history that a replay of its identities reproduces."""
    _UNDONE_BY.setdefault(transform.identity, (transform, set()))[1].update(t.identity for t in later)


def _reestablished(identity: str, given: Config, out: dict, out_cfg: Config) -> tuple[dict, Config]:
    """``out`` with each identity that ``given.applied`` records and ``identity`` undoes applied
    again, in the order recorded; ``out_cfg.applied`` as it was."""
    for name in [n for n in given.applied if identity in _UNDONE_BY.get(n, ((), ()))[1]]:
        again = _UNDONE_BY[name][0]
        out, cfg = again(out, out_cfg.replace(applied=tuple(n for n in out_cfg.applied if n != name)))
        out_cfg = cfg.replace(applied=out_cfg.applied)
    return out, out_cfg


def rewrite(transform: Callable | None = None, *, composes: bool = False, records: bool = True,
            check_output: bool = True) -> Callable:
    """Make ``transform(state_dict, cfg, ..., *, identity) -> (state_dict, cfg)`` the public
    transform of the identity named after it (``transform.__name__``: the one place the name is
    written; the registered :class:`~circuitmath.Identity` reads it from here).

    The prologue and epilogue every transform shares, done once here: the arguments' types are
    checked; unless the identity ``composes`` (a rotation or a permutation applied twice is one
    exact application), a config that records the identity already is refused
    (:class:`~circuitmath.AlreadyAppliedError`); ``transform`` runs without autograd (weights that
    require grad are accepted, plain tensors come back) and receives the identity's name as
    ``identity`` (for its refusals); with ``records``, its output config records the identity (a
    transform that records something else, or more, says so itself, ``records=False``). With
    ``check_output``, every tensor the transform wrote is checked: the input was validated finite,
    so a NaN or an Inf in the output means the rewrite left the dtype's range, and
    :class:`~circuitmath.OverflowedError` names the identity and the tensors instead of returning a
    different model; not when the input's entries are checked by its maker (a
    :class:`~circuitmath._state.Validated` with ``entries=False``: the pipeline checks once at the
    end). A :class:`~circuitmath._state.Validated` input gives one as output, so a chain of
    transforms inside the package validates nothing again. Last, each identity that the input
    records and this one undoes (:func:`undone_by`) is applied again.
    """
    if transform is None:
        return functools.partial(rewrite, composes=composes, records=records, check_output=check_output)
    identity = transform.__name__

    @functools.wraps(transform)
    def run(state_dict, cfg, *args, **kwargs):
        if not isinstance(cfg, Config):
            raise StateDictError(f"{identity}: {config_expected(cfg, state_dict, f'{identity}(state_dict, cfg)')}")
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"{identity}: expected a mapping of names to tensors, got {type(state_dict).__name__}")
        if not composes:
            refuse_reapplication(identity, cfg)
        with torch.no_grad():
            out, out_cfg = transform(state_dict, cfg, *args, identity=identity, **kwargs)
            if records:
                out_cfg = out_cfg.replace(applied=out_cfg.applied + (identity,))
            out_cfg = untied(state_dict, out, out_cfg)
            out = {name: tensor.detach() if tensor.requires_grad else tensor for name, tensor in out.items()}
            if check_output and entries_known_finite(state_dict):
                _refuse_overflow(identity, state_dict, out)
            if isinstance(state_dict, Validated) and state_dict.holds_for(cfg):
                out = vouched(out, out_cfg, state_dict.dtype, entries=state_dict.entries, writers=state_dict.writers)
            out, out_cfg = _reestablished(identity, cfg, out, out_cfg)
        return out, out_cfg

    signature = inspect.signature(transform)
    run.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "identity"])
    run.identity = identity  # the registered identity it performs
    return run


def untied(given: Mapping, out: Mapping, cfg: Config) -> Config:
    """``cfg`` (the config of ``out``, a rewrite of ``given``), with ``tied_embeddings=False``
    where it says the unembedding is the token embedding transposed and ``out``'s no longer is:
    the rewrite untied them (a norm folded into ``W_U``, the writers centered). ``W_E`` and
    ``W_U`` passed through as given are as tied as they were."""
    W_E, W_U = out.get("embed.W_E"), out.get("unembed.W_U")
    if not cfg.tied_embeddings or W_E is None or W_U is None:
        return cfg
    if W_E is given.get("embed.W_E") and W_U is given.get("unembed.W_U"):
        return cfg
    if W_U.shape == W_E.shape[::-1] and W_U.device == W_E.device and torch.equal(W_U, W_E.T):
        return cfg
    return cfg.replace(tied_embeddings=False)


def _refuse_overflow(identity: str, given: Mapping, out: dict) -> None:
    """:class:`~circuitmath.OverflowedError` when a tensor of ``out`` that is not ``given``'s own has a NaN or an Inf."""
    bad = {name: count for name, tensor in out.items()
           if not _same(given.get(name), tensor) and (count := not_finite(tensor))}
    if bad:
        dtype = next(iter(out.values())).dtype
        raise OverflowedError(
            f"{identity}: the rewrite of finite weights overflowed {dtype} (left its range): "
            + ", ".join(f"{name} has {count} NaN or Inf entries" for name, count in bad.items())
            + "; nothing is returned (compute in a wider dtype)"
        )


def readers(cfg: Config, *, unnormed: bool = False) -> list[tuple[str, list[tuple[str, str]]]]:
    """For each norm, the (weight, bias) pairs that read its output (bias ``None``: W_gate has none).

    Attention weights are ``[n_heads, d_model, d_head]``, MLP and unembed ``[d_model, out]``;
    in both the residual axis is the second to last. A model without pre-norms
    (``cfg.pre_norms=False``) has only the final norm; ``unnormed`` adds its sub-layers' readers,
    which read the residual stream itself, under the names ``ln1`` and ``ln2`` of the norms it lacks.
    """
    out = []
    for layer in range(cfg.n_layers if cfg.pre_norms or unnormed else 0):
        p = f"blocks.{layer}"
        names = [attention_names(cfg, n) for n in "QKV"]
        out.append((f"{p}.ln1", [(f"{p}.attn.{w}", f"{p}.attn.{b}") for w, b, _ in names]))
        if not cfg.attn_only:
            mlp = [(f"{p}.mlp.W_in", f"{p}.mlp.b_in")] + ([(f"{p}.mlp.W_gate", None)] if cfg.gated_mlp else [])
            mlp = mlp if cfg.n_experts is None else mixture_readers(cfg, f"{p}.mlp")
            out.append((f"{p}.ln2", mlp))
    out.append(("ln_final", [("unembed.W_U", "unembed.b_U")]))
    return out


def require(identity: str, precondition: Precondition, holds: bool, detail: str) -> None:
    """Refuse the model unless ``holds``: :class:`~circuitmath.PreconditionError` naming the
    registered ``precondition`` (the object itself, not a copy of its text) and ``detail``.

    A plain string is still accepted (code written before preconditions were objects keeps
    working), but ``tests/test_preconditions.py`` fails on it: register a Precondition instead.
    """
    if not holds:
        raise PreconditionError(identity, precondition, detail)


def refuse_reapplication(identity: str, cfg: Config) -> None:
    """The applied-guard every transform starts with: :class:`~circuitmath.AlreadyAppliedError`
    (precondition :data:`NOT_APPLIED`) when ``cfg.applied`` records ``identity`` already."""
    if identity in cfg.applied:
        raise AlreadyAppliedError(identity)
