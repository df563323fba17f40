"""The whole weight-processing pipeline, proved as one rewrite of an attention layer.

Symbols (row-vector convention, all ``n`` positions of a pre-LayerNorm attention layer at once;
``d`` = d_model, ``e`` = d_head):

- ``X`` ``[n, d]`` the residual stream, ``C = I - 1 1^T / d`` the centering matrix, ``R``
  ``[n, n]`` the per-position normalisers (any matrix: nothing below depends on it, so ``eps``
  is kept), ``N = R X C`` the LayerNorm's ``LNPre`` and ``LN = N diag(w) + 1_n b`` with gain
  ``w`` ``[d, 1]`` and bias ``b`` ``[1, d]``;
- two heads ``h = 1, 2`` with patterns ``A_h`` ``[n, n]`` (rows sum to 1), value maps
  ``W_V,h`` ``[d, e]``, ``b_V,h`` ``[1, e]`` and output maps ``W_O,h`` ``[e, d]``; the layer's
  output bias ``b_O`` ``[1, d]``. Two heads show the sum over heads; each further head adds one
  more term of the same form.

The claim: after the pipeline (fold the LayerNorm and center its readers, fold the value biases,
center the writers), the layer writes ``out C``, where ``out`` is what it wrote before. Every
reader of the stream sees it through ``LNPre``, which depends on its input only through
``(.) C`` (proved by ``center_writing_weights``), so the model is unchanged. The queries and keys
and the MLP's input are readers like ``W_V`` (``fold_layer_norm``, ``center_reading_weights``);
the MLP's output and the embeddings are writers like ``W_O`` (``center_writing_weights``); the
unembed is centered by ``center_unembed``. ``refactor_factored_attn_matrices`` runs last, on the
result, and is proved on its own.
"""

from __future__ import annotations

import torch
from sympy import DiagMatrix, Identity as Eye, Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol

from .._processing import center_reading_weights, fold_value_biases, process_weights, readers
from .._processing.steps import PIPELINE_STEPS, leaving_out
from .._proof import Definition, Fact, Proof, Step, Twin
from .._registry import COMPOSES, Identity, WrongRewrite, register
from .._state import marked_as
from .attention_biases import causal_exponentials

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "transformer_lens"

n, d, e = (Symbol(s, positive=True, integer=True) for s in ("n", "d", "e"))
ones_n, ones_d = OneMatrix(n, 1), OneMatrix(d, 1)
X, R = MatrixSymbol("X", n, d), MatrixSymbol("R", n, n)
C = MatrixSymbol("C", d, d)
N = MatrixSymbol(r"\mathrm{LNPre}(X)", n, d)
LN = MatrixSymbol(r"\mathrm{LN}(X)", n, d)
M = MatrixSymbol(r"\mathrm{RMSPre}(X)", n, d)
w, b = MatrixSymbol("w", d, 1), MatrixSymbol("b", 1, d)
A = {h: MatrixSymbol(f"A_{h}", n, n) for h in (1, 2)}
E = {h: MatrixSymbol(f"E_{h}", n, n) for h in (1, 2)}  # each head's exponentiated scores
W_V = {h: MatrixSymbol(f"W_{{V,{h}}}", d, e) for h in (1, 2)}
b_V = {h: MatrixSymbol(f"b_{{V,{h}}}", 1, e) for h in (1, 2)}
W_O = {h: MatrixSymbol(f"W_{{O,{h}}}", e, d) for h in (1, 2)}
b_O = MatrixSymbol("b_O", 1, d)
W_V_new = {h: MatrixSymbol(rf"\tilde{{W}}_{{V,{h}}}", d, e) for h in (1, 2)}
W_O_new = {h: MatrixSymbol(rf"\tilde{{W}}_{{O,{h}}}", e, d) for h in (1, 2)}
b_O_new = MatrixSymbol(r"\tilde{b}_O", 1, d)
HEADS = (1, 2)
ONE_HEAD = (1,)  # a twin is wrong already with one head; one keeps its residual short to print


def _folded_value_bias(h: int) -> MatAdd:
    """Head ``h``'s value bias after the LayerNorm fold: ``b_V,h + b W_V,h``."""
    return MatAdd(b_V[h], MatMul(b, W_V[h]))


def _layer(values, bias, heads=HEADS) -> MatAdd:
    """``sum_h A_h values(h) + 1_n bias``: an attention layer's output from each head's values times W_O."""
    return MatAdd(*(MatMul(A[h], values(h)) for h in heads), MatMul(ones_n, bias))


def _original(heads=HEADS) -> MatAdd:
    return _layer(lambda h: MatMul(MatAdd(MatMul(LN, W_V[h]), MatMul(ones_n, b_V[h])), W_O[h]), b_O, heads)


def _processed(reader, output_bias, heads=HEADS) -> MatAdd:
    """The layer with readers ``reader(h)`` (``[d, e]``), centered ``W_O`` and output bias ``output_bias``."""
    return _layer(lambda h: MatMul(N, reader(h), W_O_new[h]), output_bias, heads)


def _pipeline_steps(rhs, b_O_expanded) -> tuple[Step, ...]:
    """The derivation of :func:`_pipeline_proof`, from the processed layer to ``rhs``."""
    return (
        Step(
            _layer(lambda h: MatMul(N, C, DiagMatrix(w), W_V[h], W_O[h], C), b_O_new),
            r"the processed weights: $\tilde{W}_V = C \operatorname{diag}(w) W_V$ (gain folded, then centered"
            r" over $d$), $\tilde{W}_O = W_O C$ (centered)",
        ),
        Step(
            _layer(lambda h: MatMul(N, DiagMatrix(w), W_V[h], W_O[h], C), b_O_new),
            r"$\mathrm{LNPre}(X)\, C = R X C C = \mathrm{LNPre}(X)$: centering the reader changes nothing",
        ),
        Step(
            _layer(lambda h: MatMul(N, DiagMatrix(w), W_V[h], W_O[h], C), MatMul(b_O_expanded, C)),
            r"$\tilde{b}_O$: the LayerNorm bias folded into $b_V$, $b_V$ folded into $b_O$, then centered",
        ),
        Step(
            MatAdd(
                *(
                    term
                    for h in HEADS
                    for term in (
                        MatMul(A[h], N, DiagMatrix(w), W_V[h], W_O[h], C),
                        MatMul(A[h], ones_n, _folded_value_bias(h), W_O[h], C),
                    )
                ),
                MatMul(ones_n, b_O, C),
            ),
            r"$\mathbf{1}_n = A_h \mathbf{1}_n = \operatorname{diag}(E_h \mathbf{1}_n)^{-1} E_h \mathbf{1}_n$: every row of a softmax pattern sums to 1",
        ),
        Step(
            MatMul(
                _layer(
                    lambda h: MatMul(
                        MatAdd(MatMul(MatAdd(MatMul(N, DiagMatrix(w)), MatMul(ones_n, b)), W_V[h]),
                               MatMul(ones_n, b_V[h])),
                        W_O[h],
                    ),
                    b_O,
                ),
                C,
            ),
            r"collect $A_h (\ldots) W_{O,h}$ and the common factor $C$",
        ),
        Step(rhs, r"definition of $\mathrm{LN}$"),
    )


def _pipeline_facts(b_O_expanded) -> tuple[Fact, ...]:
    """The centering matrix, the norms, the processed weights and each head's softmax pattern."""
    return (
        Fact(C, MatAdd(Eye(d), MatMul(-1 / d, ones_d, ones_d.T)), "the centering matrix"),
        Fact(N, MatMul(R, X, C), "center each position, then normalise it (eps inside R)"),
        Fact(LN, MatAdd(MatMul(N, DiagMatrix(w)), MatMul(ones_n, b)), "LNPre, then gain and bias"),
        *(Fact(W_V_new[h], MatMul(C, DiagMatrix(w), W_V[h]), "gain folded, then centered over d")
          for h in HEADS),
        *(Fact(W_O_new[h], MatMul(W_O[h], C), "centered over d") for h in HEADS),
        Fact(b_O_new, MatMul(b_O_expanded, C),
             "b_O plus each folded value bias through its W_O, then centered"),
        *(Fact(A[h], MatMul(Inverse(DiagMatrix(MatMul(E[h], ones_n))), E[h]),
               f"head {h}'s pattern: the softmax of its scores, E_{h} their entrywise exponentials")
          for h in HEADS),
        *(Fact.invertible(DiagMatrix(MatMul(E[h], ones_n)), f"head {h}'s row sums are positive: every row has an unmasked key")
          for h in HEADS),
    )


def _pipeline_twins() -> tuple[Twin, ...]:
    """The wrong pipelines: steps in the wrong order, a step twice, centering behind RMSNorm."""
    one_head_bias = MatMul(MatAdd(b_O, MatMul(_folded_value_bias(1), W_O[1])), C)
    return (
        Twin(
            "center_readers_before_fold",
            PROCESS_WEIGHTS.describe("center_readers_before_fold"),
            _processed(lambda h: MatMul(DiagMatrix(w), C, W_V[h]), one_head_bias, ONE_HEAD),
            MatMul(_original(ONE_HEAD), C),
        ),
        Twin(
            "fold_gain_twice",
            PROCESS_WEIGHTS.describe("fold_gain_twice"),
            _processed(lambda h: MatMul(C, DiagMatrix(w), DiagMatrix(w), W_V[h]), one_head_bias, ONE_HEAD),
            MatMul(_original(ONE_HEAD), C),
        ),
        Twin(
            "value_biases_before_ln_fold",
            PROCESS_WEIGHTS.describe("value_biases_before_ln_fold"),
            _processed(lambda h: W_V_new[h], MatMul(MatAdd(b_O, MatMul(b_V[1], W_O[1])), C), ONE_HEAD),
            MatMul(_original(ONE_HEAD), C),
        ),
        Twin(
            "ln_bias_through_processed_reader",
            "fold the LayerNorm bias through the processed reader, b C diag(w) W_V, instead of b W_V",
            _processed(
                lambda h: W_V_new[h],
                MatMul(MatAdd(b_O, MatMul(MatAdd(b_V[1], MatMul(b, W_V_new[1])), W_O[1])), C),
                ONE_HEAD,
            ),
            MatMul(_original(ONE_HEAD), C),
        ),
        Twin(
            "center_readers_behind_rms_norm",
            PROCESS_WEIGHTS.describe("center_readers_behind_rms_norm"),
            _layer(lambda h: MatMul(M, C, DiagMatrix(w), W_V[h], W_O[h]), b_O, ONE_HEAD),
            _layer(lambda h: MatMul(M, DiagMatrix(w), W_V[h], W_O[h]), b_O, ONE_HEAD),
        ),
    )


def _pipeline_proof() -> Proof:
    lhs = _processed(lambda h: W_V_new[h], b_O_new)
    rhs = MatMul(_original(), C)
    b_O_expanded = MatAdd(b_O, *(MatMul(_folded_value_bias(h), W_O[h]) for h in HEADS))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=_pipeline_steps(rhs, b_O_expanded),
        facts=_pipeline_facts(b_O_expanded),
        definitions=(Definition(M, MatMul(R, X), "normalise each position, no centering"),),
        samplers={E[h]: causal_exponentials for h in HEADS},
        explicit_dims={n: 3, d: 3, e: 2},
        assumptions=(
            "R is any matrix: the per-position normalisers, eps included, never need a value",
            "the readers see the stream only through LNPre, which depends on it only through (.) C",
        ),
        twins=_pipeline_twins(),
    )


# -- wrong rewrites: wrong pipelines the numeric check must reject ----------------------------

#: Every step of :func:`~circuitmath.process_weights` asked for "if applicable".
EVERYTHING_APPLICABLE = dict.fromkeys(keyword for keyword, _step in PIPELINE_STEPS)


def process_everything(state_dict, cfg):
    """:func:`~circuitmath.process_weights` with every step applied where it applies."""
    return process_weights(state_dict, cfg, **EVERYTHING_APPLICABLE)


def process_everything_but(state_dict, cfg, left_out: frozenset[str]):
    """:func:`process_everything` with the steps of ``left_out`` left out: for a part of a model
    whose other parts do not apply them (the whole model leaves them out)."""
    return process_weights(state_dict, cfg, **leaving_out(EVERYTHING_APPLICABLE, left_out))


def _gains(state_dict, cfg) -> dict[str, torch.Tensor]:
    """Each reader's norm gain (``[d_model]``), for the models that have one."""
    if cfg.normalization_type not in ("LN", "RMS"):
        return {}
    return {weight: state_dict[f"{norm}.w"] for norm, pairs in readers(cfg) for weight, _bias in pairs}


def _center_readers_before_fold(state_dict, cfg):
    """Center every reader of the unfolded model over ``d_model``, then run the pipeline."""
    early = dict(state_dict)
    for weight in _gains(state_dict, cfg):
        early[weight] = state_dict[weight] - state_dict[weight].mean(dim=-2, keepdim=True)
    return process_everything(marked_as(state_dict, early), cfg)


def _fold_gain_twice(state_dict, cfg):
    out, out_cfg = process_everything(state_dict, cfg)
    for weight, gain in _gains(state_dict, cfg).items():
        if weight in out:
            out[weight] = out[weight] * gain[:, None]
    return out, out_cfg


def _value_biases_before_ln_fold(state_dict, cfg):
    """Fold the value biases of the unfolded model, then zero the ones the LayerNorm fold creates
    (the pipeline, told nothing of the early fold, leaves them; recorded as folded once)."""
    early, early_cfg = fold_value_biases(state_dict, cfg)
    out, out_cfg = process_weights(early, cfg, **(EVERYTHING_APPLICABLE | {fold_value_biases.identity: False}))
    for name in out:
        if name.endswith(("attn.b_V", "attn._b_V")):
            out[name] = torch.zeros_like(out[name])
    return out, out_cfg.replace(applied=early_cfg.applied + out_cfg.applied[len(cfg.applied):])


def _center_readers_behind_rms_norm(state_dict, cfg):
    out, out_cfg = process_everything(state_dict, cfg)
    if out_cfg.normalization_type != "RMSPre":
        return out, out_cfg
    centered, _ = center_reading_weights(out, out_cfg.replace(normalization_type="LNPre"))
    return centered, out_cfg


PROCESS_WEIGHTS = register(
    Identity(
        name=process_weights.identity,  # its transform runs every step, not the public keywords
        title="The whole pipeline: fold, center, fold value biases, center writers, center the unembed",
        summary="after folding the LayerNorm into its centered readers, folding the value biases and centering the"
        " writers, every layer writes out C instead of out; LNPre sees the stream only through (.) C",
        preconditions=(
            f"each step's own preconditions: {process_weights.identity} applies a step only where they hold, and refuses"
            " a step asked for with True where they do not",
            "the order: the LayerNorm fold before centering its readers and before folding value biases;"
            " refactoring W_QK and W_OV last",
        ),
        build_proof=_pipeline_proof,
        transform=process_everything,
        with_parameters=process_everything_but,
        wrong_rewrites={
            "center_readers_before_fold": WrongRewrite(
                _center_readers_before_fold,
                "center the readers first and fold the gain afterwards: diag(w) C W_V",
            ),
            "fold_gain_twice": WrongRewrite(
                _fold_gain_twice, "run the LayerNorm fold twice: the gain reaches each reader twice"),
            "value_biases_before_ln_fold": WrongRewrite(
                _value_biases_before_ln_fold,
                "fold the value biases read before the LayerNorm fold, so b W_V never reaches b_O",
            ),
            "center_readers_behind_rms_norm": WrongRewrite(
                _center_readers_behind_rms_norm,
                "center the readers of an RMSNorm model, whose output RMSPre(X) is not orthogonal to 1",
            ),
        },
        half_precision=COMPOSES,
    )
)
