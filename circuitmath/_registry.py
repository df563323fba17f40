"""The one list of identities: :class:`Identity` and :func:`register`.

Each family module of :mod:`circuitmath._identities` registers its identities on import;
:func:`circuitmath._identities.identities` imports every family and lists them (the CLI, the
diagnosis, the tests and the book iterate that list). This module imports nothing above the
comparison of log-probs (:mod:`circuitmath._compare`), so nothing it imports comes back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch

from ._config import FORMER_NAMES, Config
from ._proof import Proof, ProofReport
from ._state import StateDict
from ._compare import Comparison, compare_log_probs

__all__ = ["Identity", "WrongRewrite", "register", "registered"]

Transform = Callable[[StateDict, Config], tuple[dict, Config]]
#: ``compare(state_dict, cfg, tokens, computation) -> Comparison``: the numeric check of an identity
#: whose ``transform`` is a computation it licenses rather than a weight rewrite.
Compare = Callable[[StateDict, Config, "torch.Tensor | None", Callable], Comparison]


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


@dataclass(frozen=True, eq=False)
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
    tests and the book iterate them. ``function`` is the public name of the transform
    (``circuitmath.<function>``; the checker is ``circuitmath.testing.check_<function>``) and
    ``check_note`` adds to that checker's documentation.

    ``compare`` is for identities that license a computation rather than a weight rewrite (the
    logits as a sum of path terms, composition scores from factors): ``transform`` and each
    wrong rewrite are then that computation, ``(state_dict, cfg, tokens) -> result``, and
    ``compare(state_dict, cfg, tokens, computation)`` measures its result against the reference
    (the forward pass, or the same quantity computed naively) as a
    :class:`~circuitmath.testing.Comparison`.

    ``aliases`` are the identity's former names: :func:`circuitmath.get_identity` still finds
    it by them (with a :class:`DeprecationWarning`) and a :class:`~circuitmath.Config` whose
    ``applied`` records one reads it as ``name``. ``corruptions=`` (the former name of
    ``wrong_rewrites``) is still accepted when constructing.

    ``recover(before, after, cfg)``: for an identity with a free parameter (per-channel scales),
    the parameter that maps ``before`` onto ``after``, or ``None``; ``with_parameters(state_dict,
    cfg, parameter)`` applies the identity with it (its public transform), and each wrong rewrite
    takes it as an optional third argument. The diagnosis recovers the parameter instead of
    replaying ``transform``, whose parameter is fixed for the numeric checks.
    """

    name: str
    title: str
    summary: str
    preconditions: tuple[str, ...]
    build_proof: Callable[[], Proof] = field(repr=False)
    transform: Transform = field(repr=False)
    wrong_rewrites: Mapping[str, WrongRewrite | Transform] = field(default_factory=dict, repr=False)
    prepare: Transform | None = field(default=None, repr=False)
    compare: Compare | None = field(default=None, repr=False)
    function: str | None = None
    check_note: str | None = field(default=None, repr=False)
    check_requires: tuple = ()
    aliases: tuple[str, ...] = ()
    recover: Callable[[StateDict, StateDict, Config], object] | None = field(default=None, repr=False)
    with_parameters: Callable[..., tuple[dict, Config]] | None = field(default=None, repr=False)
    corruptions: InitVar[Mapping[str, Transform] | None] = None  # deprecated: wrong_rewrites

    def __post_init__(self, corruptions) -> None:
        if self.function is None and self.compare is None:
            # a public transform (made by ``rewrite``) names itself; a partial or a private route does not
            object.__setattr__(self, "function", getattr(self.transform, "public_name", None))
        merged = {**(corruptions or {}), **self.wrong_rewrites}
        object.__setattr__(self, "wrong_rewrites", MappingProxyType({
            name: wrong if isinstance(wrong, WrongRewrite) else WrongRewrite(wrong) for name, wrong in merged.items()
        }))

    @cached_property
    def proof(self) -> Proof:
        return self.build_proof()

    @property
    def statement_latex(self) -> str:
        return self.proof.statement_latex()

    def prove(self) -> ProofReport:
        return self.proof.verify(self.name)

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

    #: Deprecated name of :meth:`check_wrong_rewrite`.
    check_corruption = check_wrong_rewrite

    def _check(self, transform, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None) -> Comparison:
        before, before_cfg = self.prepared(state_dict, cfg)
        if self.compare is not None:
            return self.compare(before, before_cfg, tokens, transform)
        after, after_cfg = transform(before, before_cfg)
        return compare_log_probs(before, before_cfg, after, after_cfg, tokens)


def _wrong_everywhere(self: Identity) -> dict[str, WrongRewrite]:
    """The wrong rewrites that differ on every model the identity applies to (no ``differs_on``,
    not ``regardless``): those a numeric check must reject on any model."""
    return {
        name: wrong for name, wrong in self.wrong_rewrites.items()
        if wrong.differs_on is None and not wrong.regardless
    }


def _corruptions(self: Identity) -> dict[str, Transform]:
    """Deprecated name: :attr:`Identity.wrong_everywhere`, as plain transforms."""
    return {name: wrong.function for name, wrong in _wrong_everywhere(self).items()}


Identity.wrong_everywhere = property(_wrong_everywhere)
Identity.corruptions = property(_corruptions)  # after the dataclass took ``corruptions=`` as its init argument

_REGISTRY: dict[str, Identity] = {}


def register(identity: Identity) -> Identity:
    """Add ``identity`` to the registry; a second identity of the same name is an error."""
    for name in (identity.name, *identity.aliases):
        if name in _REGISTRY or name in FORMER_NAMES:
            raise ValueError(f"identity {name!r} is registered twice")
    _REGISTRY[identity.name] = identity
    FORMER_NAMES.update(dict.fromkeys(identity.aliases, identity.name))
    return identity


def registered() -> dict[str, Identity]:
    """The identities registered so far, by name (a copy; :func:`circuitmath.identities` imports
    every family first)."""
    return dict(_REGISTRY)
