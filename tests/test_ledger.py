"""The benchmark ledger: a benchmark's printed tables become a machine-stamped result, and the pages
rendered from the results show each machine kind's latest figures with the history below."""

from __future__ import annotations

import ctypes.util
import io
import json
import subprocess
import sys

import pytest

from benchmarks import ledger

OUTPUT = """model runs/demo, beam 5

| clients | requests/s | p50 latency |
|---|---|---|
| 1 | 38.2 | 24 ms |
| 8 | 108.9 | 47 ms |

server: 132 requests
"""


def write(folder, benchmark, date, kind, figure):
    result = {"benchmark": benchmark, "date": date, "commit": "abc1234", "command": f"python benchmarks/{benchmark}.py",
              "machine": {"kind": kind, "cpu": "a CPU", "isa": ["avx2"], "cores": 2, "torch": "2.13.0"},
              "tables": ledger.tables(OUTPUT.replace("38.2", figure)), "output": ""}  # fmt: skip
    path = folder / benchmark / f"{date}-{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def test_the_tables_of_a_benchmarks_output_are_its_figures():
    (table,) = ledger.tables(OUTPUT)
    assert table == [{"clients": "1", "requests/s": "38.2", "p50 latency": "24 ms"},
                     {"clients": "8", "requests/s": "108.9", "p50 latency": "47 ms"}]  # fmt: skip


def test_the_pages_show_each_kinds_latest_result_and_the_history(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    write(tmp_path, "benchmark_serve", "2026-11-20", "CPU with AVX2 only", "30.0")
    write(tmp_path, "benchmark_serve", "2026-11-25", "CPU with AVX2 only", "38.2")
    write(tmp_path, "benchmark_serve", "2026-11-24", "CPU with AMX", "50.5")
    results = ledger.results()
    page = ledger.render_page(results)
    assert "### CPU with AVX2 only: 2026-11-25" in page and "### CPU with AVX2 only: 2026-11-20" not in page
    assert "| 1 | 38.2 | 24 ms |" in page and "| 1 | 50.5 | 24 ms |" in page and "| 1 | 30.0 |" not in page
    assert page.count("- 2026-11-") == 3  # the history keeps every result
    glance = ledger.glance(results)
    avx2, amx = glance.split("**CPU with AVX2 only**")[1], glance.split("**CPU with AVX2 only**")[0]
    assert "| clients 1: 38.2; clients 8: 108.9 |" in avx2 and "30.0" not in glance
    assert "**CPU with AMX**" in amx and "| clients 1: 50.5; clients 8: 108.9 |" in amx


def test_record_stores_what_a_command_printed_and_the_page_quotes_its_end(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "PAGE", tmp_path / "page.md")  # a stray render writes here, not to the repository
    monkeypatch.setattr(ledger, "README", tmp_path / "readme.md")
    monkeypatch.setattr("sys.argv", ["ledger.py", "record", "demo", "--command", "seq2seq demo"])
    monkeypatch.setattr("sys.stdin", io.StringIO("training...\ntest BLEU: checkpoint 96.21\ndone\n"))
    assert ledger.main() == 0
    (path,) = tmp_path.glob("demo/*.json")
    result = json.loads(path.read_text())
    assert result["benchmark"] == "demo" and result["command"] == "seq2seq demo" and result["tables"] == []
    page = ledger.render_page(ledger.results())
    assert "`seq2seq demo`" in page and "test BLEU: checkpoint 96.21\ndone\n```" in page


def test_a_run_is_stamped_with_the_commit_it_started_from(tmp_path, monkeypatch):
    """A commit made while a long benchmark runs is not the code that was measured."""
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "HERE", tmp_path)
    commits = iter(["before1", "after22"])
    monkeypatch.setattr(ledger, "revision", lambda: next(commits))
    (tmp_path / "benchmark_tiny.py").write_text("print('| a | b |')\nprint('|---|---|')\nprint('| 1 | 2 |')\n")
    path = ledger.run("benchmark_tiny.py", [])
    result = json.loads(path.read_text())
    assert result["commit"] == "before1" and path.name.endswith("-before1.json")
    assert result["tables"] == [[{"a": "1", "b": "2"}]]


def test_a_runs_command_runs_again_as_recorded(tmp_path, monkeypatch):
    """An argument with a space ("ours bf16") is recorded quoted, so the command can be pasted back
    (after the AVX2 cap's variables, where the run is under it)."""
    import shlex

    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "HERE", tmp_path)
    (tmp_path / "benchmark_tiny.py").write_text("import sys\nprint(sys.argv[1:])\n")
    result = json.loads(ledger.run("benchmark_tiny.py", ["--sides", "ours bf16", "ours fp32"]).read_text())
    words = shlex.split(result["command"])
    script = words.index("benchmarks/benchmark_tiny.py")
    assert words[script - 1 : script] == ["python"] and words[script + 1 :] == ["--sides", "ours bf16", "ours fp32"]
    assert result["output"] == "['--sides', 'ours bf16', 'ours fp32']\n"


def test_a_run_under_a_preloaded_library_records_it_in_its_command(tmp_path, monkeypatch):
    """Another allocator (LD_PRELOAD) changes a run's speed and memory: its command says so, and runs
    again under it when pasted back."""
    import shlex

    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "HERE", tmp_path)
    (tmp_path / "benchmark_tiny.py").write_text("import os\nprint(os.environ.get('LD_PRELOAD'))\n")
    monkeypatch.setenv("LD_PRELOAD", "")  # the loader ignores an empty one; nothing to record
    assert shlex.split(json.loads(ledger.run("benchmark_tiny.py", []).read_text())["command"])[0] == "python"
    library = ctypes.util.find_library("c")  # loaded already: it stands in for libtcmalloc_minimal.so.4
    if library is None:
        pytest.skip("no C library for the loader to preload")
    monkeypatch.setenv("LD_PRELOAD", library)
    result = json.loads(ledger.run("benchmark_tiny.py", []).read_text())
    assert shlex.split(result["command"])[:2] == [f"LD_PRELOAD={library}", "python"]
    assert result["output"] == f"{library}\n"  # the benchmark ran under it


def test_of_two_results_of_one_day_the_later_is_the_latest(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "revision", lambda: "same123")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    first = ledger.record("benchmark_serve", OUTPUT.replace("38.2", "1.0"), command="first")
    later = ledger.record("benchmark_serve", OUTPUT.replace("38.2", "2.0"), command="later")
    assert first != later and first.exists()  # the later run did not overwrite the first
    for path, time in ((first, "09:00:00"), (later, "10:00:00")):  # as if an hour apart
        result = json.loads(path.read_text())
        path.write_text(json.dumps({**result, "time": time}))
    (latest,) = ledger.latest_by_kind(ledger.results()["benchmark_serve"]).values()
    assert latest["command"] == "later"


def test_a_result_set_aside_stays_in_the_history_without_replacing_the_headline(tmp_path, monkeypatch):
    """A variant (one side, a flag tried) recorded after a kind's headline run does not become its latest figures."""
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setattr(ledger, "revision", lambda: "same123")
    headline = ledger.record("benchmark_serve", OUTPUT, command="headline")
    variant = ledger.record("benchmark_serve", OUTPUT.replace("38.2", "99.9"), command="variant", extra={"aside": True})
    for path, time in ((headline, "09:00:00"), (variant, "10:00:00")):
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": time}))
    results = ledger.results()
    page, glance = ledger.render_page(results), ledger.glance(results)
    assert "| 1 | 38.2 | 24 ms |" in page and "clients 1: 38.2" in glance and "99.9" not in page + glance
    assert f"(set aside): [{variant.name}]" in page  # still in the history, marked
    monkeypatch.setattr(ledger, "RESULTS", tmp_path / "only_aside")
    ledger.record("benchmark_serve", OUTPUT.replace("38.2", "99.9"), command="variant", extra={"aside": True})
    assert "| 1 | 99.9 | 24 ms |" in ledger.render_page(ledger.results())  # a kind with nothing else shows it


def test_a_cpu_capped_at_avx2_is_filed_as_its_own_kind_and_pytorch_runs_under_the_cap(monkeypatch):
    if "avx512f" not in ledger.machine().get("isa", []):
        pytest.skip("no CPU with anything past AVX2 to cap (an AVX2-only CPU, or a GPU machine's ledger kind)")
    for name, value in ledger.AVX2_CAP.items():
        monkeypatch.setenv(name, value)
    found = ledger.machine()
    assert found["kind"] == "CPU capped at AVX2" and found["isa"] == ["avx2"] and "avx512f" in found["capped_from"]
    capability = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    assert subprocess.run([sys.executable, "-c", capability], capture_output=True, text=True).stdout.strip() == "AVX2"
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")  # one library left uncapped: the machine's own kind
    assert ledger.machine()["kind"] != "CPU capped at AVX2"
