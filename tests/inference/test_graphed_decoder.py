"""The fixed-buffer decoder (graphed_decoder.py) decodes exactly as the model's growing KV cache:
greedy and beam, sentences finishing at different steps, beams reordered, buffers outgrown. On CPU
the fixed-buffer step runs eagerly; on a GPU (`pytest -m gpu`) the same checks replay CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from seq2seq.config import DecodeConfig, ModelConfig
from seq2seq.data.special_tokens import EOS_ID, PAD_ID
from seq2seq.inference.graphed_decoder import LENGTH_STEP, GraphedDecoder, graphs_apply
from seq2seq.inference.search import search
from seq2seq.model.transformer import Seq2SeqTransformer


def eos_prone_model(device: str = "cpu") -> Seq2SeqTransformer:
    """A random tiny model whose EOS logit is raised, so sentences end on their own at different steps."""
    torch.manual_seed(3)
    config = ModelConfig(d_model=32, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0)
    model = Seq2SeqTransformer(config, src_vocab_size=30, tgt_vocab_size=30)
    with torch.no_grad():
        model.output_proj.weight[EOS_ID] += 0.6 * model.output_proj.weight[5]
    return model.to(device).eval()


def mixed_batch(device: str = "cpu") -> torch.Tensor:
    """Six sources of lengths 9 down to 2 (length limits 2 * length differ per sentence)."""
    torch.manual_seed(4)
    src = torch.randint(4, 30, (6, 9))
    for row, length in enumerate((9, 7, 2, 5, 3, 8)):
        src[row, length:] = PAD_ID
    return src.to(device)


def assert_same_search(model, decoder, src, config: DecodeConfig) -> list[int]:
    """Both decoders give the same hypotheses (tokens, and scores to float tolerance); returns the lengths."""
    expected, got = search(model, src, config), search(decoder, src, config)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps_a, hyps_b in zip(got, expected):
        for a, b in zip(hyps_a, hyps_b):
            assert a.score == pytest.approx(b.score, abs=1e-4)
    return [len(hyps[0].tokens) for hyps in expected]


SEARCHES = [
    DecodeConfig(beam=1, max_len_a=2.0, max_len_b=0, min_len=0),
    DecodeConfig(beam=4, nbest=3, max_len_a=2.0, max_len_b=0, min_len=0),
    DecodeConfig(beam=3, max_len_a=2.0, max_len_b=0, min_len=2, no_repeat_ngram=2),
]


@pytest.mark.parametrize("config", SEARCHES, ids=["greedy", "beam4-nbest3", "beam3-no-repeat"])
def test_fixed_buffers_decode_as_the_growing_cache(config):
    model = eos_prone_model()
    lengths = assert_same_search(model, GraphedDecoder(model, graphs=False), mixed_batch(), config)
    assert len(set(lengths)) > 2, lengths  # sentences ended at different steps: rows left the batch


def test_buffers_grow_when_a_search_outgrows_them():
    model = eos_prone_model()
    with torch.no_grad():
        model.output_proj.weight[EOS_ID] = 0.0  # nothing ends before the length limit
    src = mixed_batch()[:, :2]  # two source positions: the first buffers hold LENGTH_STEP positions
    config = DecodeConfig(beam=2, max_len_a=0.0, max_len_b=3 * LENGTH_STEP, min_len=0)
    lengths = assert_same_search(model, GraphedDecoder(model, graphs=False), src, config)
    assert max(lengths) > 2 * LENGTH_STEP


def test_graphs_apply_only_to_our_model_in_eval_mode_on_a_gpu():
    model = eos_prone_model()
    assert not graphs_apply(model)  # on the CPU
    assert not graphs_apply(object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", SEARCHES, ids=["greedy", "beam4-nbest3", "beam3-no-repeat"])
def test_cuda_graph_replays_decode_as_the_eager_model(config):
    model = eos_prone_model("cuda")
    assert graphs_apply(model)
    decoder = GraphedDecoder(model)
    assert_same_search(model, decoder, mixed_batch("cuda"), config)
    assert_same_search(model, decoder, mixed_batch("cuda")[:4], config)  # another shape, a second graph
    assert_same_search(model, decoder, mixed_batch("cuda"), config)  # the first graph, reused
    assert all(step.graph is not None for step in decoder._steps.values())
