"""Drift guards for the docs: what they name must exist.

* every `--flag` a doc writes after `mserve <command>` (in a code span, a code block, or a flag table
  under a heading naming `mserve <command>`) is a flag of that command's parser;
* the message tables of docs/protocol.md list exactly `MsgType`, with its numbers, and its data-plane
  table exactly the transfer channel's `Msg`;
* every repository path, and every `*.md` file, a doc cites in backticks exists;
* every module a doc runs (`python -m NAME`) and every dotted `mserve.a.b` name it cites exists.
* the settings tables of docs/operations.md list every field of the coordinator's and the worker's
  settings, under its MSERVE_* name, and "(env only)" only for fields without a flag.
* the metrics table of docs/operations.md lists exactly the metric families the gateway's /metrics
  renders (tests/metric_names.py), both ways.

The checks read text and build the CLI parser in-process: no processes, no model.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every doc a user reads. bench/lab/NOTEBOOK.md is left out: it is a dated lab log, whose commands and
# paths are as they were on the day (bench/lab/README.md says so).
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "deploy" / "README.md"] + [
    ROOT / "bench" / name for name in ("README.md", "gpu_check.md", "lab/README.md")] + [
    ROOT / "deploy" / "wheelhouse" / "README.md"]
# Files the tools write (`mserve bench serve` writes report.md), named in the docs but not docs.
OUTPUT_FILES = ("report.md", "soak.md", "compare.md")
OUTPUT_FOLDERS = ("bench/results",)  # git-ignored: where the bench writes
TOP_FOLDERS = ("common", "coordinator", "workers", "bench", "deploy", "tests", "docs", "mserve")

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?<![\w/.-])mserve\s+([a-z][a-z-]*)((?:\s+[a-z][a-z|-]*)?)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- flags -------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    """`mserve <sub>` and `mserve bench <sub>` parsers, by the words that name them."""
    from mserve.cli import build_parser

    found = {}
    for name, parser in _subparsers(build_parser()).items():
        found[name] = parser
        for inner, inner_parser in _subparsers(parser).items():
            found[f"{name} {inner}"] = inner_parser
    return found


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _command_lines(text: str) -> list[str]:
    """Command lines: code spans outside code blocks, and code-block lines (continuations joined,
    comments and pipes cut off)."""
    lines = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines()[1:-1]:
            if not line.lstrip().startswith("kubectl"):  # `kubectl -n mserve ...`: a namespace
                lines.append(re.split(r"\s#|\s\|\s|&&", line)[0])
    lines += SPAN.findall(FENCE.sub("", text).replace("\\|", "|"))
    return lines


def _table_flags(text: str) -> list[tuple[str, str]]:
    """(command, flag) for the `flag` column of tables under a heading naming `mserve <command>`."""
    found, command, column = [], None, None
    for line in FENCE.sub("", text).splitlines():
        cells = [c.strip() for c in line.replace("\\|", "/").split("|")[1:-1]]
        if line.startswith("#"):
            named = re.search(r"`mserve ([a-z][a-z-]*)`", line)
            command = named.group(1) if named else None
        elif not line.startswith("|"):
            column = None
        elif column is None:  # a table's header row
            column = next((i for i, c in enumerate(cells) if c.startswith("flag")), -1)
        elif command and 0 <= column < len(cells):
            found += [(command, flag) for flag in FLAG.findall(" ".join(SPAN.findall(cells[column])))]
    return found


QUOTED_VALUE = re.compile(r"""=(['"]).*?\1""")  # a flag's quoted value, e.g. the flags --coordinator-args passes on


def _doc_flags(text: str) -> list[tuple[str, str]]:
    found = []
    for line in _command_lines(text):
        for match in COMMAND.finditer(line):
            words = match.group(1) + match.group(2)
            rest = QUOTED_VALUE.sub("", line[match.end():])  # --worker-args='--flag v': another command's
            nxt = COMMAND.search(rest)  # a second command on the line starts its own flags
            found += [(words, flag) for flag in FLAG.findall(rest[:nxt.start()] if nxt else rest)]
    return found + _table_flags(text)


def _resolve(words: str, commands: dict[str, argparse.ArgumentParser]) -> list[argparse.ArgumentParser]:
    """The parsers `mserve WORDS` names: `bench engine|serve` names both; an unknown second word is an
    argument (`mserve keygen DIR`), so the first word alone."""
    first, *second = words.split()
    if second and any(f"{first} {w}" in commands for w in second[0].split("|")):
        return [commands[f"{first} {w}"] for w in second[0].split("|") if f"{first} {w}" in commands]
    return [commands[first]] if first in commands else []


def test_every_flag_the_docs_name_exists(commands):
    wrong = []
    for doc in DOCS:
        for words, flag in _doc_flags(doc.read_text()):
            parsers = _resolve(words, commands)
            if not parsers:
                wrong.append(f"{_rel(doc)}: `mserve {words.split()[0]}` is not an mserve command")
            elif not any(flag in _flags_of(p) for p in parsers):
                wrong.append(f"{_rel(doc)}: `mserve {words}` has no flag {flag}")
    assert not wrong, "docs name flags the CLI does not have:\n" + "\n".join(sorted(set(wrong)))


def test_the_flag_check_sees_the_docs_commands(commands):
    """Guard the guard: the extraction finds flags in code blocks, spans and tables alike."""
    found = {(words.split()[0], flag) for doc in DOCS for words, flag in _doc_flags(doc.read_text())}
    for expected in [("up", "--http-port"), ("coordinator", "--shard-id"), ("worker", "--role"),
                     ("gateway", "--direct-tokens"), ("status", "--json"), ("autoscale", "--backend"),
                     ("coordinator", "--max-image-bytes"), ("worker", "--max-prefill-tokens")]:
        assert expected in found, f"no doc names `mserve {expected[0]} ... {expected[1]}` any more"


# ---- messages ----------------------------------------------------------------------------------------


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def _table_rows(text: str) -> dict[str, int]:
    """{NAME: number} from table rows `| NAME | number | ...`."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\|\s*([A-Z][A-Z_]+)\s*\|\s*(\d+)\s*\|", text, re.M)}


def _assert_same(documented: dict[str, int], code: dict[str, int], where: str, source: str) -> None:
    missing = sorted(set(code) - set(documented))
    unknown = sorted(set(documented) - set(code))
    renumbered = sorted(n for n in set(code) & set(documented) if code[n] != documented[n])
    assert not missing, f"{where} does not list {missing} (in {source})"
    assert not unknown, f"{where} lists {unknown}, which {source} does not define"
    assert not renumbered, f"{where} gives {renumbered} other numbers than {source}"


def test_protocol_doc_lists_every_message_type():
    from mserve.common.protocol.core import MsgType

    documented = _table_rows(_section((ROOT / "docs" / "protocol.md").read_text(), "## Messages"))
    _assert_same(documented, {m.name: m.value for m in MsgType}, "docs/protocol.md, Messages",
                 "mserve.common.protocol.core.MsgType")


def test_protocol_doc_lists_every_data_plane_message():
    from mserve.common.transfer.channel import Msg

    section = _section((ROOT / "docs" / "protocol.md").read_text(), "## Transfers (data plane)")
    _assert_same(_table_rows(section), {m.name: m.value for m in Msg}, "docs/protocol.md, Transfers",
                 "mserve.common.transfer.channel.Msg")


# ---- paths -------------------------------------------------------------------------------------------


def _cited_paths(text: str) -> list[str]:
    """Repository paths (`coordinator/routing.py: ...`, `deploy/k8s/...`) and bare `*.md` names in
    code spans; placeholders ({x}, <x>, globs) are not paths."""
    found = []
    for span in SPAN.findall(FENCE.sub("", text)):
        word = re.split(r"[\s:,(]", span.strip())[0].rstrip(".").removesuffix("/...")
        if re.search(r"[{}<>*]", word) or word.startswith(OUTPUT_FOLDERS):
            continue
        if word.split("/")[0] in TOP_FOLDERS and "/" in word or re.fullmatch(r"[\w.-]+\.md", word) \
                and word not in OUTPUT_FILES:
            found.append(word)
    return found


def _exists(cited: str, doc: Path) -> bool:
    return any((base / cited).exists() for base in (ROOT, doc.parent, ROOT / "docs"))


def test_every_doc_is_checked():
    """A new *.md file is a doc the checks above read, unless it is the lab log."""
    found = set(ROOT.glob("*.md")) | {p for top in TOP_FOLDERS for p in (ROOT / top).rglob("*.md")}
    tracked = {p for p in found
               if not any(part.startswith(".") or part == "results" for part in p.relative_to(ROOT).parts)}
    assert tracked - set(DOCS) <= {ROOT / "bench" / "lab" / "NOTEBOOK.md"}, sorted(map(_rel, tracked - set(DOCS)))


def test_every_path_the_docs_cite_exists():
    wrong = [f"{_rel(doc)}: `{cited}`" for doc in DOCS for cited in _cited_paths(doc.read_text())
             if not _exists(cited, doc)]
    assert not wrong, "docs cite paths that do not exist:\n" + "\n".join(sorted(set(wrong)))


# ---- modules -----------------------------------------------------------------------------------------

RUN_MODULE = re.compile(r"python -m ([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?![\w.])")
DOTTED = re.compile(r"^mserve(?:\.[a-z_][a-z0-9_]*){2,}$")  # two parts are often logger names (`mserve.worker`)


def _cited_modules(text: str) -> list[str]:
    """Modules run with `python -m` (`lab.X` placeholders are not lower case) and dotted `mserve.a.b`
    names in code spans."""
    found = [m.group(1) for line in _command_lines(text) for m in RUN_MODULE.finditer(line)]
    return found + [span for span in SPAN.findall(FENCE.sub("", text)) if DOTTED.match(span)]


def _resolves(name: str) -> bool:
    """`name` is a module, or a top-level name of the longest module prefix of it; found without
    importing the modules themselves (only their parent packages), so torch is not loaded."""
    from importlib.util import find_spec

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            spec = find_spec(".".join(parts[:cut]))
        except ImportError:
            spec = None
        if spec is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if len(rest) > 1 or not spec.origin or not spec.origin.endswith(".py"):
            return False
        source = Path(spec.origin).read_text()
        return re.search(rf"^(?:def|class|async def) {rest[0]}\b|^{rest[0]}\s*[:=]", source, re.M) is not None
    return False


def test_every_module_the_docs_name_exists():
    wrong = sorted({f"{_rel(doc)}: `{name}`" for doc in DOCS for name in _cited_modules(doc.read_text())
                    if not _resolves(name)})
    assert not wrong, "docs name modules that do not exist:\n" + "\n".join(wrong)


def test_the_module_check_sees_the_docs_modules():
    found = {name for doc in DOCS for name in _cited_modules(doc.read_text())}
    assert {"lab.gpu.check", "mserve.healthcheck", "lab.scale"} <= found
    assert not _resolves("mserve.workers.no_such_module") and not _resolves("mserve.common.policy.NO_SUCH")


# ---- settings ----------------------------------------------------------------------------------------


def _settings_rows(heading: str) -> dict[str, tuple[str, str]]:
    """{field: (env cell, flag cell)} of the settings table under `heading` in docs/operations.md."""
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = {}
    for line in text[text.index(heading):].split("\n\n", 2)[1].splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        for name in cells[0].split(","):
            rows[name.strip()] = (cells[1], cells[2])
    return rows


@pytest.mark.parametrize("heading, settings, command", [
    ("### Coordinator (`mserve coordinator`)", "mserve.coordinator.settings:CoordinatorSettings", "coordinator"),
    ("### Worker (`mserve worker`)", "mserve.workers.settings:WorkerSettings", "worker"),
])
def test_settings_tables_list_every_field(heading, settings, command, commands):
    """Every field of a process's settings is in its table, under its MSERVE_* name, and a field the
    table calls "(env only)" has no flag."""
    import importlib

    module, name = settings.split(":")
    fields = set(getattr(importlib.import_module(module), name).model_fields)
    rows = _settings_rows(heading)
    assert set(rows) == fields, (f"docs/operations.md, {heading}: missing {sorted(fields - set(rows))}, "
                                 f"not settings {sorted(set(rows) - fields)}")
    flags = _flags_of(commands[command])
    for field, (env, flag) in rows.items():
        assert f"MSERVE_{field.upper()}" in env or "..." in env, f"{heading}: {field}'s variable is not {env}"
        if "env only" in flag:
            assert "--" + field.replace("_", "-") not in flags, f"{heading}: {field} is said env only, has a flag"


# ---- metrics -----------------------------------------------------------------------------------------


def _metrics_table_names() -> set[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| metric | type | labels | meaning |"):].split("\n\n", 1)[0]
    return {name for line in table.splitlines()[2:] for name in re.findall(r"`(mserve_[a-z0-9_*]+)`",
                                                                          line.split("|")[1])}


def test_metrics_table_lists_exactly_what_metrics_renders():
    from tests.metric_names import family_of, rendered_families

    rendered = rendered_families()
    rendered -= {n for n in rendered if n.endswith("_created") and n[: -len("_created")] in rendered}
    documented = _metrics_table_names()
    wildcards = {n[:-1] for n in documented if n.endswith("*")}
    named = {family_of(n, rendered) for n in documented if not n.endswith("*")}
    undocumented = {n for n in rendered - named if not any(n.startswith(w) for w in wildcards)}
    assert not undocumented, f"/metrics renders families docs/operations.md does not list: {sorted(undocumented)}"
    assert named <= rendered, f"docs/operations.md lists metrics /metrics does not render: {sorted(named - rendered)}"
    assert all(any(n.startswith(w) for n in rendered) for w in wildcards), wildcards
