"""What a wrong rewrite does, learnt where it is cheap: on the model cut to its first layer.

The search for wrong rewrites needs two facts about each before it runs it on a whole model:
which identities it records (a wrong pipeline is no wrong version of one of its steps) and which
tensors it rewrites (a stage is searched where one of its rewrites touches a tensor the exact
replay left unexplained, even one its exact rewrite leaves alone: ``W_pos`` scaled with ``W_E``).
Both are the rewrite's code's, not its numbers': they are learnt once per rewrite and config on
:func:`cut_model`, its first layer's tensors standing for every layer's (:func:`layer_pattern`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from .._config import Config
from .._state import marked_as

__all__ = ["Lesson", "Lessons", "cut_model", "layer_pattern"]


def layer_pattern(name: str) -> str:
    """``name`` with its layer index replaced by ``*`` (``blocks.3.attn.W_Q`` -> ``blocks.*.attn.W_Q``)."""
    return re.sub(r"^blocks\.\d+\.", "blocks.*.", name)


@dataclass(frozen=True)
class Lesson:
    """What a rewrite did on a model: the identities it recorded beyond the model's ``applied``
    and the :func:`layer_pattern` of each tensor it added, dropped or replaced."""

    records: tuple[str, ...]
    touches: frozenset[str]

    def touches_any(self, names: Iterable[str]) -> bool:
        """Whether the rewrite touches one of ``names`` (in any layer)."""
        return any(layer_pattern(name) in self.touches for name in names)


def lesson(state: Mapping, cfg: Config, result: Mapping, result_cfg: Config) -> Lesson:
    """The :class:`Lesson` of a rewrite of ``(state, cfg)`` into ``(result, result_cfg)``. A
    tensor it leaves alone is ``state``'s own object (transforms share what they do not rewrite)."""
    touched = {name for name in set(state) | set(result) if state.get(name) is not result.get(name)}
    return Lesson(result_cfg.applied[len(cfg.applied):], frozenset(map(layer_pattern, touched)))


class Lessons:
    """The lessons of the rewrites tried in one diagnosis, by ``(rewrite, cfg)``: ``None`` where
    the rewrite did not fit the model."""

    def __init__(self):
        self._known: dict = {}
        self._cut: tuple = (None, None, (None, None))  # the last model cut: (state, cfg, cut_model(state, cfg))

    def known(self, rewrite: str, cfg: Config) -> Lesson | None:
        """What ``rewrite`` did on a model of ``cfg`` as run so far (``None``: not run, or it failed)."""
        return self._known.get((rewrite, cfg))

    def note(self, rewrite: str, state: Mapping, cfg: Config, result) -> None:
        """Keep what ``rewrite`` did to ``state`` (``result``: ``(state, cfg)``; ``None`` where it
        failed: then it records and touches nothing)."""
        self._known[(rewrite, cfg)] = Lesson((), frozenset()) if result is None else lesson(state, cfg, *result)

    def learn(self, rewrite: str, function: Callable, state: Mapping, cfg: Config) -> Lesson | None:
        """What ``rewrite`` (``function(state, cfg)``) does to ``state``: learnt on the model cut
        to one layer where that is smaller, once per ``(rewrite, cfg)``; ``None`` where it does
        not fit the cut model (or the model itself, where nothing is cut)."""
        key = (rewrite, cfg)
        if key not in self._known:
            if self._cut[0] is not state or self._cut[1] != cfg:
                self._cut = (state, cfg, cut_model(state, cfg))
            small, small_cfg = self._cut[2]
            small, small_cfg = (state, cfg) if small is None else (small, small_cfg)
            try:
                result = function(small, small_cfg)
            except Exception:  # noqa: BLE001 - a wrong rewrite may not fit this model at all
                result = None
            self._known[key] = None if result is None else lesson(small, small_cfg, *result)
        return self._known[key]


def cut_model(state: Mapping[str, torch.Tensor], cfg: Config, tokens: int = 16) -> tuple[dict | None, Config]:
    """``state`` cut to its first layer and its first ``tokens`` tokens (``W_E``'s rows, ``W_U``'s
    columns, ``b_U``'s entries), its values kept: where a wrong rewrite is cheap to run, to learn
    what it does (``(None, cfg)`` when there is nothing to cut or ``cfg`` does not allow it)."""
    if cfg.n_layers < 2 and cfg.d_vocab <= tokens:
        return None, cfg
    try:
        small_cfg = cfg.replace(n_layers=1, d_vocab=min(tokens, cfg.d_vocab))
    except Exception:  # noqa: BLE001 - a config that cannot be cut: nothing is learnt from it
        return None, cfg
    cut = {"embed.W_E": lambda t: t[:tokens], "unembed.W_U": lambda t: t[..., :tokens],
           "unembed.b_U": lambda t: t[:tokens]}
    return marked_as(state, {name: cut.get(name, lambda t: t)(tensor) for name, tensor in state.items()
                             if not name.startswith("blocks.") or name.startswith("blocks.0.")}, small_cfg), small_cfg
