"""all-MiniLM-L6-v2, a real pretrained BERT (post-LN), converted to the reference conventions:
the conversion reproduces HF's BertModel, and every registered identity holds on its real
weights and real token inputs, or refuses with its reason."""

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import zoo

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Induction heads attend to the token after the previous occurrence of the current token.",
    "LayerNorm after the residual sum cannot be folded into the next layer's weights.",
)


@pytest.fixture(scope="module")
def minilm():
    return zoo.load_minilm()


@pytest.fixture(scope="module")
def hf_bert():
    return transformers.BertModel.from_pretrained(str(zoo.minilm_directory()), attn_implementation="eager").eval()


def test_conversion_is_the_architecture_we_expect(minilm):
    sd, cfg = minilm
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == (6, 384, 12, 32, 1536, 30522)
    assert cfg.norm_position == "post" and cfg.embedding_norm and not cfg.causal and cfg.eps == 1e-12
    assert {t.dtype for t in sd.values()} == {torch.float32}


def _kurtosis(x: torch.Tensor) -> float:
    x = x.flatten().double()
    return float(((x - x.mean()) ** 4).mean() / x.var(unbiased=False) ** 2)


def _identity_unembed(sd, cfg):
    """A copy whose unembed is ``[I | 0]``: the first ``d_model`` logits are the final residual stream."""
    probe = dict(sd)
    probe["unembed.W_U"] = torch.cat([torch.eye(cfg.d_model), torch.zeros(cfg.d_model, cfg.d_vocab - cfg.d_model)], 1)
    return probe


def test_real_weights_have_the_structure_random_ones_lack(minilm):
    """Heavy-tailed norm gains and biases (a Gaussian's kurtosis is 3) and an outlier dimension
    of the residual stream, measured on the real weights."""
    sd, cfg = minilm
    assert _kurtosis(sd["embed.ln.w"]) > 20 and _kurtosis(sd["embed.ln.b"]) > 20
    assert _kurtosis(sd["blocks.0.ln1.w"]) > 20
    with torch.no_grad():
        hidden = cm.forward(_identity_unembed(sd, cfg), cfg, zoo.minilm_tokens(SENTENCES[0]))[0, :, : cfg.d_model]
    size = hidden.abs().mean(0)
    assert size.max() > 5 * size.median()


@pytest.mark.parametrize("sentence", SENTENCES)
def test_hidden_states_match_hf_bert(minilm, hf_bert, sentence):
    sd, cfg = minilm
    tokens = zoo.minilm_tokens(sentence)
    with torch.no_grad():
        hidden = hf_bert(tokens).last_hidden_state
        ours = cm.forward(_identity_unembed(sd, cfg), cfg, tokens)[..., : cfg.d_model]
        logits = cm.forward(sd, cfg, tokens)
    assert float((ours - hidden).abs().max()) <= 1e-4
    assert float((logits - hidden @ sd["embed.W_E"].T).abs().max()) <= 1e-4 * max(1.0, float(logits.abs().max()))


def test_mean_pooled_sentence_embedding_matches_hf(minilm, hf_bert):
    """The sentence embedding (mean over tokens, then unit norm) of the converted model."""
    sd, cfg = minilm
    tokens = zoo.minilm_tokens(SENTENCES[0])
    with torch.no_grad():
        ours = torch.nn.functional.normalize(cm.forward(_identity_unembed(sd, cfg), cfg, tokens)[0, :, : cfg.d_model].mean(0), dim=0)
        theirs = torch.nn.functional.normalize(hf_bert(tokens).last_hidden_state[0].mean(0), dim=0)
    assert float((ours - theirs).abs().max()) <= 1e-5


def test_negative_control_a_missing_embedding_norm_is_caught(minilm, hf_bert):
    sd, cfg = minilm
    tokens = zoo.minilm_tokens(SENTENCES[1])
    wrong = {k: v for k, v in sd.items() if not k.startswith("embed.ln")}
    with torch.no_grad():
        expected = hf_bert(tokens).last_hidden_state @ sd["embed.W_E"].T
        got = cm.forward(wrong, cfg.replace(embedding_norm=False), tokens)
    assert float((got - expected).abs().max()) > 1.0


def test_every_identity_holds_or_refuses_with_its_reason(minilm):
    sd, cfg = minilm
    tokens = zoo.minilm_tokens(SENTENCES[1])
    results = zoo.check_identities(sd, cfg, tokens)
    assert [r.identity for r in results] == [i.name for i in cm.identities()]
    for r in results:
        assert r.passed, r
        assert r.applicable or r.reason, f"{r.identity} refused without a reason"
    refused = {r.identity: r.reason for r in results if not r.applicable}
    assert "post-norm" in refused["fold_layer_norm"]
    # 72 heads x 30,522^2 float64 entries: the dense spectra it compares with would take 500 GiB
    assert "fit in memory" in refused["eigenvalues_ab_ba"]
    assert {"fold_value_biases", "refactor_factored_attn_matrices"} <= {r.identity for r in results if r.applicable}
