"""Where the fused CPU kernels cannot or must not be used, callers are told None, never an error."""

from __future__ import annotations

import logging

from seq2seq.model.cpu_kernels import SWITCH, _built, cpu_kernels


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    assert cpu_kernels() is None


def test_a_build_that_fails_is_one_warning_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    """No working C++ compiler: the loss takes PyTorch's path, the log says why, the cache stays empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="seq2seq"):
        assert _built.__wrapped__() is None
    assert "fused CPU kernels unavailable" in caplog.text
    assert list((tmp_path / "seq2seq" / "cpu_kernels").iterdir()) == []
