"""One verdict per case whatever the form (in memory, files, folders) and dtype: exact known
processings and exact rewrites no identity names pass; a 1 % change of one row and wrong
rewrites fail (the cases: tests/verdict_corpus.py)."""

import pytest
import torch

from circuitmath import io
from verdict_corpus import FORMS, cases, hf_gpt2, verdict


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_case_gets_one_verdict_in_every_form(tmp_path, dtype):
    folder = hf_gpt2(tmp_path / "hf", dtype)
    before, cfg = io.load_hf_directory(folder)
    wrong = {}
    for i, (case, (after, after_cfg, valid)) in enumerate(cases(before, cfg).items()):
        for form in FORMS:
            passed = verdict(form, folder, before, cfg, after, after_cfg, tmp_path / f"{i}-{form}")
            if passed != valid:
                wrong[case, form] = passed
    assert not wrong, f"{dtype}: verdicts that are not the case's (True: passed): {wrong}"
