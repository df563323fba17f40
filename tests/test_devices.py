"""No hidden host tensors: everything is computed on the inputs' device.

Without a GPU the suite still catches a tensor made on the default device (``torch.zeros(n)``
without ``device=``), a CPU generator or a host-only buffer: with the default device set to
``meta``, such a tensor lands on ``meta`` and mixing it with the CPU inputs raises. With a GPU,
the same transforms run on CUDA tensors and must return CUDA tensors.
"""

import pytest
import torch

import circuitmath as cm
from support import on_meta_by_default

CONFIGS = {
    "gpt2-like": cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16),
    "llama-like": cm.Config(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=11, n_ctx=5, d_mlp=16,
                            normalization_type="RMS", gated_mlp=True, n_key_value_heads=2,
                            positional_embedding_type="rotary", act_fn="silu"),
    "shortformer": cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5,
                             positional_embedding_type="shortformer"),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _everything(sd, cfg):
    """Every transform that applies to ``cfg``, and the forward pass, on ``sd``."""
    outputs = [cm.process_weights(sd, cfg, **dict.fromkeys(
        ["fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices"]))]
    for transform in (cm.fold_layer_norm, cm.fold_rms_norm, cm.center_writing_weights, cm.center_unembed,
                      cm.fold_value_biases, cm.remove_key_biases, cm.refactor_factored_attn_matrices,
                      cm.shortformer_to_tables, cm.layer_norm_to_rms_norm):
        try:
            outputs.append(transform(sd, cfg))
        except cm.PreconditionError:
            continue
    tokens = torch.tensor([[1, 4, 2, 7, 0]], device=next(iter(sd.values())).device)
    return outputs, cm.log_probs(sd, cfg, tokens)


def _checkers(sd, cfg):
    """The checkers on ``sd`` and its processing: a pass, a failure with its diagnosis (the
    failure path rebuilds states and draws rounding noise), one model's rows."""
    from circuitmath import testing

    processed, processed_cfg = cm.process_weights(sd, cfg)
    testing.assert_equivalent(sd, processed, cfg, after_cfg=processed_cfg)
    wrong = dict(processed, **{"unembed.W_U": processed["unembed.W_U"] * 2})
    with pytest.raises(testing.NotEquivalentError) as failed:
        testing.assert_equivalent(sd, wrong, cfg, after_cfg=processed_cfg)
    assert failed.value.diagnosis is not None
    testing.check_model(sd, cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_tensor_is_made_on_the_default_device(name):
    cfg = CONFIGS[name]
    outputs, logp = on_meta_by_default(_everything, cm.random_state_dict(cfg, seed=0, dtype=torch.float64), cfg)
    assert logp.device.type == "cpu"
    assert all(t.device.type == "cpu" for out, _ in outputs for t in out.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_checkers_make_no_tensor_on_the_default_device(name):
    cfg = CONFIGS[name]
    on_meta_by_default(_checkers, cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_checkers_run_on_the_inputs_device(name):
    cfg = CONFIGS[name]
    _checkers({k: v.to("cuda") for k, v in cm.random_state_dict(cfg, seed=0, dtype=torch.float32).items()}, cfg)


def test_the_default_device_trap_catches_a_hidden_host_tensor():
    """Negative control: a computation that makes a tensor without ``device=`` fails under the trap."""
    x = torch.ones(3)
    torch.set_default_device("meta")
    try:
        with pytest.raises((RuntimeError, NotImplementedError)):
            float((x + torch.zeros(3)).sum())
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_outputs_stay_on_the_inputs_device_and_dtype(name, device, dtype):
    cfg = CONFIGS[name]
    sd = {k: v.to(device) for k, v in cm.random_state_dict(cfg, seed=0, dtype=dtype).items()}
    outputs, logp = _everything(sd, cfg)
    assert logp.device.type == device
    for out, _ in outputs:
        assert all(t.device.type == device and t.dtype == dtype for t in out.values())


def test_the_strategies_draw_on_the_device_the_suite_names(monkeypatch):
    """``pytest --device X`` sets the variable the strategies read: their models land on X (here
    ``meta``, which any machine has), and an explicit ``device=`` overrides it."""
    from hypothesis import given, settings

    from circuitmath.strategies import DEVICE_VARIABLE, models

    monkeypatch.setenv(DEVICE_VARIABLE, "meta")

    @settings(max_examples=3, deadline=None)
    @given(models(max_layers=1), models(max_layers=1, device="cpu"))
    def draws(on_meta, on_cpu):
        assert {t.device.type for t in on_meta[1].values()} == {"meta"}
        assert {t.device.type for t in on_cpu[1].values()} == {"cpu"}

    draws()


_CIRCUIT_CONFIGS = {
    "attention-only": cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5),
    "with MLPs": cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16),
    "one layer": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5),
    "no layer": cm.Config(n_layers=0, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5),
    "rotary": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5,
                        positional_embedding_type="rotary"),
    "RMSNorm, shortformer": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5,
                                      normalization_type="RMS", positional_embedding_type="shortformer"),
    "RMSNorm": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, normalization_type="RMS"),
    "eps 0": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, eps=0.0),
    "no norm": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, normalization_type=None),
    "ReLU MLP": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16, act_fn="relu"),
    "scaled embeddings and logits": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5,
                                              d_mlp=16, embedding_scale=8**0.5, logit_scale=0.5),
    "mixture of experts": cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=6,
                                    act_fn="silu", normalization_type="RMS", gated_mlp=True, n_experts=4,
                                    experts_per_token=2),
}


@pytest.mark.parametrize("identity", list(cm.identities()), ids=lambda i: i.name)
def test_the_numeric_checks_make_no_tensor_on_the_default_device(identity):
    """Every registered identity's numeric check, on a model it applies to, under the trap: its
    references, random directions and bases are made on the model's device."""
    tokens = torch.tensor([[1, 4, 2, 7, 0]])
    ran = 0
    for cfg in _CIRCUIT_CONFIGS.values():
        sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
        try:
            result = on_meta_by_default(identity.check, sd, cfg, tokens)
        except cm.PreconditionError:
            continue
        assert result.passed, (identity.name, result)
        ran += 1
    assert ran, f"{identity.name} applies to none of the small configs: add one it applies to"
