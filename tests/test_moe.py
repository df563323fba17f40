"""Mixture-of-experts families (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE): the reference
forward pass computes transformers' log-probs, both layouts of the experts read alike, processed
folders load in transformers as their own architecture, the routers are folded, rotated and
scaled with the other readers of their norm (a router left out is a twin the checks reject), and
experts permute with the router's columns (top-k routing is permutation-equivariant)."""

import itertools
import re

import pytest
import torch
import transformers
from test_families import _hf_log_probs, _model, _ours, _tokens

import circuitmath as cm
from circuitmath import _diagnosis as diagnosis, io, testing
from circuitmath._checkpoint import INDEX
from circuitmath._hf import hf_layout
from circuitmath._moe import routing
from circuitmath._processing._common import DENSE_MLP, NO_ATTN_SINKS
from circuitmath._processing.experts import HAS_EXPERTS
from circuitmath._stored import place
from circuitmath._streaming_check_processed import check_processed
from circuitmath._streaming_check_model import check_model_streaming
from circuitmath.testing import NotEquivalentError, assert_equivalent, compare_log_probs, diagnose

MOE = ["Mixtral", "Qwen2-MoE", "Qwen3-MoE", "GPT-OSS"]
F64 = torch.float64


@pytest.mark.parametrize("name", MOE)
def test_reference_is_transformers_to_float32_rounding(name):
    """float32: measured 4.8e-6 (Mixtral), 2.6e-6 (Qwen2-MoE), 2.6e-6 (Qwen3-MoE), 1.2e-6
    (GPT-OSS). Control: the routing read another way (renormalised or not, one expert fewer)
    moves the log-probs."""
    tokens = _tokens()
    model, config = _model(name)
    sd, cfg = io.from_hf(model.state_dict(), config)
    expected = _hf_log_probs(model, tokens)
    assert (_ours(sd, cfg, tokens) - expected).abs().max() <= 1e-5
    for wrong in (cfg.replace(router_normalize_top_k=not cfg.router_normalize_top_k),
                  cfg.replace(experts_per_token=cfg.experts_per_token - 1)):
        assert (_ours(sd, wrong, tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("feature", ["sinks", "clamp"])
def test_negative_control_gpt_oss_without_its_sinks_or_its_clamp(feature):
    tokens = _tokens()
    model, config = _model("GPT-OSS")
    sd, cfg = io.from_hf(model.state_dict(), config)
    if feature == "sinks":
        sd, cfg = {k: v for k, v in sd.items() if not k.endswith(".sinks")}, cfg.replace(attn_sinks=False)
    else:
        cfg = cfg.replace(swiglu_limit=1e6)
    assert (_ours(sd, cfg, tokens) - _hf_log_probs(model, tokens)).abs().max() > 1e-2


def test_negative_control_qwen2_moe_without_its_shared_expert():
    tokens = _tokens()
    model, config = _model("Qwen2-MoE")
    sd, cfg = io.from_hf(model.state_dict(), config)
    dense = {k: v for k, v in sd.items() if ".shared" not in k and "W_shared_gate" not in k}
    assert (_ours(dense, cfg.replace(d_shared_mlp=None), tokens) - _hf_log_probs(model, tokens)).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["Mixtral", "Qwen2-MoE", "GPT-OSS"])
def test_saved_sharded_folder_reads_as_the_state_dict(tmp_path, name):
    """save_pretrained writes one Linear per expert (Mixtral's block_sparse_moe.experts.{e}.w1);
    the model's state_dict stacks them (experts.gate_up_proj): both convert to the same tensors."""
    model, config = _model(name)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / INDEX).exists()
    sd, cfg = io.from_hf(model.state_dict(), config)
    stored, stored_cfg = io.open_checkpoint(tmp_path).load()
    assert stored_cfg == cfg and stored.keys() == sd.keys()
    assert all(torch.equal(stored[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", MOE)
def test_processed_sharded_folder_loads_as_its_own_architecture(tmp_path, name):
    """Read, process (every applicable step), write, load in transformers as the same class: the
    input's log-probs (float32 rounding; measured below 1e-5). Control: a folded gain put back."""
    model, _config = _model(name, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "in", max_shard_size="40KB")
    # Qwen2-MoE has no o_proj bias for the folded value biases; GPT-OSS's sinks refuse the fold
    steps = ("fold_ln", "center_unembed") if name == "Qwen2-MoE" else "applicable"
    cfg = io.process_checkpoint(tmp_path / "in", tmp_path / "out", steps=steps)
    assert "fold_rms_norm" in cfg.applied and io.open_checkpoint(tmp_path / "out").cfg == cfg
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is type(model)
    tokens = _tokens()
    expected = _hf_log_probs(model, tokens)
    assert (_hf_log_probs(loaded, tokens) - expected).abs().max() < 1e-4
    with torch.no_grad():
        loaded.model.layers[1].post_attention_layernorm.weight.copy_(model.model.layers[1].post_attention_layernorm.weight)
    assert (_hf_log_probs(loaded, tokens) - expected).abs().max() > 1e-2


def _orthogonal(d, seed=3):
    return torch.linalg.qr(torch.randn(d, d, dtype=F64, generator=torch.Generator().manual_seed(seed)))[0]


def _written_back(model, config, processed):
    """``processed`` (circuitmath names) written into ``model``'s own tensors through the
    converter's views, part by part (the folded norms as the identity norm): a transformers model."""
    layout = hf_layout(config)
    stored = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    out = {}
    for layer in [None, *range(layout.cfg.n_layers)]:
        names = set(layout.block(layout.source(stored), layer)) if layer is not None else \
            set(layout.embed(layout.source(stored)) | layout.final(layout.source(stored)))
        part = {k: v.float() for k, v in processed.items() if k in names}
        out |= place(layout, layer, part, stored)
    written = transformers.AutoModelForCausalLM.from_config(config).eval()
    written.load_state_dict(out, strict=True)
    return written


def _processed(sd, cfg, Q, perm):
    folded, folded_cfg = cm.fold_rms_norm(sd, cfg)
    rotated, rotated_cfg = cm.rotate_residual_stream(folded, folded_cfg, Q)
    return cm.permute_experts(rotated, rotated_cfg, perm)


@pytest.mark.parametrize("name", MOE)
def test_fold_rotate_and_permute_experts_load_in_transformers(name):
    """The norms folded into every reader (routers included), the stream rotated, the experts
    permuted with the router's columns, written back in the architecture's own tensors: equal
    log-probs in transformers (float32; measured below 1e-5). Control: the router of one layer
    left as it was before the rotation."""
    tokens = _tokens()
    model, config = _model(name)
    sd, cfg = io.from_hf(model.state_dict(), config)
    Q, perm = _orthogonal(cfg.d_model).float(), torch.tensor([2, 0, 3, 1])
    out, out_cfg = _processed(sd, cfg, Q, perm)
    assert out_cfg.applied == ("fold_rms_norm", "rotate_residual_stream", "permute_experts")
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    written = _written_back(model, config, out)
    expected = _hf_log_probs(model, tokens)
    assert (_hf_log_probs(written, tokens) - expected).abs().max() < 1e-4
    wrong = dict(out, **{"blocks.1.mlp.W_router": Q @ out["blocks.1.mlp.W_router"]})  # as before the rotation
    assert (_hf_log_probs(_written_back(model, config, wrong), tokens) - expected).abs().max() > 1e-2


# -- the identities on experts ---------------------------------------------------------------

ROUTER_TWINS = [("fold_rms_norm", "forget_router"), ("rotate_residual_stream", "router_unrotated"),
                ("migrate_norm_scales", "router_unscaled"), ("permute_experts", "router_not_permuted"),
                ("permute_experts", "experts_not_permuted"), ("permute_experts", "router_by_inverse")]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("identity,wrong", ROUTER_TWINS)
def test_a_router_left_out_is_rejected(name, identity, wrong):
    cfg = io.family(name).cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    ident = cm.get_identity(identity)
    assert ident.check(sd, cfg).passed
    assert wrong in ident.wrong_rewrites_for(cfg)
    assert not ident.check_wrong_rewrite(wrong, sd, cfg).passed
    if identity != "permute_experts":  # a dense model has no router to leave out
        assert wrong not in ident.wrong_rewrites_for(io.family("LLaMA").cfg)


@pytest.mark.parametrize("identity,wrong", ROUTER_TWINS[:3])
def test_the_planted_router_error_is_named(identity, wrong):
    """A router left out of a fold, a rotation or a scale migration: the identity's checker
    names that wrong rewrite and the routers."""
    cfg = io.family("Mixtral").cfg
    ident = cm.get_identity(identity)
    before, before_cfg = ident.prepared(cm.random_state_dict(cfg, seed=0, dtype=F64), cfg)
    after, after_cfg = ident.wrong_rewrites[wrong](before, before_cfg)
    report = getattr(testing, f"check_{ident.function}")(before, after, before_cfg, after_cfg=after_cfg)
    row = next(f for f in report.findings if f.rewrite is not None)
    assert not report.ok and row.rewrite == f"{identity}.{wrong}"
    assert {p.name for p in row.parameters} >= {"blocks.0.mlp.W_router", "blocks.1.mlp.W_router"}


@pytest.mark.parametrize("identity", ["permute_experts", "fold_rms_norm"])
def test_proofs_hold_and_reject_their_router_twins(identity):
    report = cm.get_identity(identity).prove()
    assert report.proved and all(t.rejected for t in report.twins)
    names = {t.name for t in report.twins}
    assert names >= ({"router_not_permuted", "experts_not_permuted", "router_by_inverse"}
                     if identity == "permute_experts" else {"forget_router"})


@pytest.mark.parametrize("wrong", ["router_not_permuted", "experts_not_permuted", "router_by_inverse"])
def test_the_planted_expert_permutation_error_is_named(wrong):
    cfg = io.family("Mixtral").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    after, after_cfg = cm.get_identity("permute_experts").wrong_rewrites[wrong](sd, cfg)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    row = next(f for f in diagnose(sd, after, cfg).findings if f.name == "permute_experts")
    assert row.status == "violated" and row.rewrite == f"permute_experts.{wrong}"


def test_the_expert_permutation_is_recovered_and_named():
    cfg = io.family("Mixtral").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    perm = torch.tensor([[1, 2, 3, 0], [3, 2, 1, 0]])
    after, _ = cm.permute_experts(sd, cfg, perm)
    assert torch.equal(cm.recover_expert_permutation(sd, after, cfg), perm)
    assert_equivalent(sd, after, cfg)
    assert [(f.name, f.status, f.rewrite) for f in diagnose(sd, after, cfg).findings][0] == \
        ("permute_experts", "holds", "exact")
    spoiled = dict(after, **{"blocks.1.mlp.experts.0.W_out": after["blocks.1.mlp.experts.1.W_out"]})
    assert cm.recover_expert_permutation(sd, spoiled, cfg) is None


@pytest.mark.parametrize("spoil", ["nan", "extra key", "wrong shape"])
def test_bad_input_to_permute_experts_is_refused_naming_the_key(spoil):
    cfg = io.family("Mixtral").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    name = "blocks.1.mlp.experts.2.W_in"
    if spoil == "nan":
        sd[name] = sd[name].clone().index_fill_(0, torch.tensor([3]), float("nan"))
    elif spoil == "extra key":
        name = "blocks.1.mlp.experts.9.W_in"
        sd[name] = sd["blocks.1.mlp.experts.2.W_in"]
    else:
        sd[name] = sd[name][:-1]
    with pytest.raises(cm.CircuitMathError, match=re.escape(name)):
        cm.permute_experts(sd, cfg, torch.tensor([1, 2, 3, 0]))


def test_a_pipeline_with_an_expert_permutation_is_taken_apart():
    """fold -> rotate -> permute experts in float32, recorded nowhere: the diagnosis replays the
    fold, recovers the rotation and the permutation (each expert matched to the nearest) and
    names each step. Control: one layer's router moved again is named."""
    cfg = io.family("Mixtral").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    folded, folded_cfg = cm.fold_rms_norm(sd, cfg)
    turned, turned_cfg = cm.rotate_residual_stream(folded, folded_cfg, cm.hadamard(cfg.d_model))
    moved, moved_cfg = cm.permute_experts(turned, turned_cfg, torch.tensor([1, 2, 3, 0]))
    report = diagnose(sd, moved, cfg, after_cfg=moved_cfg.replace(applied=()))
    assert report.ok, report
    assert [(f.name, f.rewrite) for f in report.findings if f.kind == "identity"] == [
        ("fold_rms_norm", "exact"), ("rotate_residual_stream", "exact"), ("permute_experts", "exact")]
    wrong = dict(moved, **{"blocks.1.mlp.W_router": moved["blocks.1.mlp.W_router"][:, [1, 2, 3, 0]]})
    report = diagnose(sd, wrong, cfg, after_cfg=moved_cfg.replace(applied=()))
    assert not report.ok and "blocks.1.mlp.W_router" in {p.name for p in report.culprits()}


def _chosen(state_dict, cfg, tokens):
    record = {}
    cm.forward(state_dict, cfg, tokens, record=record)
    return torch.stack([weights != 0 for weights in record["routing"]])  # [layer, batch, pos, expert]


def test_rounding_can_flip_a_routing_choice_in_bfloat16():
    """An exact rewrite rounded to bfloat16 moves the router's logits by rounding, which flips a
    near-tied top-k choice: fold + rotate on the tiny Mixtral, 64 x 16 tokens, flips the chosen
    experts at some (layer, position) pairs (measured 20 of 2048; max |Δ log-prob| 0.39 against a
    tolerance of 1.9) and at none in float32; the log-probs stay within the check's bfloat16
    tolerance."""
    cfg = io.family("Mixtral").cfg
    tokens = torch.randint(0, cfg.d_vocab, (64, 16), generator=torch.Generator().manual_seed(0))
    flips = {}
    for dtype in (torch.float32, torch.bfloat16):
        sd = cm.random_state_dict(cfg, seed=0, dtype=dtype)
        folded, folded_cfg = cm.fold_rms_norm(sd, cfg)
        turned, turned_cfg = cm.rotate_residual_stream(folded, folded_cfg, cm.hadamard(cfg.d_model))
        flips[dtype] = int((_chosen(sd, cfg, tokens) != _chosen(turned, turned_cfg, tokens)).any(-1).sum())
        assert compare_log_probs(sd, cfg, turned, turned_cfg, tokens).passed
    assert flips[torch.float32] == 0 and flips[torch.bfloat16] > 0, flips


@pytest.mark.parametrize("experts", [2, 3, 4, 5])
def test_top_k_routing_is_permutation_equivariant(experts):
    """g(L P) = g(L) P for every permutation of up to 5 experts and every k, on distinct logits
    (the fact the permutation proof assumes). Control: a tie at the k-th place is broken by
    index, so some permutation moves the choice."""
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(8, experts, dtype=F64, generator=g)
    for k, normalized in itertools.product(range(1, experts + 1), (False, True)):
        cfg = io.family("Mixtral").cfg.replace(n_experts=experts, experts_per_token=k, router_normalize_top_k=normalized)
        params = {"r.W_router": torch.eye(experts, dtype=F64), "r.b_router": torch.zeros(experts, dtype=F64)}
        weights = routing(params, "r", cfg, logits)
        for perm in itertools.permutations(range(experts)):
            perm = list(perm)
            moved = routing(params, "r", cfg, logits[:, perm])  # the softmax sums in another order
            assert torch.equal(moved != 0, weights[:, perm] != 0)
            assert torch.allclose(moved, weights[:, perm], rtol=1e-15, atol=0)
    tie = torch.tensor([[1.0, 1.0] + [0.0] * (experts - 2)], dtype=F64)
    cfg = io.family("Mixtral").cfg.replace(n_experts=experts, experts_per_token=1)
    swapped = [1, 0, *range(2, experts)]
    assert not torch.equal(routing(params, "r", cfg, tie[:, swapped]), routing(params, "r", cfg, tie)[:, swapped])


@pytest.mark.parametrize("identity,function", [("permute_neurons", "permute_neurons"), ("scale_neurons", "scale_neurons")])
def test_dense_mlp_rewrites_refuse_experts_naming_them(identity, function):
    cfg = io.family("Mixtral").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    with pytest.raises(cm.PreconditionError, match="mixture of 4 experts") as refused:
        cm.get_identity(identity).check(sd, cfg)
    assert refused.value.precondition is DENSE_MLP


def test_permute_experts_refuses_a_dense_model_and_a_non_permutation():
    cfg = io.family("LLaMA").cfg
    with pytest.raises(cm.PreconditionError) as refused:
        cm.permute_experts(cm.random_state_dict(cfg, seed=0), cfg, [0])
    assert refused.value.precondition is HAS_EXPERTS
    cfg = io.family("Mixtral").cfg
    with pytest.raises(cm.PreconditionError, match="does not list each"):
        cm.permute_experts(cm.random_state_dict(cfg, seed=0), cfg, [0, 0, 1, 2])


@pytest.mark.parametrize("fields", [dict(n_experts=4), dict(n_experts=4, experts_per_token=5),
                                    dict(experts_per_token=2), dict(d_shared_mlp=8),
                                    dict(n_experts=4, experts_per_token=2, gated_mlp=False)])
def test_config_refuses_incoherent_expert_fields(fields):
    base = dict(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=6, normalization_type="RMS",
                gated_mlp=True, act_fn="silu")
    with pytest.raises(cm.ConfigError, match="n_experts|experts_per_token"):
        cm.Config(**(base | fields))


# -- attention sinks ---------------------------------------------------------------------------

@pytest.mark.parametrize("identity", ["fold_value_biases", "remove_key_biases"])
def test_attention_sinks_refuse_the_bias_rewrites_and_the_fold_regardless_fails(identity):
    """A pattern with sinks has rows that sum to less than 1 and a sink no key bias shifts:
    folding value biases is refused naming the sinks, and applied regardless changes the
    log-probs (removing key biases is refused for GPT-OSS's rotary keys first)."""
    cfg = io.family("GPT-OSS").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    with pytest.raises(cm.PreconditionError) as refused:
        cm.get_identity(identity).check(sd, cfg)
    flat = cfg.replace(positional_embedding_type="standard")  # no rotary: the sinks are what refuses
    with pytest.raises(cm.PreconditionError, match="sink") as refused:
        cm.get_identity(identity).check(cm.random_state_dict(flat, seed=0, dtype=F64), flat)
    assert refused.value.precondition is NO_ATTN_SINKS
    if identity == "fold_value_biases":
        assert not cm.get_identity(identity).check_wrong_rewrite("under_attention_sinks", sd, cfg).passed
        without = {k: v for k, v in sd.items() if not k.endswith(".sinks")}
        assert cm.get_identity(identity).check(without, cfg.replace(attn_sinks=False)).passed  # control


def test_heads_permute_with_their_sinks():
    cfg = io.family("GPT-OSS").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=F64)
    perm = torch.tensor([2, 3, 1, 0])  # whole key/value groups move
    out, out_cfg = cm.permute_heads(sd, cfg, perm)
    assert torch.equal(out["blocks.0.attn.sinks"], sd["blocks.0.attn.sinks"][perm])
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    stuck = dict(out, **{"blocks.0.attn.sinks": sd["blocks.0.attn.sinks"]})
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, stuck, cfg, after_cfg=out_cfg)


# -- check, streamed ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Mixtral", "Qwen2-MoE", "GPT-OSS"])
def test_check_runs_streamed_on_expert_folders(tmp_path, name):
    """check MODEL streams a sharded folder layer by layer with the in-memory check's verdicts;
    check --processed streams the processed folder against it, and names a planted change."""
    model, _config = _model(name, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "in", max_shard_size="40KB")
    tokens = _tokens()
    state_dict, cfg = io.open_checkpoint(tmp_path / "in").load()
    streamed = check_model_streaming(tmp_path / "in", tokens=tokens)
    in_memory = diagnosis.check_model(state_dict, cfg, tokens=tokens)
    assert [(f.name, f.status) for f in streamed.findings] == [(f.name, f.status) for f in in_memory.findings]
    assert streamed.ok and {"permute_experts", "fold_rms_norm"} <= {f.name for f in streamed.findings if f.status == "holds"}
    io.process_checkpoint(tmp_path / "in", tmp_path / "out", steps=("fold_ln", "center_unembed"))
    assert check_processed(tmp_path / "in", tmp_path / "out", tokens=tokens).ok
