"""Every architecture family of circuitmath._families, built offline by transformers from its tiny
config.json with random weights whose features bite (non-unit gains, biases, a sliding window
shorter than the sequence): the reference forward pass computes transformers' log-probs (float32
to float32 rounding, bfloat16 within transformers' own rounding), a folder processed by
circuitmath is one transformers loads as the same architecture with the input's log-probs, and
each identity either holds or refuses the family naming the feature that breaks it."""

import copy
import json

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import _reference as reference, io
from circuitmath.io import FAMILIES, family, identity_table
from circuitmath._stored import LAYOUT_KEY

NAMES = [f.name for f in FAMILIES]
POSITIONS = 12


def _model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """The family's transformers model (eager attention) with unit-scale random weights: gains
    ``exp(0.3 N)`` (Gemma's stored ``w`` of its ``1 + w``: ``exp(0.3 N) - 1``), biases ``0.5 N``,
    matrices ``N / sqrt(fan_in)``; ``overrides``: config.json fields changed."""
    config = transformers.AutoConfig.for_model(**family(name).hf_config | overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    # built in its dtype, as from_pretrained(dtype=...) does: the rotary frequencies stay float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            value = torch.randn(param.shape, generator=g, dtype=torch.float64)
            if param.ndim == 1:
                gain = param_name.endswith(("norm.weight", "ln_1.weight", "ln_f.weight"))
                value = torch.exp(0.3 * value) - float(name.startswith("Gemma")) if gain else 0.5 * value
            else:
                value = value * param.shape[-1] ** -0.5
            param.copy_(value.to(dtype))
    return model.eval(), config


def _tokens(vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, POSITIONS), generator=torch.Generator().manual_seed(seed))


def _hf_log_probs(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(tokens).logits.double(), dim=-1)


def _ours(sd, cfg, tokens, dtype=None) -> torch.Tensor:
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    with torch.no_grad():
        return cm.log_probs(sd, cfg, tokens).double()


@pytest.mark.parametrize("name", NAMES)
def test_reference_computes_transformers_log_probs(name):
    """float32: equal to float32 rounding (measured up to 3e-6 nats). bfloat16: the converted
    tensors are the checkpoint's dtype, the reference evaluated in float32 on them computes what
    transformers computes in float32 on them (transformers runs its norms and rotary tables in
    float32 even in a float64 model, so float32 is its exact arithmetic here), and both are as far
    from transformers' bfloat16 forward pass as its own bfloat16 rounding (measured 0.05-0.12 nats)."""
    tokens = _tokens()
    model, config = _model(name)
    sd, cfg = io.from_hf(model.state_dict(), config)
    assert (_ours(sd, cfg, tokens) - _hf_log_probs(model, tokens)).abs().max() < 1e-4

    model16, _ = _model(name, torch.bfloat16)
    sd16, cfg16 = io.from_hf(model16.state_dict(), config)
    assert cfg16 == cfg and {t.dtype for t in sd16.values()} == {torch.bfloat16}
    if cfg.embedding_scale is not None:  # transformers' bfloat16 model keeps the multiplier in bfloat16
        cfg = cfg.replace(embedding_scale=float(torch.tensor(cfg.embedding_scale).bfloat16()))
    hf16 = _hf_log_probs(model16, tokens)  # before .float() converts the model in place
    exact = _ours(sd16, cfg, tokens, torch.float32)
    hf_exact = _hf_log_probs(model16.float(), tokens)
    assert (exact - hf_exact).abs().max() < 1e-4  # the same function of the same bfloat16 weights
    hf_rounding = float((hf_exact - hf16).abs().max())
    assert 1e-3 < hf_rounding and (exact - hf16).abs().max() <= hf_rounding + 1e-4


def _without(feature: str):
    """The family's config with one feature switched off: what a converter that ignored it reads."""
    return {
        "window": lambda cfg: cfg.replace(sliding_window=None, sliding_window_layers=None),
        "window+1": lambda cfg: cfg.replace(sliding_window=cfg.sliding_window + 1),
        "qk_norm": lambda cfg: cfg.replace(qk_norm=False, qk_norm_over="head"),
        "1 + w": lambda cfg: cfg.replace(norm_gain_offset=0.0),
        "embedding_scale": lambda cfg: cfg.replace(embedding_scale=None),
        "logit_softcap": lambda cfg: cfg.replace(logit_softcap=None),
        "attn_softcap": lambda cfg: cfg.replace(attn_softcap=None),
        "attention_scale": lambda cfg: cfg.replace(attention_scale=None),
        "post_norms": lambda cfg: cfg.replace(post_norms=False),
        "gate_up_order": lambda cfg: cfg,  # the state dict's halves are swapped below
        "full_rotary": lambda cfg: cfg.replace(rotary_dim=None),
        "rotary_interleaved": lambda cfg: cfg.replace(rotary_interleaved=False),
        "position_offset": lambda cfg: cfg,  # W_pos read from row 0 below
        "logit_scale": lambda cfg: cfg.replace(logit_scale=None),
        "rotary_base_local": lambda cfg: cfg.replace(rotary_base_local=None),
        "ln_mlp": lambda cfg: cfg,  # ln_attn read for both branches below
        "kv_groups": lambda cfg: cfg,  # each group's key and value given to the other group below
        "alibi": lambda cfg: cfg,  # the slopes are zeroed below
        "embedding_norm": lambda cfg: cfg.replace(embedding_norm=False),
    }[feature]


@pytest.mark.parametrize("name,feature", [("Mistral", "window"), ("Mistral", "window+1"), ("Qwen3", "qk_norm"),
                                          ("Gemma", "1 + w"), ("Gemma", "embedding_scale"), ("Gemma2", "logit_softcap"),
                                          ("Gemma2", "attn_softcap"), ("Gemma2", "attention_scale"),
                                          ("Gemma2", "post_norms"), ("Gemma2", "window"), ("Phi3", "gate_up_order"),
                                          ("Phi3", "full_rotary"), ("GPT-J", "rotary_interleaved"),
                                          ("OPT", "position_offset"), ("Cohere", "logit_scale"),
                                          ("Cohere", "rotary_interleaved"), ("BLOOM", "alibi"), ("Gemma3", "rotary_base_local"), ("Falcon-40B", "ln_mlp"),
                                          ("Falcon-40B", "kv_groups"),
                                          ("Gemma3", "qk_norm"), ("Gemma3", "post_norms"), ("Gemma3", "1 + w"),
                                          ("BLOOM", "embedding_norm"), ("OLMo-2", "qk_norm")])
def test_negative_control_a_feature_left_out_is_caught(name, feature, monkeypatch):
    tokens = _tokens()
    if feature == "alibi":
        monkeypatch.setattr(reference, "alibi_slopes", lambda n_heads, device=None: torch.zeros(n_heads, device=device))
    model, config = _model(name)
    sd, cfg = io.from_hf(model.state_dict(), config)
    wrong = _without(feature)(cfg)
    if feature == "position_offset":
        sd = sd | {"pos_embed.W_pos": model.state_dict()["model.decoder.embed_positions.weight"][: cfg.n_ctx]}
    if feature == "ln_mlp":
        sd = sd | {k.replace("ln1", "ln2"): v for k, v in sd.items() if ".ln1." in k}
    if feature == "kv_groups":
        sd = sd | {k: v.flip(0) for k, v in sd.items() if k.endswith(("_W_K", "_W_V", "_b_K", "_b_V"))}
    if feature == "gate_up_order":  # gate_up_proj read as [up | gate]
        sd = sd | {k.replace("W_in", "W_gate"): v for k, v in sd.items() if k.endswith("W_in")} \
            | {k.replace("W_gate", "W_in"): v for k, v in sd.items() if k.endswith("W_gate")}
    if feature in ("qk_norm", "post_norms", "embedding_norm"):
        sd = {k: v for k, v in sd.items() if {"qk_norm": "_norm.", "post_norms": "_post.", "embedding_norm": "embed.ln."}[feature] not in k}
    assert (_ours(sd, wrong, tokens) - _hf_log_probs(model, tokens)).abs().max() > 1e-2


def test_negative_control_qwen2_biases_read_as_llama_are_refused():
    """Qwen2's q/k/v biases are tensors a LLaMA converter (attention_bias=False) does not take."""
    model, config = _model("Qwen2")
    as_llama = config.to_dict() | {"model_type": "llama", "attention_bias": False}
    with pytest.raises(cm.CircuitMathError, match="q_proj.bias"):
        io.from_hf(model.state_dict(), as_llama)


#: The steps whose output a family's layout holds, where the defaults make something it cannot:
#: Qwen2 has no o_proj bias to receive the folded value biases.
FITTING_STEPS = {"Qwen2": ("fold_ln", "center_unembed"), "Qwen2-MoE": ("fold_ln", "center_unembed"),
                 # GPT-J's q/k/v have no biases to receive ln_1's bias
                 "GPT-J": ("fold_value_biases", "center_writing_weights", "center_unembed"),
                 # Falcon-sequential's q/k/v have no biases to receive its LayerNorms' biases
                 "Falcon-sequential": ("fold_value_biases", "center_writing_weights", "center_unembed"),
                 # BLOOM's embedding LayerNorm, once folded into W_E, is no stored LayerNorm
                 "BLOOM": ("fold_value_biases", "center_unembed")}


#: OPT reads its positions from row 2 of embed_positions on: the rows before belong to no tensor
#: of the reference, so the layout cannot be written through the converter's views once the
#: processing changes W_pos (a post-norm OPT's is copied as it was); nor can Falcon-40B's query
#: heads, each group's stored ahead of its key and value (copies, not views).
OWN_LAYOUT = [name for name in NAMES if name not in ("OPT", "Falcon-40B")]


@pytest.mark.parametrize("name", OWN_LAYOUT)
def test_processed_folder_loads_as_its_own_architecture(tmp_path, name):
    """process writes the family's names, config.json and layout (the layout key in the metadata);
    transformers loads it as the same class and computes the input's log-probs (float32 rounding
    of the folded weights; measured below 1e-5). Control: a folded norm's gain put back (GPT-J,
    Cohere, Falcon: a norm's gain negated)."""
    model, _config = _model(name)  # a tied family's folder the processing unties is written untied
    folder = tmp_path / "in"
    model.save_pretrained(folder)
    out = tmp_path / "out"
    cfg = io.process_checkpoint(folder, out, steps=FITTING_STEPS.get(name))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"][LAYOUT_KEY] == "config.json", cfg.applied
    assert io.open_checkpoint(out).cfg == cfg  # read back in its layout (Phi-3: 6 stored tensors a block)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(model)
    tokens = _tokens()
    expected = _hf_log_probs(model, tokens)
    assert (_hf_log_probs(loaded, tokens) - expected).abs().max() < 1e-4
    assert cfg.applied and cfg.tied_embeddings == (json.loads((out / "config.json").read_text()).get("tie_word_embeddings") is True)
    with torch.no_grad():
        if name == "OPT-post":  # post-norms stay: one's gain negated
            loaded.model.decoder.layers[1].final_layer_norm.weight.mul_(-1)
        elif name in ("GPT-J", "Cohere", "Falcon", "Falcon-sequential", "BLOOM"):  # a norm left, or one both branches read
            layers = loaded.model.layers if name == "Cohere" else loaded.transformer.h
            (layers[1].ln_1 if name == "GPT-J" else layers[1].input_layernorm).weight.mul_(-1)
        elif name == "OLMo-2":  # no norm before a sub-layer: the final norm's gain put back
            loaded.model.norm.weight.copy_(model.model.norm.weight)
        else:
            loaded.model.layers[1].input_layernorm.weight.copy_(model.model.layers[1].input_layernorm.weight)
    assert (_hf_log_probs(loaded, tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["Qwen2", "GPT-J", "OPT", "BLOOM", "Falcon-40B"])
def test_what_the_layout_cannot_hold_is_written_in_circuitmath_names(tmp_path, name):
    """The defaults fold Qwen2's value biases into an output bias its layout lacks, and GPT-J's LayerNorm bias into
    query/key/value biases it lacks, BLOOM's embedding LayerNorm into W_E (a stored LayerNorm of
    gain 1 and bias 0 still normalises): the folder is written in circuitmath's names, and computes
    the input's log-probs. OPT's positions, centered as a writer, cover part of embed_positions."""
    model, _config = _model(name)
    model.save_pretrained(tmp_path / "in")
    cfg = io.process_checkpoint(tmp_path / "in", tmp_path / "out")
    folded = {"fold_rms_norm", "fold_layer_norm"} & set(cfg.applied)
    assert folded and cfg.applied and not (tmp_path / "out" / "config.json").exists()
    sd, got_cfg = io.open_checkpoint(tmp_path / "out").load()
    assert got_cfg == cfg
    if name == "Qwen2":
        assert "fold_value_biases" in cfg.applied and bool(sd["blocks.0.attn.b_O"].ne(0).any())
    tokens = _tokens()
    assert (_ours(sd, cfg, tokens) - _hf_log_probs(model, tokens)).abs().max() < 1e-4


@pytest.mark.parametrize("command", ["check", "process"])
def test_unknown_model_type_names_it_and_lists_the_supported(tmp_path, capsys, command):
    from safetensors.torch import save_file

    from circuitmath._cli import main

    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    save_file({"shared.weight": torch.zeros(4, 8)}, folder / "model.safetensors")
    args = [command, str(folder)] + ([str(tmp_path / "out")] if command == "process" else [])
    assert main(args) == 2
    message = capsys.readouterr().err
    assert "'t5'" in message and all(family.model_type in message for family in FAMILIES)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["BLOOM", "Gemma3", "Falcon-40B", "OLMo-2"])
def test_check_processed_passes_the_processing_and_names_a_planted_error(tmp_path, name, capsys):
    """check on each new family's folder, and check --processed on its processed folder (its own layout or circuitmath's
    names): exit 0; the same folder with one processed MLP tensor of block 1 changed: exit 1, naming it."""
    from safetensors.torch import load_file, save_file

    from circuitmath._cli import main

    model, _config = _model(name)
    model.save_pretrained(tmp_path / "in")
    io.process_checkpoint(tmp_path / "in", tmp_path / "out", steps=FITTING_STEPS.get(name))
    assert main(["check", str(tmp_path / "in")]) == 0  # every identity holds or refuses, streamed
    assert main(["check", str(tmp_path / "in"), "--processed", str(tmp_path / "out")]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    target = next(n for n in sorted(index["weight_map"]) if "mlp" in n and ".1." in n)
    shard = tmp_path / "out" / index["weight_map"][target]
    tensors = load_file(shard)
    tensors[target] = tensors[target] + 0.5 * torch.randn(tensors[target].shape, generator=torch.Generator().manual_seed(0))
    save_file(tensors, shard, metadata=json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])["__metadata__"])
    capsys.readouterr()
    assert main(["check", str(tmp_path / "in"), "--processed", str(tmp_path / "out")]) == 1
    assert target in capsys.readouterr().out  # named as the folder stores it


def test_olmo2_qk_norm_spans_the_whole_projection():
    """OLMo-2's q_norm and k_norm gains are one per entry of the whole projection ([n_heads, d_head],
    [n_key_value_heads, d_head] read as views of the stored [heads * d_head]), and the reference
    normalises over every head's entries together: a norm over each head's entries alone (the
    gains kept) computes other log-probs (control)."""
    from circuitmath._reference import _head_norm

    model, config = _model("OLMo-2")
    sd, cfg = io.from_hf(model.state_dict(), config)
    assert sd["blocks.0.attn.q_norm.w"].shape == (cfg.n_heads, cfg.d_head)
    assert sd["blocks.0.attn.k_norm.w"].shape == (cfg.n_key_value_heads, cfg.d_head)
    assert not cfg.pre_norms and cfg.post_norms and cfg.qk_norm_over == "projection"
    x = torch.randn(1, 3, cfg.n_heads, cfg.d_head, dtype=torch.float64)
    gains = {"q.w": torch.rand(cfg.n_heads, cfg.d_head, dtype=torch.float64) + 0.5}
    whole = _head_norm(gains, "q", cfg, x)
    assert torch.allclose(whole.flatten(-2).pow(2).div(gains["q.w"].flatten() ** 2).mean(-1), torch.ones(1, 3, dtype=torch.float64))
    per_head = torch.stack([_head_norm({"q.w": gains["q.w"][h]}, "q", cfg.replace(qk_norm_over="head"), x[:, :, h]) for h in range(cfg.n_heads)], 2)
    assert (whole - per_head).abs().max() > 1e-2


EXPECTED = {  # (family, identity): the verdict's start (a refusal names the feature that breaks it)
    ("Qwen3", "remove_key_biases"): "not exact: keys and queries are not rotated by position",
    ("LLaMA", "refactor_factored_attn_matrices"): "not exact: keys and queries are not rotated by position",
    ("Gemma", "migrate_norm_scales"): "not exact: norm gains applied as stored",
    ("Gemma", "fold_layer_norm"): "not applicable: normalization_type is LN",
    ("Gemma", "fold_rms_norm"): "exact",
    ("Qwen2", "fold_value_biases"): "exact",
    ("Mistral", "rotate_residual_stream"): "exact",
    ("Gemma2", "center_unembed"): "not exact: no logit softcap",
    ("Gemma2", "rotate_residual_stream"): "not exact: each sandwich norm's gain is one number",
    ("Gemma2", "fold_rms_norm"): "exact",
    ("Gemma2", "fold_value_biases"): "exact",
    ("Gemma3", "fold_rms_norm"): "exact",
    ("Gemma3", "center_unembed"): "exact",
    ("Gemma3", "rotate_heads"): "not exact: no QK-norm",
    ("Gemma3", "rotate_residual_stream"): "not exact: each sandwich norm's gain is one number",
    ("Falcon-40B", "fold_layer_norm"): "exact",
    ("Falcon-40B", "fold_value_biases"): "exact",
    ("BLOOM", "fold_layer_norm"): "exact",
    ("BLOOM", "remove_key_biases"): "exact",
    ("BLOOM", "refactor_factored_attn_matrices"): "exact",
    ("BLOOM", "permute_heads"): "not exact: every head sees positions alike",
    ("BLOOM", "center_writing_weights"): "not applicable: pre-norm: the token embeddings pass through a LayerNorm",
    ("OLMo-2", "fold_rms_norm"): "exact",  # the final norm: the only one with readers
    ("OLMo-2", "permute_heads"): "exact",  # the whole-projection QK-norm's gains move with their heads
    ("OLMo-2", "fold_value_biases"): "exact",  # the post-norm reads b_V W_O + b_O as it read both
    ("OLMo-2", "center_unembed"): "exact",
    ("OLMo-2", "rotate_residual_stream"): "not exact: each sandwich norm's gain is one number",
    ("OLMo-2", "rotate_heads"): "not exact: no QK-norm: the model normalises the whole query and key projections",
    ("OLMo-2", "refactor_factored_attn_matrices"): "not exact: keys and queries are not rotated by position",
    ("OLMo-2", "rescale_residual_stream"): "not exact: no sandwich norms",
}


def test_every_identity_holds_or_refuses_each_family():
    """No registered identity fails silently on any family: each check passes or the identity
    refuses naming a precondition (the table the book prints)."""
    table = identity_table(cm.identities())
    assert set(table) == set(NAMES)
    failures = [(f, i) for f, row in table.items() for i, verdict in row.items() if verdict == "fails"]
    assert not failures
    for (fam, identity), verdict in EXPECTED.items():
        assert table[fam][identity].startswith(verdict), (fam, identity, table[fam][identity])


from hypothesis import given, settings  # noqa: E402

from circuitmath import strategies  # noqa: E402

FEATURES = strategies.configs(sliding_window=(False, True), qk_norm=(False, True), norm_gain_offsets=(0.0, 1.0),
                              softcaps=(False, True), post_norms=(False, True), rotary_interleaved=(False, True),
                              grouped_query=(False, True), local_rotary_base=(False, True), max_ctx=6,
                              min_d_model=4, pre_norms=(True, False), qk_norm_spans=("head", "projection"))


@settings(max_examples=16, deadline=None)
@given(cfg=FEATURES, data=strategies.st.data())
def test_identities_hold_or_refuse_with_every_feature_drawn(cfg, data):
    """On drawn models with sliding windows, QK-norm (per head or over the projection), 1 + w gains, softcaps and
    sandwich norms (with or without pre-norms), each registered identity's
    check passes or it refuses; a wrong rewrite that differs on the model is rejected."""
    sd = data.draw(strategies.state_dicts(cfg, min_gain_spread=0.2))
    for identity in cm.identities():
        try:
            assert identity.check(sd, cfg).passed, identity.name
        except cm.PreconditionError:
            continue
        for wrong in identity.wrong_rewrites_for(cfg):
            if wrong == "gain_stored_as_w":
                assert not identity.check_wrong_rewrite(wrong, sd, cfg).passed


@settings(max_examples=12, deadline=None)
@given(cfg=strategies.configs(positional_embedding_types=("alibi",), embedding_norm=(False, True), max_ctx=6,
                              min_d_model=4, grouped_query=(False, True)),
       data=strategies.st.data())
def test_identities_hold_or_refuse_under_alibi_and_an_embedding_norm(cfg, data):
    """On drawn ALiBi models (with BLOOM's embedding LayerNorm where they are pre-LayerNorm),
    each registered identity's check passes or it refuses naming a precondition."""
    sd = data.draw(strategies.state_dicts(cfg, min_gain_spread=0.2))
    for identity in cm.identities():
        try:
            assert identity.check(sd, cfg).passed, identity.name
        except cm.PreconditionError:
            continue


def test_fold_of_gains_stored_as_w_uses_one_plus_w():
    """Gemma-style gains: the fold is exact and rounds once in bfloat16; folding w is caught."""
    cfg = cm.Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=20, n_ctx=6, d_mlp=24,
                    normalization_type="RMS", gated_mlp=True, act_fn="silu", norm_gain_offset=1.0)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    identity = cm.get_identity("fold_rms_norm")
    assert identity.check(sd, cfg).passed
    assert not identity.check_wrong_rewrite("gain_stored_as_w", sd, cfg).passed
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    folded, _ = cm.fold_rms_norm(half, cfg)
    once = (half["blocks.0.attn.W_Q"].double() * (1 + half["blocks.0.ln1.w"].double())[:, None]).to(torch.bfloat16)
    assert torch.equal(folded["blocks.0.attn.W_Q"], once)


@pytest.mark.parametrize("name,identity", [("Gemma2", "center_unembed"), ("Qwen3", "remove_key_biases"),
                                           ("Gemma2", "remove_key_biases")])
def test_a_refused_rewrite_applied_regardless_changes_the_function(name, identity):
    """Where a feature breaks an identity, its rewrite applied anyway (the wrong rewrite the
    diagnosis tries when the identity refuses) changes the log-probs: the refusal is needed.
    The Gemma2 and Qwen3 cases: a logit softcap, QK-norm (with rotary), an attention softcap."""
    cfg = family(name).cfg
    if identity == "remove_key_biases":  # give the keys biases to remove (neither family has any)
        cfg = cfg.replace(positional_embedding_type="standard", n_ctx=16)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    with pytest.raises(cm.PreconditionError):
        cm.get_identity(identity).check(sd, cfg)
    assert not cm.get_identity(identity).check_wrong_rewrite("regardless", sd, cfg).passed


def test_bloom_embedding_norm_folds_row_by_row_and_no_stored_norm_holds_it():
    """BLOOM's embedding LayerNorm reads the token embedding alone (ALiBi adds nothing before it):
    fold_layer_norm tables it, W_E := LN(W_E), exactly. Control: the folded W_E read again through
    a LayerNorm of gain 1 and bias 0 (what its own layout would store) computes something else,
    which is why such a folder is written in circuitmath's names."""
    cfg = family("BLOOM").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg)
    assert not folded_cfg.embedding_norm and "embed.ln.w" not in folded
    tokens = _tokens()
    assert (_ours(folded, folded_cfg, tokens) - _ours(sd, cfg, tokens)).abs().max() < 1e-12
    unit = folded | {"embed.ln.w": torch.ones(cfg.d_model, dtype=torch.float64),
                     "embed.ln.b": torch.zeros(cfg.d_model, dtype=torch.float64)}
    as_stored = folded_cfg.replace(embedding_norm=True, normalization_type="LN")
    for norm in ("blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_final"):
        unit[f"{norm}.w"], unit[f"{norm}.b"] = torch.ones(cfg.d_model, dtype=torch.float64), torch.zeros(cfg.d_model, dtype=torch.float64)
    assert (_ours(unit, as_stored, tokens) - _ours(sd, cfg, tokens)).abs().max() > 1e-2


def test_alibi_key_bias_removal_is_exact_and_a_head_permutation_is_refused():
    """Under ALiBi a key bias still adds one number to each query's row of scores (the slope term
    does not depend on it): removing it is exact. A head's slope is its index's, so moving heads is
    refused; the permutation applied regardless changes the function."""
    cfg = family("BLOOM").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    assert cm.get_identity("remove_key_biases").check(sd, cfg).passed
    permutation = torch.tensor([1, 0, 2, 3])
    with pytest.raises(cm.PreconditionError, match="every head sees positions alike"):
        cm.permute_heads(sd, cfg, permutation)
    cm.permute_heads(sd, cfg, torch.arange(4))  # no head moved: accepted
    moved = dict(sd)  # the permutation applied regardless: every per-head tensor of every layer
    for name, tensor in sd.items():
        if ".attn." in name and name.split(".")[-1] in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"):
            moved[name] = tensor[permutation]
    tokens = _tokens()
    assert (_ours(moved, cfg, tokens) - _ours(sd, cfg, tokens)).abs().max() > 1e-3


def test_olmo2_head_permutation_moves_the_qk_norm_gains_and_the_head_rotation_is_refused():
    """A QK-norm over the whole projection divides by a root mean square no order of the heads
    changes: permuting the heads is exact once its gains move with them; the twin that leaves
    them in place changes the function. A rotation R of each head's query/key space commutes with
    that root mean square but not with a gain that differs within a head: rotate_heads refuses
    naming the QK-norm, and the rotation applied regardless changes the function. The residual
    rotation needs the post-norms' gains to be one number each: refused on OLMo-2's gains, exact
    once they are (with the final norm folded first), and applied regardless it changes the function."""
    cfg = family("OLMo-2").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    tokens = _tokens()
    base = _ours(sd, cfg, tokens)
    permutation = torch.tensor([1, 0, 3, 2])  # each group of two query heads swaps with its key head kept
    permuted, _ = cm.permute_heads(sd, cfg, torch.tensor([2, 3, 0, 1]))
    assert (_ours(permuted, cfg, tokens) - base).abs().max() < 1e-12
    gains_kept = permuted | {k: sd[k] for k in sd if k.endswith(("q_norm.w", "k_norm.w"))}
    assert (_ours(gains_kept, cfg, tokens) - base).abs().max() > 1e-2
    assert torch.equal(cm.permute_heads(sd, cfg, permutation)[0]["blocks.0.attn.k_norm.w"], sd["blocks.0.attn.k_norm.w"])
    half, angles = cfg.d_head // 2, torch.linspace(0.3, 1.2, cfg.d_head // 2, dtype=torch.float64)
    R = torch.zeros(cfg.d_head, cfg.d_head, dtype=torch.float64)  # turns each rotary pair: commutes with the rotary embedding
    for i, angle in enumerate(angles):
        c, s = torch.cos(angle), torch.sin(angle)
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, s, -s, c
    with pytest.raises(cm.PreconditionError, match="whole query and key projections"):
        cm.rotate_heads(sd, cfg, query_key=R)
    rotated = dict(sd)
    for name in [k for k in sd if k.endswith(("attn.W_Q", "attn._W_K"))]:
        rotated[name] = sd[name] @ R
    assert (_ours(rotated, cfg, tokens) - base).abs().max() > 1e-2
    Q = cm.random_orthogonal(cfg.d_model, seed=2)
    folded, folded_cfg = cm.fold_rms_norm(sd, cfg)
    with pytest.raises(cm.PreconditionError, match="sandwich norm"):
        cm.rotate_residual_stream(folded, folded_cfg, Q)
    even = folded | {k: torch.full_like(v, 1.7) for k, v in folded.items() if k.endswith("_post.w")}
    turned, turned_cfg = cm.rotate_residual_stream(even, folded_cfg, Q)
    assert (_ours(turned, turned_cfg, tokens) - _ours(even, folded_cfg, tokens)).abs().max() < 1e-10
    uneven = {k: turned[k] if not k.endswith("_post.w") else folded[k] for k in turned}
    assert (_ours(uneven, turned_cfg, tokens) - _ours(folded, folded_cfg, tokens)).abs().max() > 1e-2


def test_olmo2_bfloat16_folder_processed_stays_within_its_own_rounding(tmp_path):
    """A bfloat16 OLMo-2 folder processed by the defaults loads as Olmo2ForCausalLM, and its
    bfloat16 log-probs are as far from the input's as the input's own bfloat16 forward pass is
    from float32 arithmetic on the same weights (measured 0.040 against 0.055)."""
    model, _config = _model("OLMo-2", torch.bfloat16)
    model.save_pretrained(tmp_path / "in")
    cfg = io.process_checkpoint(tmp_path / "in", tmp_path / "out")
    assert cfg.applied == ("fold_rms_norm", "fold_value_biases", "center_unembed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).eval()
    assert type(loaded) is type(model) and loaded.dtype == torch.bfloat16
    tokens = _tokens()
    expected = _hf_log_probs(model, tokens)
    rounding = float((expected - _hf_log_probs(copy.deepcopy(model).float(), tokens)).abs().max())
    assert 1e-3 < rounding and float((_hf_log_probs(loaded, tokens) - expected).abs().max()) <= rounding


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.cfg.tied_embeddings])
def test_the_tie_of_the_embeddings_recorded_is_true_of_the_weights(name):
    """A family that ties its unembedding to its token embedding says so (Config.tied_embeddings,
    W_U = W_E^T in its random weights). After process_weights and after each registered identity
    that rewrites it, the config says tied exactly when W_U is still W_E^T: processing that makes
    them differ (a norm folded into W_U, W_E centered, the embedding scale folded) records the
    untying. Control: W_U one unit in the last place off is recorded untied."""
    from circuitmath._processing._common import untied

    cfg = family(name).cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    assert torch.equal(sd["unembed.W_U"], sd["embed.W_E"].T)
    outputs = [cm.process_weights(sd, cfg), cm.process_weights(sd, cfg, fold_ln=False, center_writing_weights=False,
                                                                center_unembed=False, fold_value_biases=True)]
    for identity in cm.identities():
        try:
            if identity.transform is not None and identity.check(sd, cfg).passed:
                outputs.append(identity.transform(sd, cfg))
        except (cm.PreconditionError, TypeError):  # refused, or a transform with parameters of its own
            continue
    assert not outputs[0][1].tied_embeddings and outputs[1][1].tied_embeddings
    for out, out_cfg in outputs:
        assert out_cfg.tied_embeddings == torch.equal(out["unembed.W_U"], out["embed.W_E"].T), out_cfg.applied
    nudged = dict(sd, **{"unembed.W_U": sd["unembed.W_U"].clone()})
    nudged["unembed.W_U"].view(-1)[0] = torch.nextafter(nudged["unembed.W_U"].view(-1)[0], torch.tensor(1.0))
    assert not untied(sd, nudged, cfg).tied_embeddings and untied(sd, dict(sd), cfg).tied_embeddings


def test_olmo2_head_permutation_that_leaves_the_qk_norm_gains_is_a_twin_the_checker_names():
    """permute_heads' wrong rewrite qk_norm_gains_not_permuted (every head moved, the gains of the
    whole-projection QK-norm left in place) is rejected on OLMo-2, and a model so processed is
    blamed on it by name; it is no twin where the QK-norm is per head (one gain serves every head)."""
    from circuitmath.testing import NotEquivalentError, assert_equivalent

    cfg = family("OLMo-2").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    identity = cm.get_identity("permute_heads")
    assert "qk_norm_gains_not_permuted" in identity.wrong_rewrites_for(cfg)
    assert "qk_norm_gains_not_permuted" not in identity.wrong_rewrites_for(family("Qwen3").cfg)
    assert not identity.check_wrong_rewrite("qk_norm_gains_not_permuted", sd, cfg).passed
    wrong, wrong_cfg = identity.wrong_rewrites["qk_norm_gains_not_permuted"](sd, cfg)
    with pytest.raises(NotEquivalentError) as failure:
        assert_equivalent(sd, wrong, cfg, after_cfg=wrong_cfg)
    assert "qk_norm_gains_not_permuted" in str(failure.value)
