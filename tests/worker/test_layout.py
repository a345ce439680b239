"""The worker's layout and import rules, read from the source (no imports run).

api -> engine -> model: the HTTP face never reaches the model or the transfer layer; the engine
never imports pd.transfer (the PD roles plug in through its hooks); the model never imports the
scheduler or anything above it. Also: who may change a request's pages and outputs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "pd" / "worker"

# Sub-package -> prefixes it must not import (directly, anywhere in its modules).
FORBIDDEN = {
    "api": ["pd.transfer", "pd.worker.model", "pd.worker.disagg", "pd.worker.checkpoint", "torch"],
    "engine": [
        "pd.transfer",
        "pd.worker.api",
        "pd.worker.disagg",
        "pd.worker.checkpoint",
        "pd.worker.build",
    ],
    "model": [
        "pd.transfer",
        "pd.worker.engine",
        "pd.worker.api",
        "pd.worker.disagg",
        "pd.worker.checkpoint",
        "pd.worker.text",
        "pd.worker.build",
        "pd.worker.metrics",
    ],
    "text": ["pd.transfer", "pd.kvcache", "pd.worker.", "torch"],
    "tools": ["pd.transfer", "pd.kvcache", "pd.worker.", "torch"],
    "checkpoint": ["pd.transfer", "pd.worker.engine", "pd.worker.api", "pd.worker.disagg"],
    "disagg": ["pd.worker.api", "pd.worker.build", "pd.worker.checkpoint"],
}
# A sub-package may import itself (text's own modules import each other).
OWN = {name: f"pd.worker.{name}" for name in FORBIDDEN}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (also inside functions and TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def test_worker_has_stage_subpackages_and_few_top_level_modules():
    subpackages = [p.name for p in WORKER.iterdir() if (p / "__init__.py").exists()]
    assert set(FORBIDDEN) <= set(subpackages)
    assert len(subpackages) >= 4
    top = [p.name for p in WORKER.glob("*.py")]
    assert len(top) <= 8, f"too many modules directly in pd/worker: {sorted(top)}"


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_import_rules(sub: str):
    bad = []
    for path in modules(WORKER / sub):
        for mod in imports_of(path):
            if mod.startswith(OWN[sub] + ".") or mod == OWN[sub]:
                continue
            for prefix in FORBIDDEN[sub]:
                if mod == prefix.rstrip(".") or mod.startswith(prefix.rstrip(".") + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_each_subpackage_exports_its_names(sub: str):
    tree = ast.parse((WORKER / sub / "__init__.py").read_text())
    exported = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "__all__" for t in node.targets)
    ]
    assert exported, f"pd/worker/{sub}/__init__.py has no __all__"
    assert ast.get_docstring(tree), f"pd/worker/{sub}/__init__.py does not say what it owns"


def test_router_and_protocol_stay_free_of_torch_and_the_worker():
    """The router imports pd.protocol (GenerationOptions included) without torch."""
    paths = modules(ROOT / "pd" / "router") + modules(ROOT / "pd" / "protocol")
    bad = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in paths
        for m in imports_of(p)
        if m.split(".")[0] in ("torch", "numpy") or m.startswith(("pd.worker", "pd.transfer"))
    ]
    assert not bad, "\n".join(bad)


def _writes(path: Path, attribute: str) -> list[int]:
    """Lines of `path` that assign to, or call a mutating method on, `<x>.<attribute>`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat: list[ast.expr] = []
            for t in targets:
                flat.extend(t.elts if isinstance(t, ast.Tuple) else [t])
            targets = flat
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("append", "extend", "clear", "pop", "insert"):
                targets = [node.func.value]
        if any(isinstance(t, ast.Attribute) and t.attr == attribute for t in targets):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    "attribute, owner",
    [
        ("output_ids", "engine/postprocess.py"),  # only postprocess changes a request's outputs
        ("page_ids", "engine/scheduler.py"),  # only the scheduler changes its pages
        ("num_computed", "engine/scheduler.py"),
    ],
)
def test_who_changes_a_request(attribute: str, owner: str):
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in modules(WORKER)
        if path != WORKER / owner
        for line in _writes(path, attribute)
    ]
    assert not bad, f"{attribute} changed outside pd/worker/{owner}: {bad}"
    assert _writes(WORKER / owner, attribute), "the rule checks nothing"


# --------------------------------------------------------------- the engine knows no role

ROLE_WORDS = {"pin", "pinned", "pins", "held", "pull", "pulls", "pulled", "pulling"}
ROLE_PAIRS = {("remote", "decode"), ("prefill", "side"), ("decode", "side")}
ROLE_VALUES = {"prefill", "decode", "both"}
WIRE_NAMES = {"kv_pages_held"}  # WorkerLoad's fields, declared once in pd/protocol/wire.py


def _words(identifier: str) -> list[str]:
    """`PrefillSide` -> ["prefill", "side"]; `held_pages` -> ["held", "pages"]."""
    spaced = "".join(f"_{c}" if c.isupper() else c for c in identifier)
    return [w.lower() for w in spaced.split("_") if w]


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    return {
        id(n.body[0].value)
        for n in nodes
        if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def role_names(source: str) -> list[str]:
    """Where code names a PD role: pinned/held pages or pulls in an identifier, `remote_decode`,
    `PrefillSide`/`DecodeSide`, `config.role`, `worker.prefill`/`worker.decode`, or a role's name
    as a string value. Comments and docstrings may say where the code sits; compute phases
    (prefill chunks, decode steps) and a tokenizer's `decode` keep their names."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
            base = node.value
            owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if (owner, node.attr) == ("config", "role") or (
                owner.endswith("worker") and node.attr in ("prefill", "decode")
            ):
                found.append(f"{node.lineno}: {owner}.{node.attr}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        ):
            if node.value in ROLE_VALUES:
                found.append(f"{node.lineno}: {node.value!r}")
        for name in set(names) - WIRE_NAMES:
            words = _words(name)
            if ROLE_WORDS & set(words) or ROLE_PAIRS & set(zip(words, words[1:])):
                found.append(f"{node.lineno}: {name}")
    return found


def test_the_rule_finds_role_names():
    code = (
        "seq.remote_decode = True\nworker.prefill.release(t)\nif config.role == 'decode': pass\n"
        "engine.release_held(k)\nclass DecodeSide: pass\n"
    )
    assert len(role_names(code)) == 6  # remote_decode, worker.prefill, config.role, 'decode',
    # release_held, DecodeSide
    assert not role_names(
        '"""A prefill worker\'s pages."""\ntokenizer.decode(ids)\nprefill_chunk = 1\n'
    )


@pytest.mark.parametrize("package", ["engine", "api"])
def test_the_engine_and_the_http_face_never_name_a_role(package: str):
    """The engine is role-agnostic: KV from and to other workers goes through its connector
    (engine/connector.py), and the roles (pd/worker/disagg) add their own routes and limits."""
    bad = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in modules(WORKER / package)
        for hit in role_names(path.read_text())
    ]
    assert not bad, f"pd/worker/{package} names a PD role: {bad}"
