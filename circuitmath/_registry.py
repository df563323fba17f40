"""The one list of identities: :class:`Identity` and :func:`register`.

How to add an identity (four files):

1. **Its family module** in ``circuitmath/_identities/`` (or a new one): the transform, a function
   ``name(state_dict, cfg, ..., *, identity)`` decorated with
   :func:`~circuitmath._processing._common.rewrite`, whose Python name is the identity's name
   (the wrapper checks the arguments, refuses a second application, records the name in
   ``cfg.applied``, refuses an overflowed output, and passes the name as ``identity`` for the
   transform's own refusals through ``require``); the proof, a function returning a
   :class:`~circuitmath.Proof` with negative twins; the wrong rewrites; and
   ``register(Identity(title=..., summary=..., preconditions=(...), build_proof=...,
   transform=..., wrong_rewrites={...}, half_precision=COMPUTES, postcondition=...))``, the
   postcondition saying what the rewrite makes true of the weights (or :data:`NOTHING_SHOWN`).
   Its ``CHAPTER`` names the book chapter. An identity with a free parameter gives ``recover`` and ``with_parameters``; one
   that licenses a computation rather than a weight rewrite gives ``name`` and ``compare``.
2. **The one line that lists families**, for a new family only: its import in
   ``circuitmath/_identities/__init__.py``.
3. **Its tests**: ``tests/test_<family>.py``.
4. **Its book section**, in ``book/<CHAPTER>.md``.

Everything else iterates the registry: its checker (``circuitmath.testing.CHECKERS``,
``check_identity``), the diagnosis's replay and ``check_model``, the checker and half-precision
tests, the book's list of identities, the mutation targets. Giving the transform a public name
(``circuitmath.<name>``, ``circuitmath.testing.check_<name>``) is one line in each of the two static
lists of public names, ``circuitmath/__init__.py`` and ``circuitmath/testing.py``, which
``tests/test_registry.py`` and ``tests/test_public_api.py`` hold to the registry.

Each family module registers its identities on import;
:func:`circuitmath._identities.identities` imports every family and lists them. This module
imports nothing above the comparison of log-probs (:mod:`circuitmath._compare`), so nothing it
imports comes back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import functools
import sys
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch

from ._config import FORMER_NAMES, Config
from ._proof import Proof, ProofReport
from ._state import StateDict
from ._compare import Comparison, compare_log_probs

__all__ = ["Identity", "WrongRewrite", "FirstRecovery", "SharedRotation", "register", "registered", "COMPUTES", "MOVES_ENTRIES", "COMPOSES",
           "AS_THE_FORWARD_PASS", "NOTHING_SHOWN"]

Transform = Callable[[StateDict, Config], tuple[dict, Config]]
#: ``compare(state_dict, cfg, tokens, computation) -> Comparison``: the numeric check of an identity
#: whose ``transform`` is a computation it licenses rather than a weight rewrite.
Compare = Callable[[StateDict, Config, "torch.Tensor | None", Callable], Comparison]

#: What a weight identity's transform does to half-precision weights (``Identity.half_precision``),
#: which ``tests/test_accuracy.py`` measures on every model of its list the identity applies to:
#: it computes (in float32 or float64, each entry rounded once to the weights' dtype) ...
COMPUTES = "computes"
#: ... it only copies, permutes or zeroes entries (bit for bit the float64 result rounded) ...
MOVES_ENTRIES = "moves entries"
#: ... it composes other identities' transforms, each measured as its own identity ...
COMPOSES = "composes"
#: ... or it rounds as the model's forward pass does (a multiplier rounded to the weights' dtype
#: first), which its own tests check bit for bit against the forward pass.
AS_THE_FORWARD_PASS = "as the forward pass"

#: ``Identity.postcondition`` of an identity whose record the weights cannot show: a free
#: parameter (a scale, a basis, an order) leaves no mark a function of the output alone could read.
NOTHING_SHOWN = "nothing the weights show"

#: ``postcondition(state_dict, cfg) -> None`` when what the identity makes true of the weights it
#: returns holds of ``state_dict`` (of config ``cfg``), else a message saying what is not true.
Postcondition = Callable[[StateDict, Config], "str | None"]


@dataclass(frozen=True)
class WrongRewrite:
    """A plausible wrong version of an identity's transform: the numeric side of a negative twin.

    ``function`` has the transform's signature. ``description`` says the mistake in words, once:
    the proof's negative twin of the same name reads it from here (``None``, for a wrong rewrite
    without such a twin: the first line of ``function``'s docstring). ``differs_on(cfg)`` says on
    which models it differs from the exact rewrite at all (``None``: on every model the identity
    applies to; e.g. a mistake that only broadcasts silently where a reader is square); the
    numeric checks expect a rejection only there. ``regardless``: the identity's own rewrite
    applied although the identity refuses the model; the diagnosis tries it only when the identity
    refuses.
    """

    function: Transform = field(repr=False)
    description: str | None = None
    differs_on: Callable[[Config], bool] | None = field(default=None, repr=False)
    regardless: bool = False

    def __call__(self, state_dict: StateDict, cfg: Config, *tokens) -> tuple[dict, Config]:
        """The wrong transform (or, for an identity with ``compare``, the wrong computation, which
        also takes the tokens)."""
        return self.function(state_dict, cfg, *tokens)


class SharedRotation:
    """A recovered parameter that rotates one space many tensors share (the residual stream's
    basis): ``matrix`` (``[d, d]``, float64) the recovered rotation. In half precision the
    diagnosis widens the bound of each tensor a rewrite with it rotates by the spread of each
    column of ``matrix`` against a re-fit to the rewrite rounded: :meth:`rewrite` is ``state_dict``
    rotated by ``matrix``, unchecked and unrounded; :meth:`refit` the same fit, of the same
    tensors, from ``before`` to another ``after``; :meth:`axes` each tensor it rotates (names of
    models of config ``cfg``) and its axis along the space."""

    matrix: torch.Tensor

    def rewrite(self, state_dict: StateDict, cfg: Config) -> dict:
        raise NotImplementedError

    def refit(self, before: StateDict, after: StateDict, cfg: Config) -> "SharedRotation":
        raise NotImplementedError

    def axes(self, cfg: Config) -> dict[str, int]:
        raise NotImplementedError


@dataclass(frozen=True)
class FirstRecovery:
    """How the diagnosis recognises a symmetry that acts on every tensor (the residual
    rotation) before the other recovered parameters, whose steps may come before or after it.

    ``start(before, cfg)``: a starting point besides the replay's end (``before`` brought into
    the form the symmetry needs), or a :class:`~circuitmath._errors.PreconditionError`.
    ``undone(start, after, cfg, same, recognise)``: ``None`` where ``after`` cannot be ``start``
    so rewritten, else ``after`` with the parameter, fitted from ``start`` each way the recovery
    tries, undone (an iterable; ``same(name, tensor)`` says whether ``tensor`` is ``after``'s
    ``name``, ``recognise`` the relative threshold of such tests): the diagnosis replays the
    other steps against each. ``first(state, after, cfg)``: the identity replayed before the
    symmetry where its parameter needs another form of the model (``None``: none).
    ``performed(cfg)``: the identity the symmetry is on a model of config ``cfg``.
    """

    start: Callable[[StateDict, Config], tuple[StateDict, Config]]
    undone: Callable[..., "Iterable[dict] | None"]
    first: Callable[[StateDict, StateDict, Config], "Identity | None"]
    performed: Callable[[Config], "Identity"]


@dataclass(frozen=True, eq=False, kw_only=True)
class Identity:
    """One identity, seen three ways: a proof, a numeric check, and the transform it licenses.

    ``summary`` is the statement in one plain line; the LaTeX statement comes from the proof.
    ``preconditions`` are the conditions under which it holds; a transform refuses a model by
    raising one of them (:func:`circuitmath._processing._common.require` takes the very object,
    a :class:`~circuitmath._errors.Precondition`, so the error and the registry agree).
    ``check_requires`` are what the numeric check needs of the model it runs the identity in,
    for an identity that holds on its own (an identity of matrices, with no preconditions) but
    is checked inside a model: the check refuses other models by raising one of them.
    ``prepare`` brings a model into the form the transform needs (e.g. folds the LayerNorm
    before reading weights are centered); the numeric check compares the prepared model with its
    transform, so it tests this identity alone. ``wrong_rewrites`` is the one catalogue of the
    identity's wrong variants (:class:`WrongRewrite`, or a bare transform): the numeric checks
    must reject each where it differs, the diagnosis names the one a processed model shows, the
    tests and the book iterate them. ``public`` is the public transform (``circuitmath.<function>``,
    made by :func:`~circuitmath._processing._common.rewrite`; default: ``transform`` when it is
    one), where the identity has one with a parameter that ``transform`` fixes; ``function`` is its
    name, and the checker is ``circuitmath.testing.check_<function>``; ``check_note`` adds to that
    checker's documentation. ``name`` defaults to the name of the identity the transform performs
    (a public transform's own name): a weight identity's name is written once, as its transform's.

    ``compare`` is for identities that license a computation rather than a weight rewrite (the
    logits as a sum of path terms, composition scores from factors): ``transform`` and each
    wrong rewrite are then that computation, ``(state_dict, cfg, tokens) -> result``, and
    ``compare(state_dict, cfg, tokens, computation)`` measures its result against the reference
    (the forward pass, or the same quantity computed naively) as a
    :class:`~circuitmath.testing.Comparison`.

    ``half_precision`` says what a weight identity's transform does to half-precision weights:
    :data:`COMPUTES`, :data:`MOVES_ENTRIES`, :data:`COMPOSES` or :data:`AS_THE_FORWARD_PASS` (``None`` for an identity that
    licenses a computation). ``chapter`` is the book chapter (its file's stem) whose section
    states, proves and checks the identity; default: its family module's ``CHAPTER``.

    ``free_parameter``: the identity holds for every value of a parameter (a rotation ``Q``, a
    permutation) that its ``transform`` fixes for the numeric checks, so the diagnosis does not
    replay it blind: it recovers the parameter from the tensors with ``recover`` (an identity
    with ``recover`` has a free parameter whether it says so or not).

    ``recover(before, after, cfg)``: for an identity with a free parameter (a rotation, a
    permutation, per-channel scales), the parameter that maps ``before`` onto ``after``, or
    ``None`` (a :class:`SharedRotation` where it rotates a space many tensors share);
    ``with_parameters(state_dict, cfg, parameter)`` applies the identity with it (its public
    transform). The diagnosis recovers the parameter instead of replaying ``transform``, whose
    parameter is fixed for the numeric checks. ``wrong_rewrites_recovered``: whether the diagnosis
    tries the wrong rewrites with the recovered parameter too, each taking it as an optional third
    argument (``False`` where a recovered parameter is verified on every
    tensor it moves, as a permutation's is: the exact rewrite with it reproduces each of them,
    which a wrong one cannot better). ``recovered_first``: for a symmetry the diagnosis recognises
    before the other recovered ones, how (:class:`FirstRecovery`; identities that share it are
    one symmetry, each the form it takes on some models). ``permutes``: for a permutation, the
    units it permutes (``"heads"``, ``"neurons"``): the diagnosis recognises those units moved by
    hand, tensor by tensor, as this identity or its partial wrong rewrite.

    ``postcondition``: what a weight identity's rewrite makes true of the weights it returns
    (:data:`Postcondition`), which holds of any model whose ``cfg.applied`` records the identity
    (``tests/test_applied.py`` applies every pair of identities and every pipeline, and reads it),
    or :data:`NOTHING_SHOWN`; ``None`` only for an identity that composes others' rewrites or
    licenses a computation. ``moves_off``: the public transforms whose records this identity's
    rewrite makes untrue by design (a rotation of the residual basis moves it off the centered
    form): their postconditions describe the model before it.
    """

    name: str = None  # type: ignore[assignment]  # derived from the transform when not given
    title: str
    summary: str
    preconditions: tuple[str, ...]
    build_proof: Callable[[], Proof] = field(repr=False)
    transform: Transform = field(repr=False)
    wrong_rewrites: Mapping[str, WrongRewrite | Transform] = field(default_factory=dict, repr=False)
    prepare: Transform | None = field(default=None, repr=False)
    compare: Compare | None = field(default=None, repr=False)
    public: Callable[..., tuple[dict, Config]] | None = field(default=None, repr=False)
    function: str | None = field(default=None, init=False)
    check_note: str | None = field(default=None, repr=False)
    check_requires: tuple = ()
    recover: Callable[[StateDict, StateDict, Config], object] | None = field(default=None, repr=False)
    with_parameters: Callable[..., tuple[dict, Config]] | None = field(default=None, repr=False)
    half_precision: str | None = None
    chapter: str | None = None
    free_parameter: bool = False
    wrong_rewrites_recovered: bool = True
    recovered_first: FirstRecovery | None = field(default=None, repr=False)
    permutes: str | None = None
    postcondition: Postcondition | str | None = field(default=None, repr=False)
    moves_off: tuple[Callable, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        public = self.public
        if public is None and self.compare is None and hasattr(self.transform, "identity"):
            public = self.transform  # a public transform (made by ``rewrite``); a partial or a private route is none
        object.__setattr__(self, "public", public)
        object.__setattr__(self, "function", None if public is None else public.__name__)
        if self.name is None:
            performs = self.transform.func if isinstance(self.transform, functools.partial) else self.transform
            object.__setattr__(self, "name", getattr(public or performs, "identity", None))
        if not isinstance(self.name, str):
            raise ValueError(f"an identity whose transform {self.transform!r} is no public transform needs a name")
        if self.chapter is None:
            object.__setattr__(self, "chapter", getattr(sys.modules.get(self.build_proof.__module__), "CHAPTER", None))
        if self.half_precision not in (COMPUTES, MOVES_ENTRIES, COMPOSES, AS_THE_FORWARD_PASS, None):
            raise ValueError(f"{self.name}: half_precision is {self.half_precision!r}, not one of COMPUTES, MOVES_ENTRIES,"
                             " COMPOSES, AS_THE_FORWARD_PASS")
        if not (self.postcondition in (None, NOTHING_SHOWN) or callable(self.postcondition)):
            raise ValueError(f"{self.name}: postcondition is {self.postcondition!r}, not a function or NOTHING_SHOWN")
        object.__setattr__(self, "wrong_rewrites", MappingProxyType({
            name: wrong if isinstance(wrong, WrongRewrite) else WrongRewrite(wrong)
            for name, wrong in self.wrong_rewrites.items()
        }))

    @cached_property
    def proof(self) -> Proof:
        return self.build_proof()

    @property
    def statement_latex(self) -> str:
        return self.proof.statement_latex()

    def prove(self) -> ProofReport:
        return self.proof.verify(self.name)

    @property
    def wrong_everywhere(self) -> dict[str, WrongRewrite]:
        """The wrong rewrites that differ on every model the identity applies to (no ``differs_on``,
        not ``regardless``): those a numeric check must reject on any model."""
        return {
            name: wrong for name, wrong in self.wrong_rewrites.items()
            if wrong.differs_on is None and not wrong.regardless
        }

    def wrong_rewrites_for(self, cfg: Config) -> dict[str, WrongRewrite]:
        """The wrong rewrites the numeric check must reject on a model of config ``cfg``."""
        return {
            name: wrong for name, wrong in self.wrong_rewrites.items()
            if not wrong.regardless and (wrong.differs_on is None or wrong.differs_on(cfg))
        }

    def describe(self, wrong: str) -> str:
        """The wrong rewrite ``wrong`` in words: its own description (which the negative twin of the
        same name reads too), else its docstring's first line; read without building the proof."""
        rewrite = self.wrong_rewrites[wrong]
        if rewrite.description:
            return rewrite.description
        doc = " ".join((getattr(rewrite.function, "__doc__", None) or "").strip().split("\n\n")[0].split()).rstrip(".")
        return doc[0].lower() + doc[1:] if doc else wrong.replace("_", " ")

    def prepared(self, state_dict: StateDict, cfg: Config) -> tuple[StateDict, Config]:
        """The model the transform applies to: ``prepare``'s output, or the model itself."""
        return self.prepare(state_dict, cfg) if self.prepare else (state_dict, cfg)

    def check(self, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None = None) -> Comparison:
        """Apply the transform and compare log-probs with the model it started from (or run ``compare``)."""
        return self._check(self.transform, state_dict, cfg, tokens)

    def check_wrong_rewrite(
        self, wrong: str, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None = None
    ) -> Comparison:
        """The same comparison for one of the wrong rewrites; it is expected to fail."""
        return self._check(self.wrong_rewrites[wrong].function, state_dict, cfg, tokens)

    def _check(self, transform, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None) -> Comparison:
        before, before_cfg = self.prepared(state_dict, cfg)
        if self.compare is not None:
            return self.compare(before, before_cfg, tokens, transform)
        after, after_cfg = transform(before, before_cfg)
        return compare_log_probs(before, before_cfg, after, after_cfg, tokens)


_REGISTRY: dict[str, Identity] = {}


def register(identity: Identity) -> Identity:
    """Add ``identity`` to the registry; a second identity of the same name is an error."""
    if identity.name in _REGISTRY or identity.name in FORMER_NAMES:
        raise ValueError(f"identity {identity.name!r} is registered twice")
    _REGISTRY[identity.name] = identity
    return identity


def registered() -> dict[str, Identity]:
    """The identities registered so far, by name (a copy; :func:`circuitmath.identities` imports
    every family first)."""
    return dict(_REGISTRY)
