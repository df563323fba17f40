"""Circuits of a transformer: the quantities of "A Mathematical Framework for Transformer Circuits".

Conventions. Everything here is in TransformerLens's row convention: a residual stream is a
tensor ``x: [..., pos, d_model]`` read by ``x @ W``. The framework writes columns, ``W x``; the
two are transposes of each other, and the identity ``row_column_convention`` proves the
translation once:

- ``W_OV = W_V @ W_O`` here (``[d_model, d_model]``) is the transpose of the paper's
  ``W_O W_V``; a head's output is ``A @ x @ W_OV``, the paper's ``(A ⊗ W_O W_V)·x``;
- ``W_QK = W_Q @ W_K.T`` here is the paper's ``W_Q^T W_K`` (a bilinear form: scores
  ``x_i W_QK x_j^T``, before the ``1/sqrt(d_head)`` scale and the biases);
- the bigram table ``W_E @ W_U`` (``[d_vocab, d_vocab]``) is the transpose of the paper's
  ``W_U W_E``.

Circuits are read off the weights as they are. Fold the LayerNorm first
(:func:`circuitmath.fold_layer_norm`) to include its gains; biases are not part of a circuit.
Grouped-query keys and values are repeated to one per query head.

The path expansion (:func:`path_terms`) is exact once the attention patterns and the norms'
scales are fixed at the values a forward pass computed: every other operation is linear.
"""

from ._bases import change_head_bases as change_head_bases
from ._factored import FactoredMatrix as FactoredMatrix
from ._heads import (
    bigram_table as bigram_table,
    full_ov_circuits as full_ov_circuits,
    ov_circuits as ov_circuits,
    qk_circuits as qk_circuits,
    virtual_weights as virtual_weights,
)
from ._notation import TensorProduct as TensorProduct, vec as vec
from ._paths import (
    POSITIONS as POSITIONS,
    SCORE_TERMS as SCORE_TERMS,
    Path as Path,
    attention_patterns as attention_patterns,
    path_terms as path_terms,
    score_terms as score_terms,
    _softmax_scores,  # noqa: F401  (the former private name of pattern_from_scores)
)
from ._scores import (
    KINDS as KINDS,
    composition_scores as composition_scores,
    copying_circuits as copying_circuits,
    copying_scores as copying_scores,
)
from .._reference import pattern_from_scores as pattern_from_scores

__all__ = [
    "TensorProduct",
    "vec",
    "FactoredMatrix",
    "change_head_bases",
    "ov_circuits",
    "qk_circuits",
    "full_ov_circuits",
    "bigram_table",
    "attention_patterns",
    "pattern_from_scores",
    "Path",
    "path_terms",
    "score_terms",
    "virtual_weights",
    "composition_scores",
    "copying_scores",
    "copying_circuits",
]
