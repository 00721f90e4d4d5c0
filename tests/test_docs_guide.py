"""docs/guide.md shows real outputs: every command of its ``console`` blocks is run and its
output compared with the block, so that the guide cannot drift from the code.

In a block, ``$ addnorm ...`` is a command and the lines under it its output (stdout and
stderr, terminal width 100); ``$ echo $?`` is followed by the previous command's exit status.
A line ``[... words ...]`` stands for any number of output lines the guide leaves out.
Numbers in scientific notation (``1.5e-07``: how far the op is from the float64 steps) are
compared as such, not digit for digit: their last bits depend on the CPU's instructions
(tests/test_explain.py bounds them). When the output changes on purpose, paste the new one
that the failure prints.
"""

from __future__ import annotations

import difflib
import pathlib
import re
import shlex

import pytest

from addnorm.tools import cli

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "guide.md"
ELIDED = re.compile(r"\[\.\.\. .* \.\.\.\]")
VARYING = re.compile(r"\b\d\.\de[+-]\d\d\b")


def console_blocks(text: str) -> list[list[str]]:
    return [block.splitlines() for block in re.findall(r"^```console\n(.*?)^```", text, flags=re.S | re.M)]


def runs(block: list[str]) -> list[tuple[str, list[str]]]:
    """``[(command, expected output lines)]`` of one block."""
    out: list[tuple[str, list[str]]] = []
    for line in block:
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"output before any command: {line!r}"
            out[-1][1].append(line)
    return out


def _normal(line: str) -> str:
    return VARYING.sub("<number>", line.rstrip())


def matches(expected: list[str], actual: list[str]) -> bool:
    """``actual`` is ``expected`` with each elision line standing for any run of lines."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if ELIDED.fullmatch(line) else re.escape(_normal(line)) + r"\n" for line in expected
    )
    return re.fullmatch(pattern, "".join(_normal(line) + "\n" for line in actual)) is not None


COMMANDS = [run for block in console_blocks(GUIDE.read_text()) for run in runs(block)]


def test_every_console_block_is_run():
    text = GUIDE.read_text()
    blocks = console_blocks(text)
    assert len(blocks) == text.count("```console") >= 5
    assert all(block[0].startswith("$ addnorm ") for block in blocks)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c for c, _ in COMMANDS])
def test_guide_output_is_what_the_command_prints(index, capsys, monkeypatch, tmp_path):
    command, expected = COMMANDS[index]
    if command == "echo $?":
        previous, _ = COMMANDS[index - 1]
        assert previous.startswith("addnorm ")
    else:
        assert command.startswith("addnorm "), f"the guide runs only addnorm: {command!r}"
        previous = command
    monkeypatch.setenv("COLUMNS", "100")  # the width the guide was pasted at
    for name in ("FORCE_COLOR", "NO_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # files the commands write land here, not in docs/
    status = cli.main(shlex.split(previous)[1:])
    captured = capsys.readouterr()
    actual = [str(status)] if command == "echo $?" else (captured.out + captured.err).splitlines()
    assert matches(expected, actual), (
        f"docs/guide.md shows another output for `$ {command}`; the command prints:\n"
        + "\n".join(actual)
        + "\n\ndiff (guide -> now):\n"
        + "\n".join(difflib.unified_diff(expected, actual, lineterm="", n=1))
    )
