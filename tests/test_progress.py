"""Progress bars: redrawn in place on a terminal, and rarely where every redraw stays (a log file)."""

from __future__ import annotations

import io

import tqdm

from seq2seq.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def redraws_over_five_minutes(stream: io.StringIO, monkeypatch) -> int:
    """A bar updated once a second for five minutes of a stepped clock: how many times it was drawn."""
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread: the stepped clock alone
    bar = progress_bar(file=stream, total=300, desc="train", unit="step")
    now = [bar.last_print_t]
    bar._time = lambda: now[0]
    for _ in range(300):
        now[0] += 1.0
        bar.update()
    bar.close()
    return stream.getvalue().count("\r")


def test_a_bar_written_to_a_file_is_redrawn_once_a_minute_not_at_every_update(monkeypatch):
    to_file, to_terminal = io.StringIO(), Terminal()
    assert redraws_over_five_minutes(to_file, monkeypatch) <= 7  # the first, one a minute, the last
    assert redraws_over_five_minutes(to_terminal, monkeypatch) >= 290
    assert "300/300" in to_file.getvalue().rsplit("\r", 1)[-1]  # the last state is written
