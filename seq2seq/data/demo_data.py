"""The embedded demo task: a seeded synthetic translation corpus that needs what real translation needs.

The source is English-like (SVO, adjectives before nouns). The target is an invented language with
its own vocabulary, SOV order, adjectives after nouns, and agreement: determiners and adjectives
take the gender and number of their noun (gender is a property of the *target* noun, invisible in
the source word), verbs take the tense and the subject's number. So neither copying nor a
word-by-word table can solve it. Sentences have 3 to 30 words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from seq2seq.files import write_text_atomic

_SOURCE_NOUNS = (
    "cat dog bird horse child farmer teacher doctor king queen friend baker singer painter soldier "
    "sailor student driver monkey tiger lion wolf fox rabbit mouse girl boy woman man neighbor artist "
    "pilot dancer writer hunter guard miner cook judge thief"
).split()
_SOURCE_OBJECTS = (
    "apple book house car river tree letter song bread cake ball door window garden table chair boat "
    "flower stone road lamp coin map box bell"
).split()
_SOURCE_ADJECTIVES = (
    "big small red green old young happy sad quiet loud tall short dark bright warm cold clever lazy brave kind"
).split()
_SOURCE_VERBS_TRANSITIVE = ("see like want find paint carry watch open follow call help clean push pull visit").split()
_SOURCE_VERBS_INTRANSITIVE = ("sleep walk laugh dance jump work wait cry").split()
_SOURCE_ADVERBS = ("quickly slowly often never today again loudly gladly").split()
_SOURCE_PREPOSITIONS = ("near behind under with").split()
_CONJUNCTIONS = {"and": "ed", "but": "ma"}

_TARGET_DETERMINERS = {  # (definite, gender, plural) -> word
    (True, "m", False): "il",
    (True, "f", False): "la",
    (True, "m", True): "ei",
    (True, "f", True): "le",
    (False, "m", False): "un",
    (False, "f", False): "una",
    (False, "m", True): "dei",
    (False, "f", True): "delle",
}
_ADJECTIVE_ENDINGS = {("m", False): "o", ("f", False): "a", ("m", True): "i", ("f", True): "e"}
_NOUN_PLURAL_ENDINGS = {"m": "in", "f": "es"}
_VERB_ENDINGS = {("present", False): "ar", ("present", True): "aron", ("past", False): "ut", ("past", True): "uton"}

_ONSETS = ["b", "c", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "pl", "st", "gr"]
_VOWELS = ["a", "e", "i", "o", "u"]


@dataclass(frozen=True)
class Lexicon:
    """The fixed vocabulary mapping of the two languages."""

    noun_stems: dict[str, tuple[str, str]]  # source noun -> (target stem, gender)
    adjective_stems: dict[str, str]
    verb_stems: dict[str, str]
    words: dict[str, str]  # adverbs and prepositions: uninflected


def build_lexicon(seed: int = 7) -> Lexicon:
    """Invent target words: distinct pseudo-syllable stems, genders drawn at random."""
    rng = random.Random(seed)
    used: set[str] = set()

    def invent(syllables: int) -> str:
        while True:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
            word += rng.choice("lnrst")  # stems end in a consonant so endings attach cleanly
            if word not in used:
                used.add(word)
                return word

    nouns = {noun: (invent(rng.choice((1, 2))), rng.choice("mf")) for noun in _SOURCE_NOUNS + _SOURCE_OBJECTS}
    return Lexicon(
        noun_stems=nouns,
        adjective_stems={adj: invent(rng.choice((1, 2))) for adj in _SOURCE_ADJECTIVES},
        verb_stems={verb: invent(2) for verb in _SOURCE_VERBS_TRANSITIVE + _SOURCE_VERBS_INTRANSITIVE},
        words={word: invent(2) for word in _SOURCE_ADVERBS + _SOURCE_PREPOSITIONS},
    )


_IRREGULAR_PAST = {"see": "saw", "find": "found", "sleep": "slept", "carry": "carried", "cry": "cried"}


def _english_verb(verb: str, *, tense: str, plural: bool) -> str:
    if tense == "past" and verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if tense == "past":
        return verb + ("d" if verb.endswith("e") else "ed")
    if plural:
        return verb
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + ("es" if verb.endswith(("sh", "ch", "x")) else "s")


class _SentenceMaker:
    """Draws one parallel sentence at a time from the grammar, rendering both languages."""

    def __init__(self, lexicon: Lexicon, rng: random.Random) -> None:
        self.lex = lexicon
        self.rng = rng

    def noun_phrase(self, nouns: list[str], *, max_adjectives: int, allow_pp: bool) -> tuple[list, list, bool]:
        rng, lex = self.rng, self.lex
        noun = rng.choice(nouns)
        plural = rng.random() < 0.35
        definite = rng.random() < 0.6
        adjectives = rng.sample(_SOURCE_ADJECTIVES, rng.randint(0, max_adjectives))
        stem, gender = lex.noun_stems[noun]
        src_det = "the" if definite else ("some" if plural else "a")
        src = [src_det, *adjectives, noun + ("s" if plural else "")]
        tgt_noun = stem + (_NOUN_PLURAL_ENDINGS[gender] if plural else "")
        ending = _ADJECTIVE_ENDINGS[(gender, plural)]
        tgt = [_TARGET_DETERMINERS[(definite, gender, plural)], tgt_noun]
        tgt += [lex.adjective_stems[adj] + ending for adj in adjectives]
        if allow_pp and rng.random() < 0.3:
            prep = rng.choice(_SOURCE_PREPOSITIONS)
            inner_src, inner_tgt, _ = self.noun_phrase(_SOURCE_OBJECTS, max_adjectives=1, allow_pp=False)
            src += [prep, *inner_src]
            tgt += [self.lex.words[prep], *inner_tgt]
        return src, tgt, plural

    def clause(self) -> tuple[list[str], list[str]]:
        rng, lex = self.rng, self.lex
        subj_src, subj_tgt, plural = self.noun_phrase(_SOURCE_NOUNS, max_adjectives=2, allow_pp=True)
        tense = rng.choice(("present", "past"))
        transitive = rng.random() < 0.7
        verb = rng.choice(_SOURCE_VERBS_TRANSITIVE if transitive else _SOURCE_VERBS_INTRANSITIVE)
        verb_src = _english_verb(verb, tense=tense, plural=plural)
        verb_tgt = lex.verb_stems[verb] + _VERB_ENDINGS[(tense, plural)]
        obj_src, obj_tgt = [], []
        if transitive:
            obj_src, obj_tgt, _ = self.noun_phrase(_SOURCE_OBJECTS, max_adjectives=2, allow_pp=True)
        adverb = [rng.choice(_SOURCE_ADVERBS)] if rng.random() < 0.3 else []
        src = subj_src + [verb_src] + obj_src + adverb  # SVO, adverb last
        tgt = subj_tgt + obj_tgt + [lex.words[a] for a in adverb] + [verb_tgt]  # SOV, adverb before verb
        return src, tgt

    def sentence(self) -> tuple[str, str]:
        while True:
            src, tgt = self.clause()
            if self.rng.random() < 0.35:
                conj = self.rng.choice(sorted(_CONJUNCTIONS))
                src2, tgt2 = self.clause()
                src, tgt = src + [conj] + src2, tgt + [_CONJUNCTIONS[conj]] + tgt2
            if 3 <= len(src) <= 30:
                return " ".join(src), " ".join(tgt)


DEMO_SPLITS = {"train": 30_000, "valid": 500, "test": 1_000}


def make_demo_corpus(seed: int = 1, sizes: dict[str, int] = DEMO_SPLITS) -> dict[str, list[tuple[str, str]]]:
    """Sentence pairs per split; valid and test sentences never occur in train."""
    maker = _SentenceMaker(build_lexicon(), random.Random(seed))
    seen: set[str] = set()
    corpus = {}
    for split, size in sizes.items():
        pairs: list[tuple[str, str]] = []
        while len(pairs) < size:
            src, tgt = maker.sentence()
            if split == "train" or src not in seen:
                pairs.append((src, tgt))
                seen.add(src)
        corpus[split] = pairs
    return corpus


def demo_corpus_files(*, seed: int = 1, src_lang: str = "en", tgt_lang: str = "xx") -> dict[str, str]:
    """The corpus as {split}.{lang} file names and their text (same seed, same bytes)."""
    return {
        f"{split}.{lang}": "".join(pair[side] + "\n" for pair in pairs)
        for split, pairs in make_demo_corpus(seed).items()
        for lang, side in ((src_lang, 0), (tgt_lang, 1))
    }


def write_demo_corpus(out_dir: str | Path, files: dict[str, str] | None = None) -> Path:
    """Write the corpus's files (demo_corpus_files(), unless given) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (files or demo_corpus_files()).items():
        write_text_atomic(out / name, text)
    return out
