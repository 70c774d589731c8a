"""The README and docs/ as a user reads them: every command in their code blocks runs, in the page's
order, in a sandbox whose shipped configs train a tiny model (the same data paths, a few updates),
and every relative link leads to a file and heading that exist.

A block's info string says what it is: `sh` and `python` blocks run; `sh illustration: WHY` and
`python illustration: WHY` are shown only, for what the sandbox cannot do (WMT data, several GPUs,
a run of hours); `yaml FILE` is an edit of FILE (its keys merged in, as a user edits a copy);
`text` and `yaml` are output or content."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_pairs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
RUN = {"sh", "python"}
SHOWN = {"text", "yaml"}
# The shipped configs as the sandbox has them: their data paths, a model and budget that train in seconds,
# and short output limits (the tiny models' outputs run to them).
TINY = {
    "tokenizer": {"vocab_size": 300, "sample_sentences": 3000},
    "model": {"d_model": 32, "heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64},
    "train": {
        "max_steps": 20,
        "max_tokens": 1024,
        "log_every": 10,
        "valid_every": 10,
        "save_every": 10,
        "valid_max_sentences": 20,
        "precision": "fp32",
        "threads": 1,
    },
    "decode": {"max_len_a": 0.5, "max_len_b": 4},
}  # fmt: skip
# The corpora the pages name, each a copy of the demo corpus under its languages' suffixes.
CORPORA = {"data/demo": ("en", "xx"), "data/bible": ("en", "es"), "corpus": ("en", "de")}
BLOCK_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str

    @property
    def language(self) -> str:
        return self.info.split(" ", 1)[0]

    @property
    def illustration(self) -> str | None:
        """Why the block is shown and not run, or None."""
        rest = self.info.split(" ", 1)[1] if " " in self.info else ""
        return rest.removeprefix("illustration:").strip() if rest.startswith("illustration") else None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found, opening, lines = [], None, page.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.startswith("```"):
            continue
        if opening is None:
            opening = (number, line[3:].strip())
        else:
            found.append(Block(page, opening[0], opening[1], "\n".join(lines[opening[0] : number - 1]) + "\n"))
            opening = None
    assert opening is None, f"{page.relative_to(ROOT)}:{opening[0]}: a code block that is never closed"
    return found


def test_every_code_block_says_whether_it_runs():
    problems = []
    for block in (block for page in PAGES for block in blocks(page)):
        if block.language not in RUN | SHOWN:
            problems.append(f"{block.where}: info string {block.info!r}; expected one of {sorted(RUN | SHOWN)}")
        elif block.illustration == "":
            problems.append(f"{block.where}: an illustration must say why it does not run")
        elif block.language == "yaml" and block.illustration is None and len(block.info.split()) > 2:
            problems.append(f"{block.where}: 'yaml FILE' edits one file; got {block.info!r}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(match) for match in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_lead_to_files_and_headings_that_exist():
    problems = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {path or page.name}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, demo_pairs) -> Path:
    """A working directory as a user's would be after setting up: the shipped configs (tiny), the corpora
    they name, and the runs the pages translate with (runs/demo, runs/bible)."""
    root = tmp_path_factory.mktemp("docs")
    for folder, (src, tgt) in CORPORA.items():
        (root / folder).mkdir(parents=True)
        for split, pairs in demo_pairs.items():
            for path, suffix in zip(write_pairs(root / folder, split, pairs), (src, tgt)):
                path.rename(path.with_suffix(f".{suffix}"))
    news = "".join(tgt + "\n" for _, tgt in demo_pairs["train"][-500:])  # German without translations: data.md
    (root / "corpus" / "news.de").write_text(news, encoding="utf-8")
    (root / "configs").mkdir()
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(config.read_text(encoding="utf-8"))
        for section, keys in TINY.items():
            raw.setdefault(section, {}).update(keys)
        if "distill" in raw:  # its teacher translates the whole training corpus: with the search that is quickest
            raw["distill"]["beam"] = 1
        (root / "configs" / config.name).write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    for name in ("demo", "bible_en_es"):
        run_dir = root / "runs" / name.split("_")[0]
        completed = subprocess.run([sys.executable, "-m", "seq2seq", "-q", "train", f"configs/{name}.yaml",
                                    "--run-dir", str(run_dir.relative_to(root))], cwd=root, env=environment(),
                                   capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)  # fmt: skip
        assert completed.returncode == 0, completed.stderr
    return root


def environment() -> dict[str, str]:
    """The user's shell: this Python's seq2seq first on PATH, one thread per process."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip


def run_block(block: Block, cwd: Path) -> None:
    if block.language == "yaml":  # an edit of a file the page made: its keys merged in
        target = cwd / block.info.split()[1]
        merged = yaml.safe_load(target.read_text(encoding="utf-8"))
        for key, value in yaml.safe_load(block.text).items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
        target.write_text(yaml.safe_dump(merged, sort_keys=False), encoding="utf-8")
        return
    command = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    if block.language == "python":
        command = [sys.executable, "-c", block.text]
    process = subprocess.Popen(command, cwd=cwd, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    finally:  # a server the block started and did not stop
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    assert process.returncode == 0, f"{block.where}: exit code {process.returncode}\n{block.text}\n{output[-3000:]}"


RUNNABLE = [page for page in PAGES if any(b.language in RUN and b.illustration is None for b in blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(page.relative_to(ROOT)) for page in RUNNABLE])
def test_the_commands_of_each_page_run_in_order(page, sandbox, tmp_path):
    if shutil.which("curl") is None and any("curl" in block.text for block in blocks(page)):
        pytest.skip("the page's server examples need curl")
    cwd = tmp_path / "work"
    shutil.copytree(sandbox, cwd, symlinks=True)
    for block in blocks(page):
        if block.illustration is None and (block.language in RUN or " " in block.info):
            run_block(block, cwd)
