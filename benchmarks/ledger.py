#!/usr/bin/env python3
"""The benchmark ledger: one machine-stamped JSON result per benchmark run, and the pages rendered from them.

    python benchmarks/ledger.py run benchmark_train.py --sides "reference fp32" "ours fp32" --steps 200
    python benchmarks/ledger.py run --aside benchmark_train.py --sides "ours bf16" --compile --gpu-code-path
    seq2seq demo 2>&1 | python benchmarks/ledger.py record demo --command "seq2seq demo"
    python benchmarks/ledger.py render

An AVX-512 or AMX machine stands in for an AVX2-only one when the command runs under AVX2_CAP's
three variables (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2);
its results are filed as "CPU capped at AVX2". A library preloaded into the run (LD_PRELOAD: another
memory allocator, such as tcmalloc) changes what is measured, so the recorded command starts with it.

`record` stores what a command printed (its stdin) as a result of its own, e.g. the demo's run;
`run` runs a benchmark of this folder as it is (its arguments after the script's name), shows its
output as it comes, and writes benchmarks/results/<benchmark>/<date>-<hhmm>-<machine kind>-<commit>.json:
the machine (CPU model and ISA flags, or the GPU; cores; torch and Python), the date, the commit,
the command, the output and every Markdown table the output printed. `render` writes
benchmarks/README.md from the results (per benchmark, the latest result of each machine kind that
was not set aside with --aside, the history below it) and the README's "Performance at a glance"
table between its ledger markers.
Figures belong here, not in prose: the README and docs quote the ledger.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from seq2seq.files import write_text_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
PAGE, README = HERE / "README.md", ROOT / "README.md"  # what `render` writes
GLANCE_START, GLANCE_END = "<!-- ledger: glance -->", "<!-- /ledger: glance -->"
# What the README's glance table shows: per benchmark, the table column it quotes from the latest result
# of each machine kind, and how many rows.
GLANCE = {
    "benchmark_train": ("target tokens/s", "training throughput, the Bible model (target tokens/s)"),
    "benchmark_decode": ("sentences/s", "decoding a test set (sentences/s)"),
    "benchmark_serve": ("requests/s", "serving one sentence per request (requests/s)"),
    "recipe_study": ("mean", "recipe study, test BLEU (mean over seeds)"),
}
GLANCE_CELLS = 5  # figures per glance row (the reference, fp32 and bf16, each with and without the fused kernels)
SET_ASIDE = " (set aside)"  # how the history marks a variant (record's `aside`)
OUTPUT_TAIL_LINES = 6  # what the page quotes of a result without tables
KINDS = {"amx_bf16": "CPU with AMX", "avx512_bf16": "CPU with AVX-512-bf16", "avx2": "CPU with AVX2 only"}
# With all three set, PyTorch's own kernels, oneDNN and MKL use nothing past AVX2 on a newer CPU, and its
# figures stand in for an AVX2-only machine's: under a kind of their own, since the caches, memory and
# clocks are still the newer machine's.
AVX2_CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
CAPPED_KIND = "CPU capped at AVX2"


def machine() -> dict:
    """What a figure was measured on: the GPU, or the CPU's model and the instruction sets that decide
    its speed; the cores and the software."""
    import torch

    found = {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return {**found, "kind": f"GPU {name}", "gpu": name, "cuda": torch.version.cuda, "driver": _gpu_driver()}
    model, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    isa = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    if "avx2" in flags and all(os.environ.get(name, "").lower() == value.lower() for name, value in AVX2_CAP.items()):
        return {**found, "kind": CAPPED_KIND, "cpu": model, "isa": ["avx2"], "capped_from": isa}
    kind = next((label for flag, label in KINDS.items() if flag in flags), "CPU without AVX2")
    return {**found, "kind": kind, "cpu": model, "isa": isa}


def _gpu_driver() -> str:
    """The NVIDIA driver's version (a GPU figure is compared only under the same driver), or "unknown"."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()[0]
    return "unknown"


def describe_machine() -> str:
    """One line for a benchmark's output: the machine kind and model."""
    found = machine()
    capped = f", capped from {' '.join(found['capped_from'])}" if "capped_from" in found else ""
    return found.get("gpu") or f"{found['cpu']} ({' '.join(found['isa']) or 'no AVX2'}{capped})"


def tables(output: str) -> list[list[dict]]:
    """Every Markdown table in `output`, as rows of {header: cell}."""
    found, lines = [], output.splitlines()
    for index, line in enumerate(lines):
        if index + 1 < len(lines) and line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[index + 1]):
            header = _cells(line)
            rows = []
            for row in lines[index + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(row))))
            found.append(rows)
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def run(script: str, arguments: list[str], *, aside: bool = False) -> Path:
    """Run benchmarks/<script> with `arguments`, echo its output, and record it in the ledger."""
    command = [sys.executable, str(HERE / script), *arguments]
    measured = revision()  # the code as it is now, before any commit made while the benchmark runs
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    output = []
    for line in process.stdout:
        print(line, end="", flush=True)
        output.append(line)
    if process.wait():
        raise SystemExit(f"error: {script} exited with {process.returncode}; nothing recorded")
    capped = [f"{name}={value}" for name, value in AVX2_CAP.items()] if machine()["kind"] == CAPPED_KIND else []
    preloaded = [f"LD_PRELOAD={os.environ['LD_PRELOAD']}"] if os.environ.get("LD_PRELOAD") else []  # an allocator
    command_line = shlex.join([*capped, *preloaded, "python", f"benchmarks/{script}", *arguments])  # pastes back
    marks = {"aside": True} if aside else {}
    return record(Path(script).stem, "".join(output), command=command_line, commit=measured, extra=marks)


def revision() -> str:
    """HEAD's short hash, with "+changes" when tracked files differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()  # fmt: skip
    return commit.stdout.strip() + ("+changes" if dirty else "")


def record(benchmark: str, output: str, *, command: str, commit: str | None = None, extra: dict | None = None) -> Path:
    """Write one result; its name says when, where and at which commit (default: HEAD now) it was measured.
    `extra` fields join it: {"aside": True} sets a variant (one side, a flag tried) aside, in the history
    without becoming its kind's latest figures (latest_by_kind)."""
    found, now = machine(), datetime.datetime.now(datetime.timezone.utc)
    result = {"benchmark": benchmark, "date": now.date().isoformat(), "time": now.strftime("%H:%M:%S"),
              "commit": commit or revision(), "command": command, "machine": found,
              "tables": tables(output), "output": output, **(extra or {})}  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", found["kind"].lower()).strip("-")
    stem = f"{result['date']}-{now.strftime('%H%M')}-{slug}-{result['commit'].split('+')[0] or 'nocommit'}"
    path, copies = RESULTS / benchmark / f"{stem}.json", 1
    while path.exists():  # two runs of one minute and commit are two results
        copies += 1
        path = path.with_name(f"{stem}-{copies}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded: {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return path


def results() -> dict[str, list[dict]]:
    """Every result, by benchmark, newest first."""
    found: dict[str, list[dict]] = {}
    for path in sorted(RESULTS.glob("*/*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        result["path"] = f"results/{path.parent.name}/{path.name}"  # as benchmarks/README.md links it
        found.setdefault(result["benchmark"], []).append(result)
    return {
        name: sorted(runs, key=lambda r: (r["date"], r.get("time", ""), r["path"]), reverse=True)
        for name, runs in sorted(found.items())
    }


def latest_by_kind(runs: list[dict]) -> dict[str, dict]:
    """Each machine kind's newest result that is not set aside, or its newest of all where every one is."""
    latest: dict[str, dict] = {}
    for result in sorted(runs, key=lambda r: bool(r.get("aside"))):  # newest first, set-aside results last
        latest.setdefault(result["machine"]["kind"], result)
    return latest


def render_page(ledger: dict[str, list[dict]]) -> str:
    lines = ["# The benchmark ledger", "",
             "Rendered by `python benchmarks/ledger.py render` from `benchmarks/results/`: per benchmark, the latest "
             "result of each machine kind (variants recorded with `--aside` stay in the history), then the history. "
             "Compare ratios measured side by side in one run, "
             "never absolute figures across machines or days. Record a run with `python benchmarks/ledger.py run "
             "SCRIPT ARGS...`.", ""]  # fmt: skip
    for name, runs in ledger.items():
        lines += [f"## {name}", ""]
        for kind, result in latest_by_kind(runs).items():
            lines += [f"### {kind}: {result['date']}, commit {result['commit']}", "",
                      f"{_machine_line(result['machine'])}  ", f"`{result['command']}`", ""]  # fmt: skip
            if result.get("note"):
                lines += [result["note"], ""]
            for table in result["tables"]:
                lines += [*_markdown(table), ""]
            if not result["tables"] and result.get("output"):  # a command's own report (the demo's): its end
                lines += ["```text", *result["output"].rstrip().splitlines()[-OUTPUT_TAIL_LINES:], "```", ""]
        lines += ["History:", ""]
        lines += [f"- {r['date']}, {r['machine']['kind']}, commit {r['commit']}{SET_ASIDE if r.get('aside') else ''}: "
                  f"[{Path(r['path']).name}]({r['path']})" for r in runs]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _machine_line(found: dict) -> str:
    where = found.get("gpu") or f"{found.get('cpu', '?')} ({' '.join(found.get('isa', [])) or 'no AVX2'})"
    gpu_software = "".join(
        f", {name} {found[key]}" for key, name in (("cuda", "CUDA"), ("driver", "driver")) if key in found
    )
    return f"{where}, {found.get('cores', '?')} cores, torch {found.get('torch', '?')}{gpu_software}"


def _markdown(table: list[dict]) -> list[str]:
    if not table:
        return []
    header = list(table[0])
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(row.get(column, "") for column in header) + " |" for row in table]]  # fmt: skip


def glance(ledger: dict[str, list[dict]]) -> str:
    """The README's tables, one per machine kind: per benchmark, its quoted column from the latest result."""
    rows: dict[str, list[str]] = {}
    for name, (column, what) in GLANCE.items():
        for kind, result in latest_by_kind(ledger.get(name, [])).items():
            cells = [f"{_row_name(row)}: {row[key]}" for row, key in _quoted(result["tables"], column)]
            if cells:
                link = f"[{result['date']}](benchmarks/README.md#{name})"  # GitHub's anchor keeps the underscore
                rows.setdefault(kind, []).append(f"| {what} | {'; '.join(cells[:GLANCE_CELLS])} | {link} |")
    return "\n\n".join(
        "\n".join([f"**{kind}**", "", "| what | latest figures | result |", "|---|---|---|", *lines])
        for kind, lines in sorted(rows.items())
    )


def _quoted(tables: list[list[dict]], column: str) -> list[tuple[dict, str]]:
    """The rows of the last table with a column named `column` (or starting with it: `target tokens/s
    (whole run)`), each with that column's full name: a benchmark prints its summary last."""
    for table in reversed(tables):
        key = next((key for key in (table[0] if table else {}) if key.startswith(column)), None)
        if key is not None:
            return [(row, key) for row in table]
    return []


def _row_name(row: dict) -> str:
    """A row's label: its leading cells that are words, not figures (`beam 5, CTranslate2 int8`), or
    its first column's name and value where that is a figure (`clients 8`)."""
    words = []
    for cell in list(row.values())[:2]:
        if re.fullmatch(r"[\d.,x%*()\s-]+", cell):
            break
        words.append(cell)
    header, first = next(iter(row.items()))
    return ", ".join(words) or f"{header} {first}"


def render() -> None:
    ledger = results()
    write_text_atomic(PAGE, render_page(ledger) + "\n")
    text = README.read_text(encoding="utf-8")
    if GLANCE_START in text and GLANCE_END in text:
        before, rest = text.split(GLANCE_START, 1)
        _, after = rest.split(GLANCE_END, 1)
        write_text_atomic(README, f"{before}{GLANCE_START}\n{glance(ledger)}\n{GLANCE_END}{after}")
    print(f"rendered benchmarks/README.md and the README's glance table from {sum(map(len, ledger.values()))} results")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    aside = "a variant (one side, a flag tried): in the history, not its kind's latest figures"
    running = commands.add_parser("run", help="run a benchmark of this folder and record its result")
    running.add_argument("--aside", action="store_true", help=aside)
    running.add_argument("script")
    running.add_argument("arguments", nargs=argparse.REMAINDER)
    recording = commands.add_parser("record", help="record what a command printed (stdin) as a result")
    recording.add_argument("name")
    recording.add_argument("--command", required=True, help="the command that printed it")
    recording.add_argument("--aside", action="store_true", help=aside)
    commands.add_parser("render", help="write benchmarks/README.md and the README's glance table")
    args = parser.parse_args()
    if args.action == "run":
        run(args.script, args.arguments, aside=args.aside)
    elif args.action == "record":
        record(args.name, sys.stdin.read(), command=args.command, extra={"aside": True} if args.aside else None)
    else:
        render()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
