"""The README's claims about the code: its loop table names the banners of train_ppo.py at the lines it
gives, and every relative link in README.md and docs/ points to a file that exists."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_loop_table_matches_the_script():
    script = read("train_ppo.py").splitlines()
    table = read("README.md").split("## Reading the loop", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-z ,()]+?) \| (\d+)-(\d+) \|", table, re.M)
    assert len(rows) >= 10, "the loop table lost its rows"
    for (phase, first, last), following in zip(rows, rows[1:] + [None]):
        first, last = int(first), int(last)
        banner = re.match(rf"# ---- {re.escape(phase)}( ----|:| \()", script[first - 1].strip())
        assert banner, (phase, first, script[first - 1])
        end = int(following[1]) - 1 if following else len(script)
        assert last == end, f"{phase}: the table says it ends at line {last}, the script at {end}"


def test_relative_links_exist():
    pages = ["README.md"] + [os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs"))
                             if p.endswith(".md")]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(page)):
            if "://" in target:
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            assert os.path.exists(path), f"{page} links to {target}, which does not exist"


def lines(folder, suffix):
    """{path: line count} of the files under folder ending in suffix."""
    paths = glob.glob(os.path.join(ROOT, folder, "**", f"*{suffix}"), recursive=True)
    return {os.path.relpath(p, ROOT): len(read(os.path.relpath(p, ROOT)).splitlines()) for p in paths}


def test_the_size_budget_holds():
    """The README's budget, measured on the code: rft_core within 7,450 lines, each of its functions within
    60, docs/ within 1,800 and bench/ within 1,100 (growth past it is a bug to fix)."""
    long = {}
    for path in lines("rft_core", ".py"):
        for node in ast.walk(ast.parse(read(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    long[f"{path}: {node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}
    assert sum(lines("rft_core", ".py").values()) <= 7450
    assert sum(lines("docs", ".md").values()) <= 1800
    assert sum(lines("bench", ".py").values()) <= 1100
    assert "`rft_core` within 7,450 lines, its functions within 60" in " ".join(read("README.md").split())
