"""The docs stay true to the code: every shell command in README.md and docs/ names an `autosp` subcommand and flags
the CLI has (its argparse parser, built without running anything), Snakemake targets the workflow defines and files
that exist; every relative link (and its #anchor) resolves. The checker is tested to fail on a renamed flag and on a
broken link."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)
ANY_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SEPARATORS = {"|", "||", "&&", ";", "&"}
#: snakemake options that take one value (--config takes several, up to the next option)
SNAKEMAKE_VALUE_OPTIONS = {"--cores", "-c", "--jobs", "-j", "--profile", "--configfile", "--directory", "-d"}
PLACEHOLDER = re.compile(r"[<>*{}$\[\]]|\.\.\.")


def shell_commands(markdown: str) -> list[str]:
    """The command lines of the bash/sh/console code blocks: continuations joined, `$ ` prompts dropped."""
    commands = []
    for body in SHELL_BLOCK.findall(markdown):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _simple_commands(command: str) -> list[list[str]]:
    """The command split at pipes, `&&`, `;`, comments removed; each as its tokens."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as e:
        return [["<unparsable>", str(e)]]
    parts: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS:
            parts.append([])
        else:
            parts[-1].append(token)
    return [p for p in parts if p]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _autosp_problems(args: list[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """The subcommand (and its action, e.g. `history run`), its first positional's choices and every --flag."""
    problems = []
    words = ["autosp"]
    positional_done = False
    while args and _subparsers(parser):
        name, args = args[0], args[1:]
        if name in ("-h", "--help"):
            return []
        if name not in _subparsers(parser):
            return [f"{command!r}: `{' '.join(words)}` has no subcommand {name!r}"]
        parser = _subparsers(parser)[name]
        words.append(name)
    choices = [a for a in parser._actions if not a.option_strings and a.choices and a.nargs is None]
    for token in args:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            if flag not in parser._option_string_actions:
                problems.append(f"{command!r}: `{' '.join(words)}` has no flag {flag}")
        elif choices and not positional_done and not token.startswith("-"):
            positional_done = True
            if not PLACEHOLDER.search(token) and token not in choices[0].choices:
                problems.append(f"{command!r}: `{' '.join(words)}` takes {'|'.join(choices[0].choices)}, not {token!r}")
    return problems


def _rules(root: Path) -> set[str]:
    files = [root / "Snakefile", *sorted((root / "workflows").glob("*.smk"))]
    return {m for f in files if f.exists() for m in re.findall(r"^rule (\w+)", f.read_text(), re.M)}


def _snakemake_problems(args: list[str], root: Path, command: str) -> list[str]:
    """Targets must be rules of the workflow; --profile and --configfile must exist; --config keys must be
    settings of config/config.yaml."""
    problems, rules = [], _rules(root)
    config_keys = set(yaml.safe_load((root / "config" / "config.yaml").read_text()) or {})
    option = None
    for token in args:
        if token.startswith("-"):
            option = token.split("=", 1)[0]
            continue
        if option in SNAKEMAKE_VALUE_OPTIONS:
            if option in ("--profile", "--configfile") and not PLACEHOLDER.search(token) \
                    and not (root / token).exists():
                problems.append(f"{command!r}: {option} {token} does not exist")
            option = None
        elif option == "--config":
            key = token.split("=", 1)[0]
            if key not in config_keys:
                problems.append(f"{command!r}: --config {key} is not a setting of config/config.yaml")
        elif not PLACEHOLDER.search(token) and token not in rules:
            problems.append(f"{command!r}: snakemake has no target {token!r} (rules: Snakefile, workflows/*.smk)")
    return problems


def command_problems(command: str, parser: argparse.ArgumentParser, root: Path = ROOT) -> list[str]:
    """What in one documented shell command does not match the code: an `autosp` subcommand or flag the CLI lacks,
    a snakemake target or file that does not exist, a test path pytest would not find."""
    problems = []
    for tokens in _simple_commands(command):
        while tokens and re.fullmatch(r"\w+=.*", tokens[0]):  # VAR=value before the command
            tokens = tokens[1:]
        if tokens[:1] == ["bin/autosp-env"]:
            tokens = tokens[1:]
        if not tokens:
            continue
        if tokens[0] in ("bash", "sh") and len(tokens) > 1 and not PLACEHOLDER.search(tokens[1]):
            if not (root / tokens[1]).exists():
                problems.append(f"{command!r}: {tokens[1]} does not exist")
        elif "/" in tokens[0] and not tokens[0].startswith("/") and not PLACEHOLDER.search(tokens[0]) \
                and not (root / tokens[0]).exists():
            problems.append(f"{command!r}: {tokens[0]} does not exist")
        if "autosp" in tokens:
            problems += _autosp_problems(tokens[tokens.index("autosp") + 1:], parser, command)
        elif tokens[0] == "snakemake":
            problems += _snakemake_problems(tokens[1:], root, command)
        elif tokens[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
            args = tokens[3:]
            # a pytest option's value (-k EXPR, -m MARK, --hypothesis-profile NAME, ...) is not a path
            values = {i + 1 for i, t in enumerate(args) if t in PYTEST_OPTIONS_WITH_VALUES}
            for path in (t.split("::")[0] for i, t in enumerate(args) if not t.startswith("-") and i not in values):
                if not PLACEHOLDER.search(path) and not (root / path).exists():
                    problems.append(f"{command!r}: pytest path {path} does not exist")
    return problems


#: pytest options whose value is the next word
PYTEST_OPTIONS_WITH_VALUES = {"-k", "-m", "-p", "-n", "--maxfail", "--hypothesis-profile", "--hypothesis-seed",
                              "--cpu-durations", "--cpu-durations-file", "--durations", "--deselect", "--ignore"}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", ANY_BLOCK.sub("", markdown), re.M)}


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of a Markdown file (outside code) that names no file, or an anchor its file lacks."""
    text = path.read_text() if text is None else text
    prose = re.sub(r"`[^`\n]*`", "", ANY_BLOCK.sub("", text))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:
            if anchor not in _anchors(text):
                problems.append(f"{path.name}: link {target}: no heading #{anchor} here")
            continue
        linked = (path.parent / file_part).resolve()
        if not linked.exists():
            problems.append(f"{path.name}: link {target} names no file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
            problems.append(f"{path.name}: link {target}: {linked.name} has no heading #{anchor}")
    return problems


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from autosp.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_matches_the_cli_and_the_workflow(doc: Path, parser) -> None:
    problems = [p for command in shell_commands(doc.read_text()) for p in command_problems(command, parser)]
    assert problems == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert link_problems(doc) == []


def test_the_docs_hold_commands_to_check() -> None:
    commands = [c for doc in DOCS for c in shell_commands(doc.read_text())]
    assert sum(c.startswith("autosp ") for c in commands) >= 20
    assert "bin/autosp-env snakemake --cores all figure_trainability" in commands


SAMPLE = """# Title

```bash
autosp search --method autosp --model tiny --world-size 2 \\
    --memory-budget 48MiB   # a comment
bin/autosp-env snakemake --cores all figure_trainability
```
"""


def test_the_command_check_fails_on_a_renamed_flag_or_subcommand(parser) -> None:
    assert [p for c in shell_commands(SAMPLE) for p in command_problems(c, parser)] == []
    renamed = SAMPLE.replace("--memory-budget", "--mem-budget")
    problems = [p for c in shell_commands(renamed) for p in command_problems(c, parser)]
    assert len(problems) == 1 and "`autosp search` has no flag --mem-budget" in problems[0]
    assert "has no subcommand 'serch'" in command_problems("autosp serch --model tiny", parser)[0]
    assert "takes trainability" in command_problems("autosp table trainabilty --in x.jsonl", parser)[0]
    assert "has no flag --suit" in command_problems("autosp history run --suit cpu", parser)[0]


def test_the_command_check_fails_on_a_missing_target_file_or_setting(parser) -> None:
    assert "no target 'figure_trainabilty'" in command_problems("snakemake --cores all figure_trainabilty", parser)[0]
    assert "profiles/a200 does not exist" in command_problems("snakemake --profile profiles/a200 all", parser)[0]
    assert "--config modles is not a setting" in command_problems("snakemake --config 'modles=[tiny]' all", parser)[0]
    assert "pytest path tests/nope.py" in command_problems("python -m pytest -q tests/nope.py", parser)[0]
    assert command_problems("bin/autosp-env python -m pytest -q tests/test_docs.py", parser) == []
    assert command_problems("python -m pytest -q tests/test_docs.py --long -k four_ranks -m long", parser) == []


def test_the_link_check_fails_on_a_broken_link_or_anchor(tmp_path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    good = "See [other](other.md), [its section](other.md#a-section) and [here](#title).\n\n# Title\n"
    assert link_problems(page, good) == []
    assert link_problems(page, "[gone](missing.md)\n") == ["page.md: link missing.md names no file"]
    assert link_problems(page, "[x](other.md#no-such)\n") == ["page.md: link other.md#no-such: other.md has no "
                                                               "heading #no-such"]
    assert link_problems(page, "[x](#nowhere)\n") == ["page.md: link #nowhere: no heading #nowhere here"]
    assert link_problems(page, "```\n[in code](missing.md)\n```\n") == []  # code is not a link
