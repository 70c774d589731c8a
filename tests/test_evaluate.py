"""Evaluation: counts must match, one model pass gives hypotheses and scores, several references count."""

from __future__ import annotations

import pytest

from seq2seq.config import DecodeConfig, ModelConfig, TokenizerConfig
from seq2seq.errors import UserInputError
from seq2seq.evaluate import translate_and_score
from seq2seq.model import build_model
from seq2seq.scoring import score
from seq2seq.tokenizer import Tokenizer, train_tokenizer
from seq2seq.translator import Translator

HYPOTHESES = ["the cat sat on the mat", "a dog barks loudly", "it rains"]
REFERENCES = ["the cat sat on a mat", "the dog barks loudly", "it is raining"]


def test_counts_must_match():
    with pytest.raises(UserInputError, match="3 hypotheses but 2 lines in reference set 1"):
        score(HYPOTHESES, [REFERENCES[:2]])
    with pytest.raises(UserInputError, match="3 sources but 2 references"):
        translate_and_score(None, HYPOTHESES, REFERENCES[:2], DecodeConfig())  # fails before using a model


def test_translate_and_score_scores_its_own_best_hypotheses(demo_pairs):
    tokenizer: Tokenizer = train_tokenizer(TokenizerConfig(vocab_size=300), demo_pairs["train"][:500])
    model = build_model(ModelConfig(d_model=32, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=64), tokenizer)
    sources, references = [s for s, _ in demo_pairs["test"][:8]], [t for _, t in demo_pairs["test"][:8]]
    translator = Translator.from_model(model.eval(), tokenizer, DecodeConfig(beam=2, nbest=2, max_len_b=3))
    evaluation = translate_and_score(translator, sources, references)
    assert len(evaluation.hypotheses) == 8  # one best hypothesis per source, although n-best 2 was asked
    assert evaluation.scores == score(evaluation.hypotheses, [references])
    second = [r.upper() for r in references]
    both = translate_and_score(translator, sources, [references, second])
    assert both.scores == score(evaluation.hypotheses, [references, second]) and both.scores.references == 2
