"""The lexical shortlist: what it picks from parallel text, its file, and search held to it: outputs
made only of a line's own list, the same alone as in any batch, and the same as scoring the whole
vocabulary and masking it (the fast path multiplies by the union's rows alone)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from seq2seq.data.special_tokens import BOS_ID, EOS_ID, UNK_ID
from seq2seq.errors import UserInputError
from seq2seq.inference.shortlist import Shortlist, TargetLists, build_shortlist
from seq2seq.inference.translator import Translator


class Pieces:
    """A SentencePiece stand-in: pieces by id (0-3 the special ones)."""

    def __init__(self, words: list[str]) -> None:
        self.words = ["<pad>", "<unk>", "<s>", "</s>", *words]

    def get_piece_size(self) -> int:
        return len(self.words)

    def id_to_piece(self, index: int) -> str:
        return self.words[index]

    def piece_to_id(self, piece: str) -> int:
        return self.words.index(piece) if piece in self.words else UNK_ID


def test_each_source_piece_lists_its_translation_first_and_the_frequent_pieces_are_kept():
    source, target = Pieces(["▁cat", "▁dog", "▁the"]), Pieces(["▁gato", "▁perro", "▁el", "▁y"])
    cat, dog, the = 4, 5, 6
    gato, perro, el, y = 4, 5, 6, 7
    pairs = [([the, cat], [el, gato, y]), ([the, dog], [el, perro, y]), ([cat], [gato, y]), ([dog, the], [perro, el])]
    built = build_shortlist([s for s, _ in pairs], [t for _, t in pairs], source, target, per_source=2, frequent=1)
    # "▁y" and "▁el" are as frequent as each other (3 pairs), "▁y" comes first by count of tokens (3 = 3) then id
    assert built.frequent == ("▁el",)
    assert built.candidates["▁cat"][0] == "▁gato"  # Dice 2*2/(2+2) = 1
    assert built.candidates["▁dog"][0] == "▁perro"
    assert built.candidates["▁the"][0] == "▁el"
    assert all(len(targets) <= 2 for targets in built.candidates.values())


def test_the_file_is_a_ctranslate2_vocabulary_map_and_reads_back(tmp_path):
    shortlist = Shortlist(("▁el", "▁y"), {"▁cat": ("▁gato",), "▁dog": ("▁perro", "▁el")})
    path = tmp_path / "list.txt"
    shortlist.write(path)
    assert path.read_text(encoding="utf-8").splitlines() == ["\t▁el ▁y", "▁cat\t▁gato", "▁dog\t▁perro ▁el"]
    assert Shortlist.read(path) == shortlist


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("\t▁el\n▁cat ▁dog\t▁gato\n", "list.txt:2: expected 'source piece<TAB>target pieces'"),
     ("▁cat ▁gato\n", "list.txt:1: expected"),
     ("", "list.txt: an empty shortlist")],
)  # fmt: skip
def test_a_malformed_shortlist_is_named_by_line(tmp_path, text, fragment):
    path = tmp_path / "list.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserInputError, match=fragment):
        Shortlist.read(path)


def test_a_shortlist_of_another_vocabulary_is_refused():
    shortlist = Shortlist(("▁el",), {"▁cat": ("▁chat",)})
    with pytest.raises(UserInputError, match="target piece '▁chat' is not in the model's vocabulary"):
        shortlist.target_lists(Pieces(["▁cat"]), Pieces(["▁el", "▁gato"]))


def test_a_line_may_produce_its_pieces_lists_the_frequent_ones_and_the_special_ones():
    lists = Shortlist(("▁el",), {"▁cat": ("▁gato",), "▁dog": ("▁perro",)}).target_lists(
        Pieces(["▁cat", "▁dog"]), Pieces(["▁el", "▁gato", "▁perro", "▁y"])
    )
    assert lists.allowed([4]).tolist() == sorted([UNK_ID, BOS_ID, EOS_ID, 4, 5])
    assert lists.allowed([4, 5], extra=[7]).tolist() == sorted([UNK_ID, BOS_ID, EOS_ID, 4, 5, 6, 7])


# Search held to a shortlist, on the half-trained model of the tiny demo task.


@pytest.fixture(scope="module")
def model_and_lines(trained_checkpoint):
    path, data = trained_checkpoint
    lines = (data / "test.en").read_text(encoding="utf-8").splitlines()[:16]
    return Translator.load(path, device="cpu"), lines


def random_lists(translator: Translator, per_source: int, seed: int = 0) -> TargetLists:
    """Each source id gets `per_source` random target ids: lists far from the model's choices, so
    that they bind."""
    tokenizer = translator.bundle.tokenizer
    generator = np.random.default_rng(seed)
    size = tokenizer.tgt_vocab_size
    by_source = {i: generator.choice(np.arange(4, size), per_source, replace=False) for i in range(size)}
    return TargetLists(np.asarray([UNK_ID, BOS_ID, EOS_ID]), by_source)


def shortlisted(translator: Translator, lists: TargetLists) -> Translator:
    bundle = translator.bundle
    return Translator.from_model(bundle.model, bundle.tokenizer, translator.decode, bundle=bundle, shortlist=lists)


class MaskedModel(torch.nn.Module):
    """The plain reference, for one sentence at a time: the whole vocabulary scored, then the ids
    outside the sentence's list set to -inf."""

    def __init__(self, model, allowed: np.ndarray) -> None:
        super().__init__()
        self.model = model
        self.blocked = torch.ones(model.output_proj.out_features, dtype=torch.bool)
        self.blocked[torch.as_tensor(allowed)] = False

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def new_cache(self):
        return self.model.new_cache()

    def decode(self, tgt, memory, src_mask, cache):
        return self.model.decode(tgt, memory, src_mask, cache).masked_fill(self.blocked, -math.inf)


@pytest.mark.parametrize("beam", [1, 4])
def test_outputs_are_made_of_each_lines_own_list_and_equal_masking_the_whole_vocabulary(model_and_lines, beam):
    from seq2seq.data.batching import pad
    from seq2seq.inference.search import search

    translator, lines = model_and_lines
    tokenizer, model = translator.bundle.tokenizer, translator.bundle.model
    lists = random_lists(translator, per_source=6)
    held = shortlisted(translator, lists).translate_nbest(lines, beam=beam, nbest=1)
    free = translator.translate(lines, beam=beam)
    encoded = tokenizer.encode_src(lines)
    assert [t.text for t in held] != free  # the lists bind

    config = dataclasses.replace(translator.decode, beam=beam, nbest=1)
    reference = [search(MaskedModel(model, lists.allowed(ids)), pad([ids]), config)[0][0] for ids in encoded]
    for ids, found in zip(encoded, reference):  # pieces, not the text: a text may encode to other pieces
        assert set(found.tokens) <= set(lists.allowed(ids).tolist())
    assert [tokenizer.decode_tgt(found.tokens) for found in reference] == [t.text for t in held]
    assert [found.score for found in reference] == pytest.approx([t.nbest[0][1] for t in held], abs=1e-4)


def test_a_shortlisted_line_translates_alike_alone_and_in_any_batch(model_and_lines):
    translator, lines = model_and_lines
    held = shortlisted(translator, random_lists(translator, per_source=6))
    together = held.translate(lines, beam=4)
    assert [held.translate([line], beam=4)[0] for line in lines[:5]] == together[:5]
    assert held.translate(lines, beam=4, batch_tokens=16) == together  # one line a batch
    options = {"sample": True, "nbest": 3, "seed": 5}
    drawn = held.translate_nbest(lines, **options)[0].nbest
    alone = held.translate_nbest(lines[:1], **options)[0].nbest
    assert [text for text, _ in alone] == [text for text, _ in drawn]
    assert [score for _, score in alone] == pytest.approx([score for _, score in drawn], abs=1e-5)


def test_a_full_shortlist_changes_nothing(model_and_lines):
    translator, lines = model_and_lines
    size = translator.bundle.tokenizer.tgt_vocab_size
    everything = TargetLists(np.arange(size), {})  # PAD too: the plain search normalises over it, then bans it
    assert shortlisted(translator, everything).translate_nbest(lines, beam=4, nbest=2) == translator.translate_nbest(
        lines, beam=4, nbest=2
    )


def test_a_prefix_and_constraints_outside_the_list_still_hold(model_and_lines):
    translator, lines = model_and_lines
    held = shortlisted(translator, TargetLists(np.asarray([UNK_ID, BOS_ID, EOS_ID]), {}))  # nothing else allowed
    word = translator.translate(lines[:1])[0].split()[0]
    [out] = held.translate(lines[:1], beam=3, constraints=[[word]])
    assert word in out
    [out] = held.translate(lines[:1], beam=3, prefixes=[word])
    assert out.startswith(word)


def test_the_shortlist_command_builds_a_list_that_translate_and_eval_take(trained_checkpoint, tmp_path):
    from seq2seq.cli.main import app

    path, data = trained_checkpoint
    listed = tmp_path / "demo.shortlist"
    runner = CliRunner()
    built = runner.invoke(app, ["shortlist", str(path), "-o", str(listed), "--per-source", "10"])
    assert built.exit_code == 0, built.output
    assert Shortlist.read(listed).candidates
    again = runner.invoke(app, ["shortlist", str(path), "-o", str(listed)])
    assert again.exit_code == 2 and "already exists" in again.output  # never overwritten
    test = data / "test.en"
    done = runner.invoke(app, ["translate", "-c", str(path), "-i", str(test), "--shortlist", str(listed)])
    assert done.exit_code == 0, done.output
    assert len(done.stdout.splitlines()) == len(test.read_text().splitlines())
    scored = runner.invoke(
        app, ["eval", "-c", str(path), "--src", str(test), "--ref", str(data / "test.xx"), "--shortlist", str(listed)]
    )
    assert scored.exit_code == 0 and "BLEU" in scored.stdout
    broken = tmp_path / "broken.shortlist"
    broken.write_text("▁nothing\n", encoding="utf-8")
    refused = runner.invoke(app, ["translate", "-c", str(path), "-i", str(test), "--shortlist", str(broken)])
    assert refused.exit_code == 2 and "broken.shortlist:1: expected" in refused.output
