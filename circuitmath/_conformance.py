"""Conformance: another project's weight processing, run on every architecture family and judged.

:func:`circuitmath.testing.conformance` (:func:`run_conformance` here, given the checker)
takes a processing function, hands it a realistic random model of every family in
:data:`circuitmath.io.FAMILIES` (float32 and bfloat16 by default) and judges each result with
:func:`circuitmath.testing.assert_equivalent` against the model it was given: the
same log-probs, and every tensor either the exact rewrite of a registered identity or a change
that moves the log-probs by no more than its own rounding. The answer is a
:class:`ConformanceTable`, family by dtype, with each failure's
:class:`~circuitmath.testing.Diagnosis` (which identity, which tensor, by how much).

The models are built by ``transformers`` from each family's tiny ``config.json`` and given
:func:`~circuitmath.random_state_dict`'s weights (:func:`family_model`): norm gains far from 1,
some negative, biases of unit scale, residual dimensions ten times larger than the rest, and
logits beyond the softcap where the family has one, so that a feature a processing ignores
changes the function.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ._config import Config
from ._errors import ArgumentTypeError, CircuitMathError, UnknownNameError
from ._families import FAMILIES, Family

__all__ = ["ConformanceTable", "Verdict", "family_model", "run_conformance"]

#: The forms a processing function may take: a circuitmath state dict and its Config in, the
#: same out (a bare state dict keeps the config); or a model object in, a model object out.
FORMS = ("state_dict", "model")


def family_model(fam: Family | str, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(model, config)``: a ``transformers`` model of family ``fam`` (eager attention, in
    ``dtype``) whose weights are :func:`~circuitmath.random_state_dict`'s for the family's
    :class:`~circuitmath.Config`, written through the family's converter (each circuitmath
    tensor is a view of the stored one). Tensors stored once hold one value: a tied unembedding
    is the embedding, the norm both parallel branches read is one norm, a bias the architecture
    lacks is absent. Reading the model back with :func:`circuitmath.io.from_hf` gives what the
    model computes with."""
    import transformers

    from ._hf import hf_layout
    from ._weights import random_state_dict

    fam = _families(fam)[0]
    config = transformers.AutoConfig.for_model(**fam.hf_config)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    layout = hf_layout(config)
    weights = random_state_dict(layout.cfg, seed=seed, dtype=torch.float64)
    stored = model.state_dict(keep_vars=True)
    src = layout.source({name: tensor.data for name, tensor in stored.items()})
    with torch.no_grad():
        parts = [layout.embed(src), *(layout.block(src, layer) for layer in range(layout.cfg.n_layers)),
                 layout.final(src)]
        for part in parts:
            for name, view in part.items():
                view.copy_(weights[name])  # a tensor the converter makes up is a copy, and stays unread
    return model, config


@dataclass(frozen=True)
class Verdict:
    """One family in one dtype: whether the processing kept the model's function
    (``passed``), the largest |Δ log-prob| and its tolerance, and on failure the
    :class:`~circuitmath.testing.Diagnosis`; ``None`` when there is none to give, ``error``
    says why: the processing raised (``stage="process"``), or circuitmath cannot read its result
    as the family's model (``stage="read"``: a tensor missing or of the wrong shape)."""

    family: str
    dtype: str
    passed: bool
    max_abs_error: float | None = None
    tolerance: float | None = None
    diagnosis: object = None
    error: str | None = None
    stage: str | None = None

    @property
    def summary(self) -> str:
        """One cell of the table: ``pass``, or ``FAIL`` with what went wrong first."""
        if self.passed:
            return "pass"
        if self.error is not None:
            kind = self.error.split(":")[0]
            return f"FAIL: raised {kind}" if self.stage == "process" else f"FAIL: not read ({kind})"
        culprits = self.diagnosis.culprits() if self.diagnosis is not None else ()
        where = f" ({', '.join(p.name for p in culprits[:2])}{', ...' if len(culprits) > 2 else ''})" if culprits else ""
        return f"FAIL{where}"


@dataclass(frozen=True)
class ConformanceTable:
    """The verdicts of :func:`conformance`, family by dtype; iterating gives each
    :class:`Verdict`. ``str()`` and :meth:`markdown` give the table and, below it, each
    failure's diagnosis."""

    verdicts: tuple[Verdict, ...]

    def __iter__(self) -> Iterator[Verdict]:
        return iter(self.verdicts)

    @property
    def ok(self) -> bool:
        return all(v.passed for v in self.verdicts)

    def failures(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if not v.passed)

    def verdict(self, family: str, dtype: torch.dtype | str) -> Verdict:
        """The verdict of ``family`` in ``dtype`` (``KeyError`` naming the cells otherwise)."""
        name = _dtype_name(dtype)
        for v in self.verdicts:
            if v.family == family and v.dtype == name:
                return v
        raise KeyError(f"no verdict for {family!r} in {name}; the table has {[(v.family, v.dtype) for v in self]}")

    def markdown(self) -> str:
        """The table in Markdown: a row per family, a column per dtype."""
        dtypes = list(dict.fromkeys(v.dtype for v in self.verdicts))
        families = list(dict.fromkeys(v.family for v in self.verdicts))
        cells = {(v.family, v.dtype): v.summary for v in self.verdicts}
        rows = ["| family | " + " | ".join(dtypes) + " |", "|---" * (len(dtypes) + 1) + "|"]
        rows += [f"| {f} | " + " | ".join(cells.get((f, d), "") for d in dtypes) + " |" for f in families]
        return "\n".join(rows)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        passed = sum(v.passed for v in self.verdicts)
        text = [self.markdown(), "", f"{passed} of {len(self.verdicts)} passed"]
        for v in self.failures():
            why = {"process": "raised", "read": "its result is not read:"}.get(v.stage, "")
            text += ["", f"{v.family}, {v.dtype}:", str(v.diagnosis) if v.diagnosis is not None else f"{why} {v.error}"]
        return "\n".join(text)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _form(process: Callable, form: str | None) -> str:
    """The form ``process`` takes: ``form`` when given, else read from its signature (two
    required positional parameters: a state dict and a Config; one: a model)."""
    if form is not None:
        if form not in FORMS:
            raise ArgumentTypeError(f"form must be one of {FORMS}, got {form!r}")
        return form
    try:
        parameters = inspect.signature(process).parameters.values()
    except (TypeError, ValueError):
        parameters = None
    if parameters is not None:
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if len(required) in (1, 2):
            return "model" if len(required) == 1 else "state_dict"
    raise ArgumentTypeError(
        f"cannot tell from its signature whether {getattr(process, '__name__', process)!r} takes a state dict and"
        " a Config or a model: pass form='state_dict' or form='model'")


def _families(families) -> tuple[Family, ...]:
    """The families asked for (names or :class:`Family` objects; ``None``: all of them)."""
    if families is None:
        return FAMILIES
    if isinstance(families, (str, Family)):
        families = [families]
    known = {f.name: f for f in FAMILIES}
    out = []
    for fam in families:
        if isinstance(fam, Family):
            out.append(fam)
        elif isinstance(fam, str) and fam in known:
            out.append(known[fam])
        else:
            raise UnknownNameError(f"families: no family {fam!r}; the families are {', '.join(known)}")
    return tuple(out)


def _dtypes(dtypes) -> tuple[torch.dtype, ...]:
    """The floating dtypes asked for, each a ``torch.dtype``."""
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    for dtype in dtypes:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ArgumentTypeError(f"dtypes: expected floating torch dtypes (torch.float32, torch.bfloat16), got {dtype!r}")
    return dtypes


def run_conformance(process: Callable, check: Callable, *, families, dtypes, form: str | None,
                    seed: int) -> ConformanceTable:
    """:func:`circuitmath.testing.conformance`, each result judged by ``check`` (its
    ``assert_equivalent``, which raises an ``AssertionError`` carrying ``comparison`` and
    ``diagnosis``)."""
    if not callable(process):
        raise ArgumentTypeError(f"process: expected a function, got a {type(process).__name__}")
    form, dtypes = _form(process, form), _dtypes(dtypes)
    verdicts = []
    for fam in _families(families):
        for dtype in dtypes:
            model, config = family_model(fam, dtype=dtype, seed=seed)
            verdicts.append(_judge(process, check, form, fam.name, model, config, dtype))
    return ConformanceTable(tuple(verdicts))


def _judge(process: Callable, check: Callable, form: str, name: str, model, config, dtype: torch.dtype) -> Verdict:
    """The verdict of ``process`` on ``model`` (one family in one dtype), judged by ``check``."""
    from ._hf import from_hf
    from ._models import is_model_object

    before, cfg = from_hf(model.state_dict(), config)
    before = {k: v.clone() for k, v in before.items()}  # the model's own tensors stay ours
    try:
        if form == "state_dict":
            given = {k: v.clone() for k, v in before.items()}
            result = process(given, cfg)
        else:
            result = process(copy.deepcopy(model))
    except Exception as error:  # the processing's own failure is its verdict
        return Verdict(name, _dtype_name(dtype), False, error=f"{type(error).__name__}: {error}", stage="process")
    if form == "state_dict":
        after, after_cfg = _state_dict_result(result, name, dtype)
    elif is_model_object(result):
        after, after_cfg = result, None
    else:
        raise CircuitMathError(
            f"the processing returned an object of type {type(result).__name__} for {name} in {_dtype_name(dtype)};"
            " the model form returns a model object (a transformers model, a TransformerLens bridge, an nn.Module)")
    try:
        comparison = check(before, after, cfg, after_cfg=after_cfg)
    except CircuitMathError as unread:  # a tensor missing or misshapen: no model to compare
        return Verdict(name, _dtype_name(dtype), False, error=f"{type(unread).__name__}: {unread}", stage="read")
    except AssertionError as failure:
        comparison = failure.comparison
        return Verdict(name, _dtype_name(dtype), False, comparison.max_abs_error, comparison.tolerance,
                       diagnosis=failure.diagnosis)
    return Verdict(name, _dtype_name(dtype), True, comparison.max_abs_error, comparison.tolerance)


def _state_dict_result(result, name: str, dtype: torch.dtype) -> tuple[Mapping, Config | None]:
    """``(state_dict, config)`` of what a state-dict processing returned, or the error naming it."""
    if isinstance(result, Mapping):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping) and isinstance(result[1], Config):
        return result
    what = f"an object of type {type(result).__name__}"
    if isinstance(result, tuple):
        what = f"a tuple of ({', '.join(type(item).__name__ for item in result)})"
    raise CircuitMathError(
        f"the processing returned {what} for {name} in {_dtype_name(dtype)}; the state dict form returns"
        " (state_dict, Config) or a state dict")
