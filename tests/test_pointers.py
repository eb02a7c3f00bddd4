"""Every pointer true: what the prose of the repository (docstrings, comments, README.md, docs/) names in the
code exists. A dotted name of a project module (`rft_core.plan.resolve`, `engines.base.Engine`,
`models.pin_triton_cache`) resolves by import and attribute; a path of the repository (`rft_core/plan.py`,
`bench/bench_sizes.py`) is a file; `path.py: name` names a definition in that file; a call written in
backticks (`offload_after_update(...)`) names a function or class defined in the repository, or one of the
outside names below."""

import ast
import glob
import importlib
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# not the project's: Python's, PyTorch's, the papers' notation, a file the code writes, a placeholder
OUTSIDE = {"min", "max", "round", "softmax", "sg", "full_tensor", "reinforce", "C.yaml"}
FILES = {"py", "md", "json", "jsonl", "yaml", "txt", "log", "png", "lock"}  # a file's name, not a pointer
TOP = ("rft_core", "bench", "tests", "accelerate_configs", "examples", "docs")


def sources():
    paths = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*.md"))
    for top in TOP:
        paths += glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)
        paths += glob.glob(os.path.join(ROOT, top, "**", "*.md"), recursive=True)
    return sorted(set(paths))


def prose(path):
    """A markdown page whole; of a Python file its docstrings and comments."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".md"):
        return text
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    parts = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(text))
             if isinstance(n, kinds)]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    parts += [t.string for t in tokens if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def definitions(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    names = {n.name for n in ast.walk(tree) if isinstance(n, kinds)}
    return names | {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}


def resolves(dotted):
    """A dotted name under rft_core (written with or without the package): the longest importable module
    prefix, then attributes."""
    parts = dotted.split(".")
    parts = parts if parts[0] == "rft_core" else ["rft_core", *parts]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_pointer_in_prose_is_true():
    core = os.path.join(ROOT, "rft_core")
    modules = {os.path.splitext(f)[0] for f in os.listdir(core) if f.endswith(".py") and f[0] != "_"}
    modules |= {d for d in os.listdir(core) if os.path.isdir(os.path.join(core, d)) and d[0] != "_"}
    defined = set().union(*(definitions(p) for p in sources() if p.endswith(".py")))
    untrue = []
    for path in sources():
        text, where = prose(path), os.path.relpath(path, ROOT)
        for ref in re.findall(r"(?<![\w./:])((?:rft_core\.)?[a-z_]+(?:\.[A-Za-z_]\w*)+)", text):
            head, last = ref.split(".")[0], ref.split(".")[-1]
            if (head == "rft_core" or head in modules) and last not in FILES and ref not in OUTSIDE:
                untrue += [] if resolves(ref) else [f"{where}: {ref}"]
        for ref in re.findall(rf"(?<![\w./:])((?:{'|'.join(TOP)})/[\w/.-]+\.(?:py|yaml|md|json))", text):
            if not os.path.exists(os.path.join(ROOT, ref)) and os.path.basename(ref) not in OUTSIDE:
                untrue.append(f"{where}: {ref} (no such file)")
        for file, name in re.findall(r"([\w/]+\.py): `?([A-Za-z_]\w*)", text):
            named = os.path.join(ROOT, file)
            code_like = "_" in name or name[0].isupper()
            if code_like and os.path.exists(named) and name not in definitions(named):
                untrue.append(f"{where}: {file}: {name}")
        for name in re.findall(r"`(?:[\w.]+\.)?([A-Za-z_]\w*)\(", text):
            untrue += [] if name in defined or name in OUTSIDE else [f"{where}: `{name}(`"]
    assert untrue == [], "\n".join(untrue)
