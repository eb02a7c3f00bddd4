"""train_ppo_vl.py is train_ppo.py with images, kept as a standalone copy (the scripts are what users read
and copy). Like accelerate's by-feature examples, every line where the two differ is marked: a `# VL`
comment on the line, or a `# VL begin ...` / `# VL end` block; the module docstrings differ freely. This
test fails on any unmarked difference, so a fix to one copy cannot be forgotten in the other."""

import ast
import difflib
import os
import re

from conftest import ROOT

SCRIPTS = ("train_ppo.py", "train_ppo_vl.py")
LINE_MARK = re.compile(r"#.*\bVL\b")  # a comment naming VL, e.g. `...  # VL` or `# noqa: E731  VL`


def marked(lines):
    """The indices of the lines allowed to differ: marked ones and those of VL blocks (markers included)."""
    allowed, inside = set(), False
    for i, line in enumerate(lines):
        if line.strip().startswith("# VL begin"):
            assert not inside, f"line {i + 1}: a VL block opens inside another"
            inside = True
        if inside or LINE_MARK.search(line):
            allowed.add(i)
        if line.strip() == "# VL end":
            assert inside, f"line {i + 1}: `# VL end` without `# VL begin`"
            inside = False
    assert not inside, "a VL block is never closed"
    return allowed


def body(script):
    """The script's lines after its module docstring, and the docstring's last line number."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    docstring_end = ast.parse(source).body[0].end_lineno
    return source.splitlines()[docstring_end:], docstring_end


def unmarked_differences(text_lines, vl_lines):
    """[(script, index, line)] of the differing lines that carry no mark."""
    allowed = marked(text_lines), marked(vl_lines)
    found = []
    matcher = difflib.SequenceMatcher(None, text_lines, vl_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for script, lines, ok, lo, hi in ((SCRIPTS[0], text_lines, allowed[0], i1, i2),
                                          (SCRIPTS[1], vl_lines, allowed[1], j1, j2)):
            found += [(script, i, lines[i]) for i in range(lo, hi) if i not in ok and lines[i].strip()]
    return found


def test_vl_script_differs_only_in_marked_lines():
    (text_lines, text_start), (vl_lines, vl_start) = body(SCRIPTS[0]), body(SCRIPTS[1])
    found = unmarked_differences(text_lines, vl_lines)
    starts = {SCRIPTS[0]: text_start, SCRIPTS[1]: vl_start}
    report = "\n".join(f"{script}:{i + 1 + starts[script]}: {line}" for script, i, line in found)
    assert not found, f"unmarked differences between the scripts (mark them `# VL`, or fix both):\n{report}"
    same = sum(size for *_, size in difflib.SequenceMatcher(None, text_lines, vl_lines).get_matching_blocks())
    assert same / len(text_lines) > 0.8  # the marks stay the exception


def test_the_check_catches_an_unmarked_edit():
    """The check itself: an edit to one copy, unmarked, is found; the same edit marked is allowed."""
    text_lines, _ = body(SCRIPTS[0])
    edited = list(text_lines)
    i = next(i for i, line in enumerate(edited) if "accelerator.backward(" in line)
    edited[i] = edited[i].replace("loss * scale", "loss")
    assert [line for _, _, line in unmarked_differences(text_lines, edited)] == [text_lines[i], edited[i]]
    edited[i] += "  # VL"
    # the other copy's line
    assert unmarked_differences(text_lines, edited) == [(SCRIPTS[0], i, text_lines[i])]
    assert marked(["a", "# VL begin: x", "b", "# VL end", "c  # VL", "d"]) == {1, 2, 3, 4}
