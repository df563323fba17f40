"""The one list of identities: :class:`Identity` and :func:`register`.

Each family module of :mod:`circuitmath._identities` registers its identities on import;
:func:`circuitmath._identities.identities` imports every family and lists them (the CLI, the
diagnosis, the tests and the book iterate that list). This module imports nothing above the
comparison of log-probs (:mod:`circuitmath._compare`), so nothing it imports comes back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ._config import Config
from ._proof import Proof, ProofReport
from ._state import StateDict
from ._compare import Comparison, compare_log_probs

__all__ = ["Identity", "register", "registered"]

Transform = Callable[[StateDict, Config], tuple[dict, Config]]
#: ``compare(state_dict, cfg, tokens, computation) -> Comparison``: the numeric check of an identity
#: whose ``transform`` is a computation it licenses rather than a weight rewrite.
Compare = Callable[[StateDict, Config, "torch.Tensor | None", Callable], Comparison]


@dataclass(frozen=True, eq=False)
class Identity:
    """One identity, seen three ways: a proof, a numeric check, and the transform it licenses.

    ``summary`` is the statement in one plain line; the LaTeX statement comes from the proof.
    ``prepare`` brings a model into the form the transform needs (e.g. folds the LayerNorm
    before reading weights are centred); the numeric check compares the prepared model with its
    transform, so it tests this identity alone. ``corruptions`` are wrong transforms (the
    numeric twins) that the same check must reject.

    ``compare`` is for identities that license a computation rather than a weight rewrite (the
    logits as a sum of path terms, composition scores from factors): ``transform`` and each
    corruption are then that computation, ``(state_dict, cfg, tokens) -> result``, and
    ``compare(state_dict, cfg, tokens, computation)`` measures its result against the reference
    (the forward pass, or the same quantity computed naively) as a
    :class:`~circuitmath.testing.Comparison`.
    """

    name: str
    title: str
    summary: str
    preconditions: tuple[str, ...]
    build_proof: Callable[[], Proof] = field(repr=False)
    transform: Transform = field(repr=False)
    corruptions: Mapping[str, Transform] = field(repr=False)
    prepare: Transform | None = field(default=None, repr=False)
    compare: Compare | None = field(default=None, repr=False)

    @cached_property
    def proof(self) -> Proof:
        return self.build_proof()

    @property
    def statement_latex(self) -> str:
        return self.proof.statement_latex()

    def prove(self) -> ProofReport:
        return self.proof.verify(self.name)

    def _prepared(self, state_dict: StateDict, cfg: Config) -> tuple[StateDict, Config]:
        return self.prepare(state_dict, cfg) if self.prepare else (state_dict, cfg)

    def check(self, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None = None) -> Comparison:
        """Apply the transform and compare log-probs with the model it started from (or run ``compare``)."""
        return self._check(self.transform, state_dict, cfg, tokens)

    def check_corruption(
        self, corruption: str, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None = None
    ) -> Comparison:
        """The same comparison for one of the wrong transforms; it is expected to fail."""
        return self._check(self.corruptions[corruption], state_dict, cfg, tokens)

    def _check(self, transform, state_dict: StateDict, cfg: Config, tokens: torch.Tensor | None) -> Comparison:
        before, before_cfg = self._prepared(state_dict, cfg)
        if self.compare is not None:
            return self.compare(before, before_cfg, tokens, transform)
        after, after_cfg = transform(before, before_cfg)
        return compare_log_probs(before, before_cfg, after, after_cfg, tokens)


_REGISTRY: dict[str, Identity] = {}


def register(identity: Identity) -> Identity:
    """Add ``identity`` to the registry; a second identity of the same name is an error."""
    if identity.name in _REGISTRY:
        raise ValueError(f"identity {identity.name!r} is registered twice")
    _REGISTRY[identity.name] = identity
    return identity


def registered() -> dict[str, Identity]:
    """The identities registered so far, by name (a copy; :func:`circuitmath.identities` imports
    every family first)."""
    return dict(_REGISTRY)
