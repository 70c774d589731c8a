"""A glossary entry applies to the lines that contain its source term as whole words, whatever the size
of the glossary: the word index finds exactly what a search for each term finds."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seq2seq.inference.glossary import Glossary

# Letters, digits, the underscore, spaces, punctuation, a combining accent and non-Latin letters: the
# characters on both sides of the word-character line.
CHARACTERS = st.sampled_from(list("ab_1 .-'(") + ["\u0301", "é", "ß", "Ж", "語", "\t"])
TEXT = st.text(CHARACTERS, min_size=0, max_size=12)


def searched_term_by_term(entries: list[tuple[str, str]], line: str) -> list[str]:
    """What the definition says: each term searched for with no word character right before or after it."""
    return [target for source, target in entries if re.search(rf"(?<!\w){re.escape(source)}(?!\w)", line)]


@settings(max_examples=400, deadline=None)
@given(
    line=TEXT,
    sources=st.lists(TEXT.filter(bool), max_size=6),
    cuts=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), max_size=6),
)
def test_the_index_finds_what_a_search_per_term_finds(line, sources, cuts):
    pieces = [line[start : start + length] for start, length in cuts]  # terms taken from the line match often
    entries = [(source, f"t{index}") for index, source in enumerate([*sources, *filter(None, pieces)])]
    assert Glossary(entries).constraints(line) == searched_term_by_term(entries, line)


def test_whole_words_and_file_order():
    glossary = Glossary([("Lord God", "Señor Dios"), ("Lord", "Señor"), ("God", "Dios"), ("(c)", "©"), ("od", "x")])
    assert glossary.constraints("the Lord God said") == ["Señor Dios", "Señor", "Dios"]
    assert glossary.constraints("Lordship and lord, Godly") == []
    assert glossary.constraints("God_ (c) 2026 Lord.") == ["Señor", "©"]


def test_a_glossary_keeps_the_entries_it_was_given():
    """Its index is built on first use: entries changed afterwards would be silently ignored."""
    callers_entries = [("Lord", "Señor")]
    glossary = Glossary(callers_entries)
    assert glossary.constraints("the Lord God") == ["Señor"]
    callers_entries.append(("God", "Dios"))  # the list stays the caller's
    assert glossary.constraints("the Lord God") == ["Señor"]
    with pytest.raises(AttributeError):
        glossary.entries.append(("God", "Dios"))
