"""Evaluation: counts must match, one model pass gives hypotheses and scores, several references count."""

from __future__ import annotations

import pytest
import sacrebleu

from seq2seq.config import DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import score
from seq2seq.inference.translator import Translator

HYPOTHESES = ["the cat sat on the mat", "a dog barks loudly", "it rains"]
REFERENCES = ["the cat sat on a mat", "the dog barks loudly", "it is raining"]


def test_counts_must_match():
    with pytest.raises(UserInputError, match="3 hypotheses but 2 lines in reference set 1"):
        score(HYPOTHESES, [REFERENCES[:2]])
    with pytest.raises(UserInputError, match="3 sources but 2 references"):
        translate_and_score(None, HYPOTHESES, REFERENCES[:2], DecodeConfig())  # fails before using a model


def test_translate_and_score_scores_its_own_best_hypotheses(trained_checkpoint):
    path, data = trained_checkpoint  # a model that has begun to learn: BLEU well above 0
    sources = (data / "test.en").read_text(encoding="utf-8").splitlines()[:20]
    references = (data / "test.xx").read_text(encoding="utf-8").splitlines()[:20]
    translator = Translator.load(path, device="cpu")
    translator.decode = DecodeConfig(beam=2, nbest=2, max_len_a=1.5, max_len_b=5)
    evaluation = translate_and_score(translator, sources, references)
    # one best hypothesis per source, although n-best 2 was asked: the model's own best, scored by sacrebleu
    assert evaluation.hypotheses == translator.translate(sources) and evaluation.scores.bleu > 0
    assert evaluation.scores.bleu == pytest.approx(sacrebleu.corpus_bleu(evaluation.hypotheses, [references]).score)
    second = [r.upper() for r in references]
    both = translate_and_score(translator, sources, [references, second])
    expected = sacrebleu.corpus_bleu(evaluation.hypotheses, [references, second]).score
    assert both.scores.bleu == pytest.approx(expected) and both.scores.references == 2
