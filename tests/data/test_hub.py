"""A dataset named on the HuggingFace hub, on a machine that cannot reach the hub: one connection
tells, the load runs offline (the local cache only), and a dataset not cached is one line. The
hub's address is pointed at a local port here, so no test needs or depends on the network."""

from __future__ import annotations

import socket

import datasets.config
import huggingface_hub.constants
import pytest

from seq2seq.config import CorpusConfig
from seq2seq.data.hub import hub_unreachable
from seq2seq.data.sources import read_corpus
from seq2seq.errors import UserInputError


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again: a connection to it is refused


def test_the_hub_is_reachable_when_it_accepts_a_connection(monkeypatch, closed_port):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert hub_unreachable() is None
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed_port}")
    assert hub_unreachable() == "127.0.0.1: Connection refused"


def test_behind_a_proxy_the_proxy_is_what_must_answer(monkeypatch, closed_port):
    """A network that lets nothing out but through its proxy still reaches the hub; NO_PROXY exempts it."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"https://127.0.0.2:{closed_port}")
    for variable in ("NO_PROXY", "no_proxy", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{proxy.getsockname()[1]}")
        assert hub_unreachable() is None
        monkeypatch.setenv("NO_PROXY", "127.0.0.2")
        assert hub_unreachable() == "127.0.0.2: Connection refused"
    monkeypatch.delenv("NO_PROXY")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port}")
    assert hub_unreachable() == "127.0.0.1 (the proxy for 127.0.0.2): Connection refused"


def test_a_hub_dataset_that_cannot_be_fetched_or_found_in_the_cache_is_one_line(monkeypatch, closed_port, caplog):
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed_port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    offline_before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    corpus = CorpusConfig(format="hf", name="seq2seq-tests/never-published", subset="de-en")
    with pytest.raises(UserInputError) as caught:
        read_corpus(corpus, src_lang="de", tgt_lang="en", key="data.train")
    assert str(caught.value).startswith(
        "data.train.name: seq2seq-tests/never-published: the HuggingFace hub cannot be reached from here "
        "(127.0.0.1: Connection refused) and the dataset is not in the local cache"
    )
    assert "data.train.path" in str(caught.value)
    assert "read from the local cache only" in caplog.text
    assert offline_before == (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
