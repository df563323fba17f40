"""The zoo: models trained here load, are real (loss far below the bigram baseline, induction
heads where theory says they can exist), every identity holds on them, and training is
deterministic."""

import json
from pathlib import Path

import pytest
import torch

import circuitmath as cm
from circuitmath import zoo
from circuitmath.zoo import induction
from circuitmath.zoo import corpus_description, corpus_tokens
from circuitmath.zoo.train import RECIPES, STUDIED, STUDY_SEEDS, Recipe, baseline_losses, heldout_loss, render_card, train, weights_digest

ZOO = Path(zoo.__file__).parent


def _missing_corpus() -> str | None:
    try:
        corpus_tokens("train"), corpus_tokens("heldout")
    except cm.CircuitMathError as error:
        return str(error)
    return None


#: Training and its baselines read the standard library's source, which some Python builds leave out.
needs_corpus = pytest.mark.skipif(_missing_corpus() is not None, reason=f"{_missing_corpus()}")


@pytest.fixture(scope="module", params=zoo.NAMES)
def model(request):
    sd, cfg = zoo.load(request.param)
    return request.param, sd, cfg


def _real_tokens(cfg, batch=2):
    """Windows of held-out standard-library source, the text the models were trained on."""
    text = corpus_tokens("heldout")
    return torch.stack([text[i * 5003: i * 5003 + cfg.n_ctx] for i in range(batch)])


def test_the_zoo_is_small_and_complete():
    files = sorted(p.name for p in ZOO.iterdir() if p.suffix in (".safetensors", ".json", ".md"))
    expected = [f"{n}{ext}" for n in zoo.NAMES for ext in (".safetensors", ".json", ".md")]
    assert files == sorted(expected + [f"study_{n}.json" for n in STUDIED] + ["study_controls.json"])
    total = sum(p.stat().st_size for p in ZOO.iterdir() if p.suffix in (".safetensors", ".json", ".md"))
    assert total <= 10 * 2**20, f"the zoo takes {total / 2**20:.1f} MB"
    with pytest.raises(KeyError, match="known"):
        zoo.load("gpt2")


def test_each_model_is_what_its_name_says(model):
    name, sd, cfg = model
    assert cfg == RECIPES[name].cfg
    assert cfg.norm_position == "pre" and cfg.normalization_type == "LN" and cfg.d_vocab == 256
    assert cfg.attn_only == name.startswith("attn_only")
    assert cfg.n_layers == (1 if name.endswith("1l") else 2)
    assert cfg.positional_embedding_type == ("shortformer" if "shortformer" in name else "standard")
    assert {t.dtype for t in sd.values()} == {torch.float32}
    assert weights_digest(sd) == zoo.card(name)["weights_sha256"]
    sd64, _ = zoo.load(name, dtype=torch.float64)
    assert all(sd64[k].dtype == torch.float64 and torch.equal(sd64[k].float(), sd[k]) for k in sd)


def test_model_card_reports_what_the_issue_asks(model):
    name, sd, cfg = model
    card = zoo.card(name)
    for key in ("corpus", "tokens_seen", "steps", "losses", "recipe", "history", "induction"):
        assert key in card, key
    assert card["tokens_seen"] == card["steps"] * card["recipe"]["batch"] * cfg.n_ctx
    assert card["parameters"] == sum(t.numel() for t in sd.values())
    losses = card["losses"]
    for key in ("final_train", "heldout", "unigram_in_sample", "bigram_in_sample", "unigram_heldout", "bigram_heldout"):
        assert key in losses, key
    assert card["corpus"]["python"] and len(card["corpus"]["train"]["sha256"]) == 64
    assert (ZOO / f"{name}.md").read_text() == render_card(card)


@needs_corpus
def test_loss_is_far_below_the_bigram_baseline(model):
    """Recomputed here on this machine's held-out text, not just read from the card."""
    name, sd, cfg = model
    heldout, train_text = corpus_tokens("heldout"), corpus_tokens("train")
    loss = heldout_loss(sd, cfg, heldout)
    baselines = baseline_losses(train_text, heldout)
    assert loss < baselines["bigram_in_sample"] - 0.3, (loss, baselines)
    assert loss < baselines["bigram_heldout"] - 0.4
    card = zoo.card(name)
    if card["corpus"]["heldout"]["sha256"] == corpus_description()["heldout"]["sha256"]:
        assert loss == pytest.approx(card["losses"]["heldout"], abs=1e-5)
        assert baselines == pytest.approx({k: card["losses"][k] for k in baselines}, abs=1e-9)


def test_baselines_on_a_text_whose_answer_is_known():
    text = torch.tensor([97, 98] * 500)  # "abab...": one bit per byte for a unigram, nothing for a bigram
    out = baseline_losses(text, text)
    assert out["unigram_in_sample"] == pytest.approx(torch.log(torch.tensor(2.0)).item())
    assert out["bigram_in_sample"] == pytest.approx(0.0, abs=1e-12)


def test_every_identity_holds_or_refuses_on_every_zoo_model(model):
    """In float64 (the stored float32 values, exactly), where the tolerances are tight."""
    name, sd, cfg = model
    sd = {k: v.double() for k, v in sd.items()}
    results = zoo.check_identities(sd, cfg, _real_tokens(cfg))
    assert [r.identity for r in results] == [i.name for i in cm.identities()]
    for r in results:
        assert r.passed, (name, r)
        assert r.applicable or r.reason
    applicable = {r.identity for r in results if r.applicable}
    assert {"fold_layer_norm", "center_reading_weights"} <= applicable


def test_run_with_patterns_is_the_reference_forward_pass(model):
    name, sd, cfg = model
    sd = {k: v.double() for k, v in sd.items()}
    tokens = induction.repeated_random_tokens(2, 30)
    with torch.no_grad():
        logits, patterns, heads, _scale = induction.run_with_patterns(sd, cfg, tokens)
        assert torch.allclose(logits, cm.forward(sd, cfg, tokens), atol=1e-10, rtol=0)
    assert len(patterns) == len(heads) == cfg.n_layers
    assert torch.allclose(patterns[0].sum(-1), torch.ones((), dtype=torch.float64), atol=1e-12)


def _scores(name):
    sd, cfg = zoo.load(name)
    return induction.induction_summary(sd, cfg, batch=16, length=50, seed=7), sd, cfg


@pytest.mark.parametrize("name", STUDIED)
def test_two_layer_attention_only_models_have_induction_heads(name):
    scores, sd, cfg = _scores(name)
    prefix = torch.tensor(scores["prefix_matching"])
    copying = torch.tensor(scores["direct_logit_attribution"])
    previous = torch.tensor(scores["previous_token"])
    head = int(prefix[1].argmax())
    assert prefix[1, head] > 0.3, prefix  # attends to what followed the earlier copy
    assert copying[1, head] > 1.0, copying  # and raises that token's logit
    assert previous[0].max() > 0.3, previous  # fed by a previous-token head in layer 0
    assert scores["loss_second_half"] < scores["loss_first_half"] - 1.0
    # K-composition picks out the pair: the largest score over all (layer-0, layer-1) pairs has the
    # induction head on the key side, and a head attending to the previous token (six times the
    # ~0.05 a uniform pattern gives) on the writing side.
    k_comp = torch.tensor(scores["composition"]["K"])  # [layer-0 head, layer-1 head]
    writer, reader = divmod(int(k_comp.argmax()), k_comp.shape[1])
    assert reader == head, k_comp
    assert previous[0, writer] > 0.25, (writer, previous)
    assert k_comp[writer, reader] > 1.5 * k_comp.median()


def test_one_layer_has_no_induction_head_negative_control():
    """The same scores on a model that cannot compose heads stay low: the test can fail."""
    scores, _sd, _cfg = _scores("attn_only_1l")
    assert max(scores["prefix_matching"][0]) < 0.1
    assert scores["loss_second_half"] > scores["loss_first_half"] - 1.0


@needs_corpus
def test_training_is_deterministic_and_reaches_the_card():
    cfg = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=256, n_ctx=32,
                    positional_embedding_type="shortformer")
    recipe = Recipe("tiny", cfg, seed=5, steps=6, batch=2, lr=1e-2, warmup=2, eval_every=3)
    first = train("attn_only_2l_shortformer", recipe=recipe, log=lambda line: None)
    second = train("attn_only_2l_shortformer", recipe=recipe, log=lambda line: None)
    assert first[2]["weights_sha256"] == second[2]["weights_sha256"]
    assert all(torch.equal(first[0][k], second[0][k]) for k in first[0])
    assert first[1] == cfg and [p["step"] for p in first[2]["history"]] == [1, 3, 6]
    json.dumps(first[2])  # the card is plain JSON
    other = train("attn_only_2l_shortformer", recipe=Recipe("tiny", cfg, seed=6, steps=6, batch=2, lr=1e-2, warmup=2),
                  log=lambda line: None)
    assert other[2]["weights_sha256"] != first[2]["weights_sha256"]


@pytest.mark.parametrize("name", STUDIED)
def test_the_shortformer_study_is_recorded(name):
    study = json.loads((ZOO / f"study_{name}.json").read_text())
    assert study["model"] == name
    assert [r["seed"] for r in study["runs"]] == list(STUDY_SEEDS)
    for run in study["runs"]:
        assert [p["step"] for p in run["history"]][-1] == RECIPES[name].steps
    shipped = next(r for r in study["runs"] if r["seed"] == RECIPES[name].seed)
    assert shipped["weights_sha256"] == zoo.card(name)["weights_sha256"]  # the study reran the shipped model


@needs_corpus
def test_check_refuses_a_different_corpus(monkeypatch, capsys):
    """Reproduction needs the same standard-library text; another Python's is refused up front."""
    from circuitmath.zoo import train as training

    def other_python():
        out = corpus_description()
        out["train"] = dict(out["train"], sha256="0" * 64)
        return out

    monkeypatch.setattr(training, "corpus_description", other_python)
    monkeypatch.setattr(training, "train", lambda *a, **k: pytest.fail("training started"))
    assert training.main(["--check", "--only", "attn_only_1l"]) == 2
    assert "cannot reproduce" in capsys.readouterr().err


def test_a_python_without_its_standard_library_source_is_named(tmp_path, monkeypatch):
    from circuitmath.zoo import _corpus

    monkeypatch.setattr(_corpus, "_stdlib", lambda: tmp_path)
    with pytest.raises(cm.CircuitMathError, match=f"train corpus .*{tmp_path / 'argparse.py'} is not there"):
        corpus_tokens("train")
