"""The README's claims about the code: its loop table names the banners of train_ppo.py at the lines it
gives, and every relative link in README.md and docs/ points to a file that exists."""

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


def test_the_size_budget_holds():
    """The README's budget: every rft_core module at most 300 lines (growth past it is a bug to fix)."""
    import glob

    sizes = {}
    for path in glob.glob(os.path.join(ROOT, "rft_core", "**", "*.py"), recursive=True):
        with open(path) as f:
            sizes[os.path.relpath(path, ROOT)] = len(f.read().splitlines())
    assert {path: n for path, n in sizes.items() if n > 300} == {}
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "each `rft_core` module at most 300" in f.read()


def test_pip_install_e_packages_the_core():
    """README: `pip install --no-deps -e .` makes rft_core importable from a script copied anywhere: the
    packages pyproject.toml finds are the core and its subpackages, its dependencies requirements.txt's."""
    import tomllib

    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    found = set(find_packages(ROOT, **config["tool"]["setuptools"]["packages"]["find"]))
    walk = os.walk(os.path.join(ROOT, "rft_core"))
    core = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in walk if "__init__.py" in files}
    assert found == core and "rft_core.engines" in found
    assert config["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == ["requirements.txt"]
    assert "pip install --no-deps -e ." in read("README.md")
