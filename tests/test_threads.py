"""The torch threads a check computes with: the idle cores, at most torch's setting, restored after."""

import pytest
import torch

from circuitmath import Config, fold_layer_norm, random_state_dict
from circuitmath import _diagnosis, _threads
from circuitmath._cli import main
from circuitmath.testing import assert_equivalent, check_fold_layer_norm, check_model, diagnose


@pytest.mark.parametrize("ceiling, cores, others, expected", [
    (16, 16, 0, 16),  # a quiet machine: torch's own choice
    (16, 16, 2, 14),  # two busy processes leave fourteen cores
    (2, 2, 2, 1),  # every core busy: one thread, never none
    (2, 2, 7.5, 1),
    (4, 16, 0, 4),  # never more than the caller's setting
    (8, 16, 9.6, 6),
])
def test_idle_threads(ceiling, cores, others, expected):
    assert _threads.idle_threads(ceiling, cores=cores, others=others) == expected


def test_others_running_reads_the_runnable_tasks_less_this_one(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("5.10 2.20 0.87 3/124 9785\n")
    assert _threads._others_running(str(loadavg)) == 2
    loadavg.write_text("0.10 0.20 0.87 1/124 9785\n")
    assert _threads._others_running(str(loadavg)) == 0


@pytest.fixture
def two_threads_busy_machine(monkeypatch):
    """torch set to two threads by the caller, every core taken by other processes."""
    monkeypatch.setattr(_threads, "_usable_cores", lambda: 2)
    monkeypatch.setattr(_threads, "_others_running", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    resolve_pair = _diagnosis.resolve_pair
    monkeypatch.setattr(_diagnosis, "resolve_pair", lambda *a: seen.append(torch.get_num_threads()) or resolve_pair(*a))
    resolve = _diagnosis.resolve
    monkeypatch.setattr(_diagnosis, "resolve", lambda *a, **k: seen.append(torch.get_num_threads()) or resolve(*a, **k))
    yield seen
    torch.set_num_threads(before)


def _models():
    cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    before = random_state_dict(cfg, seed=0, dtype=torch.float64)
    after, after_cfg = fold_layer_norm(before, cfg)
    return before, after, cfg, after_cfg


@pytest.mark.parametrize("check", [
    lambda b, a, c, ac: assert_equivalent(b, a, c, after_cfg=ac),
    lambda b, a, c, ac: diagnose(b, a, c, after_cfg=ac),
    lambda b, a, c, ac: check_fold_layer_norm(b, a, c, after_cfg=ac),
    lambda b, a, c, ac: check_model(b, c),
])
def test_checks_compute_with_the_idle_cores_and_restore_the_callers_setting(two_threads_busy_machine, check):
    check(*_models())
    assert two_threads_busy_machine and set(two_threads_busy_machine) == {1}
    assert torch.get_num_threads() == 2


def test_the_callers_setting_is_restored_when_a_check_fails(two_threads_busy_machine):
    before, after, cfg, after_cfg = _models()
    after = dict(after, **{"unembed.W_U": after["unembed.W_U"] * 1.5})
    with pytest.raises(AssertionError):
        assert_equivalent(before, after, cfg, after_cfg=after_cfg)
    assert torch.get_num_threads() == 2


def test_a_quiet_machine_keeps_the_callers_threads(monkeypatch):
    """Negative control: with idle cores the check keeps torch's setting."""
    monkeypatch.setattr(_threads, "_usable_cores", lambda: 2)
    monkeypatch.setattr(_threads, "_others_running", lambda: 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _threads.check_threads() as chosen:
            assert chosen == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_cli_computes_with_the_idle_cores(two_threads_busy_machine, tmp_path, capsys):
    from circuitmath import io

    before, _, cfg, _ = _models()
    io.save(tmp_path / "m.safetensors", before, cfg)
    assert main(["check", str(tmp_path / "m.safetensors"), "--batch", "1", "--seq-len", "3"]) == 0
    assert two_threads_busy_machine and set(two_threads_busy_machine) == {1}
    assert torch.get_num_threads() == 2
