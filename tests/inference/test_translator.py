"""The Translator's contracts: a line's samples depend on the seed, its index and the settings alone;
guidance the target vocabulary cannot spell is refused before any work; what a line costs."""

from __future__ import annotations

import pytest

from seq2seq.errors import UserInputError
from seq2seq.inference.translator import Translator


@pytest.fixture(scope="module")
def translator(trained_checkpoint) -> Translator:
    return Translator.load(trained_checkpoint[0], device="cpu")


@pytest.fixture(scope="module")
def lines(trained_checkpoint) -> list[str]:
    return (trained_checkpoint[1] / "test.en").read_text(encoding="utf-8").splitlines()[:12]


def samples(translator: Translator, lines: list[str], **options) -> list[list[str]]:
    return [[text for text, _ in t.nbest] for t in translator.translate_nbest(lines, sample=True, nbest=4, **options)]


def test_a_lines_samples_do_not_change_with_the_lines_beside_it_or_the_batch_size(translator, lines):
    """The README's promise: the same line at the same index, seed and settings draws the same
    samples alone, in a batch of others, under another decode.batch_tokens."""
    together = samples(translator, lines, seed=9)
    assert samples(translator, lines[:1], seed=9)[0] == together[0]
    assert samples(translator, lines, seed=9, batch_tokens=16) == together  # one line per batch
    shuffled = lines[6:] + lines[:6]
    moved = samples(translator, shuffled, seed=9)
    numbered = translator.translate_with(shuffled, translator.settings(sample=True, nbest=4, seed=9),
                                         line_numbers=list(range(6, 12)) + list(range(6)))  # fmt: skip
    assert [[text for text, _ in t.nbest] for t in numbered] == together[6:] + together[:6]  # numbers, not places
    assert moved != together[6:] + together[:6]  # at other indices, other draws
    assert samples(translator, lines, seed=10) != together


def test_a_file_samples_alike_whatever_its_chunking(trained_checkpoint, tmp_path, monkeypatch):
    """`seq2seq translate` numbers a line by its place in the file, so chunks of 3 lines or 10,000
    draw the same samples."""
    from typer.testing import CliRunner

    from seq2seq.cli import file_translation as file_translation
    from seq2seq.cli.main import app

    path, data = trained_checkpoint
    source = tmp_path / "in.en"
    source.write_text("\n".join((data / "test.en").read_text().splitlines()[:8]) + "\n")
    command = ["translate", "-c", str(path), "-i", str(source), "--nbest", "3", "--set", "decode.sample=true"]
    whole = CliRunner().invoke(app, command, catch_exceptions=False)
    monkeypatch.setattr(file_translation, "FILE_CHUNK_LINES", 3)
    chunked = CliRunner().invoke(app, command, catch_exceptions=False)
    assert whole.exit_code == chunked.exit_code == 0
    assert [line.split(" ||| ")[:2] for line in chunked.stdout.splitlines()] == [
        line.split(" ||| ")[:2] for line in whole.stdout.splitlines()
    ]


@pytest.mark.parametrize("command", ["translate", "score-pairs"])
def test_a_files_progress_bar_moves_batch_by_batch(trained_checkpoint, tmp_path, monkeypatch, command):
    """`seq2seq translate`'s and `score-pairs`' bars count the lines of each batch as it finishes; they
    stood at 0 until a whole chunk (up to 10,000 lines, minutes of a large model's beam search) was done."""
    from typer.testing import CliRunner

    from seq2seq.cli import file_translation as file_translation
    from seq2seq.cli.main import app

    class RecordingBar:
        updates: list[int] = []

        def __init__(self, **options) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exception) -> None:
            pass

        def update(self, count: int) -> None:
            self.updates.append(count)

    monkeypatch.setattr(file_translation, "progress_bar", RecordingBar)
    path, data = trained_checkpoint
    source = tmp_path / "in.en"
    source.write_text("\n".join([*(data / "test.en").read_text().splitlines()[:30], ""]) + "\n")
    target = tmp_path / "in.xx"
    target.write_text("\n".join([*(data / "test.xx").read_text().splitlines()[:30], ""]) + "\n")
    inputs = ["-i", str(source)] if command == "translate" else ["--src", str(source), "--tgt", str(target)]
    arguments = [command, "-c", str(path), *inputs, "--set", "decode.batch_tokens=64"]
    result = CliRunner().invoke(app, arguments, catch_exceptions=False)
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 31
    assert sum(RecordingBar.updates) == 31  # the empty line too
    assert len([count for count in RecordingBar.updates if count]) >= 5


UNSPELLABLE = "\ua66e\ua66e"  # ꙮꙮ: a script the tiny model's vocabulary never saw


@pytest.mark.parametrize(
    ("guidance", "named"),
    [
        ({"constraints": [[], ["nugati", UNSPELLABLE]]}, "constraints[1]: 'ꙮꙮ' has characters the target vocabulary"),
        ({"prefixes": [f"la {UNSPELLABLE}", ""]}, "prefixes[0]: 'la ꙮꙮ' has characters the target vocabulary"),
    ],
)
def test_guidance_the_target_vocabulary_cannot_spell_is_refused(translator, lines, guidance, named):
    """Met by the unknown piece ⁇, such a constraint would be 'satisfied' and the output degrade."""
    with pytest.raises(UserInputError) as info:
        translator.translate(lines[:2], **guidance)
    assert str(info.value).startswith(named) and "('ꙮ')" in str(info.value)


def test_a_plan_counts_pieces_limits_and_hypotheses(translator):
    """What the server's work budget counts: source pieces (with EOS) x hypotheses x length limit,
    the limit raised by a prefix and by constraint tokens, and nothing for an empty line."""
    decode = translator.settings(beam=3, max_len_a=1.5, max_len_b=5)
    line = "the small cat sleeps"
    pieces = len(translator.bundle.tokenizer.encode_src([line])[0])
    plain, empty = translator.plan([line, ""], decode)
    assert (plain.source, plain.rows, plain.limit) == (pieces, 3, int(1.5 * pieces + 5))
    assert plain.work == pieces * 3 * int(1.5 * pieces + 5) and empty.work == 0
    (constrained,) = translator.plan([line], decode, constraints=[["nugati zucatar"]])
    extra = len(translator.bundle.tokenizer.encode_tgt(["nugati zucatar"])[0])
    assert constrained.limit == plain.limit + extra
    (sampled,) = translator.plan([line], translator.settings(sample=True, nbest=7))
    assert sampled.rows == 7


def test_a_run_directory_means_its_best_checkpoint_else_its_last(trained_checkpoint, translator, lines, tmp_path):
    saved = trained_checkpoint[0].read_bytes()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(saved)
    expected = translator.translate(lines, beam=2)
    assert Translator.load(tmp_path, device="cpu").translate(lines, beam=2) == expected
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")  # best.pt, when there is one, wins
    (tmp_path / "checkpoints" / "best.pt").write_bytes(saved)
    assert Translator.load(tmp_path, device="cpu").translate(lines, beam=2) == expected
    with pytest.raises(UserInputError, match="no model given; expected a checkpoint"):
        Translator.load([])  # an empty ensemble


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.translate("the cat sleeps"), "lines: got one str; expected a list of strings"),
        (lambda t: t.translate_nbest(["the cat", b"a dog"]), r"lines\[1\]: expected a str, got bytes"),
        (lambda t: t.translate(["the cat"], prefixes="la"), "prefixes: got one str"),
        (lambda t: t.translate(["the cat"], constraints=["la"]), r"constraints\[0\]: got one str"),
        (lambda t: t.score("the cat", "la nugati"), "sources: got one str"),
        (lambda t: t.score(["the cat"], [None]), r"targets\[0\]: expected a str, got NoneType"),
        (lambda t: t.translate(["the \udcff cat"]), r"lines\[0\]: holds a lone surrogate"),
    ],
)
def test_a_str_where_a_list_of_lines_belongs_is_refused(translator, call, message):
    """A str is iterable: taken for a list, it was translated character by character, a result
    that looks like an answer (and a constraint "la" became the constraints "l" and "a")."""
    with pytest.raises((TypeError, ValueError), match=message):
        call(translator)


def test_scoring_refuses_the_options_it_does_not_read(translator, lines):
    """A score is the given target's log-probability: a temperature or a beam would change nothing,
    so a call that sets one is refused rather than answered as if it had been honoured."""
    targets = translator.translate(lines[:2])
    with pytest.raises(UserInputError, match=r"options: decode.temperature: scoring given pairs does not use it"):
        translator.score(lines[:2], targets, temperature=0.5)
    raw = translator.score(lines[:2], targets, length_norm="none")
    assert [pair.score for pair in raw] == [pair.log_prob for pair in raw]


def test_translate_refuses_an_nbest_it_would_drop(translator, lines):
    """translate() returns one text per line: nbest=3 there was dropped unseen (and nbest=5 with beam=2,
    which the CLI refuses, passed); translate_nbest is the call that returns them."""
    with pytest.raises(UserInputError, match=r"options: nbest: translate\(\) returns the best .*translate_nbest"):
        translator.translate(lines[:1], nbest=3)
    assert translator.translate(lines[:1], nbest=1, beam=2) == [translator.translate_nbest(lines[:1], beam=2)[0].text]
