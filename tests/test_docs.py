"""The docs point at things that exist: docs/architecture.md and the role packages' life-cycle
docstrings name real files, functions, methods and flags, and the README links only inside the
repository (a standalone clone has nothing outside it). docs/perf/ holds only results a document
names, and every result a document names is there.

Checked in backticked spans: paths (``pdserve/engine/core.py``, ``tests/test_*.py``), calls
(``run_busy_loop()``, ``Scheduler.admit_remote_loads()``, ``core_proc.main()``), attributes of
pdserve classes (``LiveRequest.cut_short``) and command-line flags (``--trace-file``). Names are
looked up in the AST of every module under ``pdserve/``, nothing is imported.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROLE_PACKAGES = (PACKAGE / "prefill" / "__init__.py", PACKAGE / "decode" / "__init__.py")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"``?([^`]+?)``?")  # markdown `x` and reST ``x``
CALL = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\(")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
PATH_SUFFIXES = (".py", ".md", ".proto", ".yaml", ".yml", ".json", ".txt")
CLASS_INDEX = re.compile(r"^- `(pdserve/[\w/]+\.py)`: ((?:`\w+`(?:, )?)+)$", re.M)  # - `file`: `A`, `B`
TIMELINE_SOURCES = ("router", "prefill", "decode", "<role>")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
PERF = ROOT / "docs" / "perf"
# A path into docs/perf/ anywhere in a document (a link, an image, a code span, prose): from the
# repository's root (``docs/perf/x.json``) or from the document's folder (``perf/x.json`` in docs/).
PERF_NAME = re.compile(r"(?<![\w./-])((?:docs/)?perf/(?:[\w./-]*[\w/])?)")


class Definitions:
    """Names defined in pdserve: top-level names per module, members per class."""

    def __init__(self) -> None:
        self.names: set[str] = set()  # every function and class, at any depth
        self.modules: dict[str, set[str]] = defaultdict(set)  # {module basename: top-level names}
        self.members: dict[str, set[str]] = defaultdict(set)  # {class name: attributes}
        self.bases: dict[str, set[str]] = defaultdict(set)  # {class name: base class names}
        self.strings: set[str] = set()  # every string literal (flags, timeline event names)

    def add_module(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        top = self.modules[path.stem if path.stem != "__init__" else path.parent.name]
        for node in tree.body:
            top.update(_bound_names(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.names.add(node.name)
            if isinstance(node, ast.ClassDef):
                self._add_class(node)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)

    def _add_class(self, node: ast.ClassDef) -> None:
        members = self.members[node.name]
        self.bases[node.name].update(b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases)
        for item in node.body:
            members.update(_bound_names(item))
        for item in ast.walk(node):  # self.x = ... anywhere in its methods
            targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    members.add(target.attr)

    def class_has(self, cls: str, name: str, seen: frozenset = frozenset()) -> bool:
        if name in self.members.get(cls, ()):
            return True
        return any(self.class_has(b, name, seen | {cls}) for b in self.bases.get(cls, ()) if b not in seen)

    def problem_with(self, dotted: str, called: bool) -> str | None:
        """Why ``dotted`` (``name`` or ``Owner.member[.more]``) names nothing, or None."""
        parts = dotted.split(".")
        if len(parts) == 1:
            return None if dotted in self.names or dotted in _BUILTIN_CALLS else "no such function or class"
        owner, member = parts[-2], parts[-1]
        if owner in self.members:
            return None if self.class_has(owner, member) else f"class {owner} has no {member}"
        if owner in self.modules:
            return None if member in self.modules[owner] else f"module {owner} has no {member}"
        proto = proto_members().get(owner)
        if proto is not None:
            return None if member in proto else f"proto {owner} has no field or rpc {member}"
        # Neither pdserve's nor its protos' (grpc.health.v1.Health): only calls must resolve.
        if called and member not in self.names:
            return f"{owner} is no pdserve class or module and no function is named {member}"
        return None


_BUILTIN_CALLS = {"isinstance", "len", "min", "max", "int", "str", "print"}


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.ImportFrom | ast.Import):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


@cache
def definitions() -> Definitions:
    defs = Definitions()
    for path in sorted(PACKAGE.rglob("*.py")):
        if "v1" not in path.relative_to(PACKAGE).parts:  # generated gRPC stubs
            defs.add_module(path)
    return defs


@cache
def proto_members() -> dict[str, set[str]]:
    """{message or service name: its field and rpc names} of ``proto/pdserve/v1/*.proto``."""
    members: dict[str, set[str]] = {}
    for path in sorted((ROOT / "proto").rglob("*.proto")):
        for kind, name, body in re.findall(
            r"^(message|service) (\w+) \{(\}|.*?^\})", path.read_text(), re.S | re.M
        ):
            pattern = r"rpc (\w+)\(" if kind == "service" else r"(\w+) = \d+;"
            members[name] = set(re.findall(pattern, body))
    return members


def code_spans(text: str) -> list[tuple[str, bool]]:
    """(span, fenced) for the inline code spans of markdown or reST text and its fenced blocks."""
    inline = [(m.group(1), False) for m in SPAN.finditer(FENCE.sub("", text))]
    return inline + [(block, True) for block in FENCE.findall(text)]


def path_problem(token: str) -> str | None:
    """None if ``token`` (a repo path, a glob, or a bare file name) names something that exists."""
    token = token.rstrip(".,;:")
    if "<" in token or token.startswith(("/", "http", "~")) or "://" in token:
        return None  # a placeholder (``<name>.py``), a URL path, an absolute path
    if "*" in token:
        return None if list(ROOT.glob(token)) else "no file matches"
    if "/" not in token:
        found = [p for p in ROOT.rglob(token) if ".venv" not in p.parts]
        return None if found else "no file of that name in the repository"
    candidates = (ROOT / token, PACKAGE / token)  # a diagram may name paths inside pdserve/
    return None if any(c.exists() for c in candidates) else "does not exist"


def module_problem(dotted: str) -> str | None:
    """None if ``dotted`` is a pdserve module (``pdserve.engine.core_proc``) or a name in one."""
    parts = dotted.split(".")
    if parts[:-1] == ["pdserve", "v1"] and parts[-1] in proto_members():
        return None  # a gRPC service or message by its full name (pdserve.v1.Router)
    for end in (len(parts), len(parts) - 1):
        base = ROOT.joinpath(*parts[:end])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            if end == len(parts):
                return None
            return None if parts[-1] in definitions().modules.get(parts[end - 1], ()) else "no such name"
    return "no such module"


def pointers(text: str) -> list[tuple[str, str]]:
    """(kind, token) of every path, call, dotted name and flag in the text's code.

    In fenced blocks (diagrams) only file names are taken: their prose has slashes and parens.
    """
    found = []
    for span, fenced in code_spans(text):
        for word in re.findall(r"[\w./*<>-]+", span):
            word = word.rstrip(".,;:")
            if word.endswith(PATH_SUFFIXES) or (not fenced and "/" in word and not word.startswith("-")):
                found.append(("path", word))
        if fenced:
            continue
        calls = set(CALL.findall(span))
        found += [("call", c) for c in sorted(calls)]
        stripped = span.strip().removesuffix("()")
        if DOTTED.fullmatch(stripped) and stripped not in calls and not stripped.endswith(PATH_SUFFIXES):
            found.append(("name", stripped))
        found += [("flag", f) for f in FLAG.findall(span)]
    return found


def problems(text: str) -> list[str]:
    defs = definitions()
    out = []
    for kind, token in pointers(text):
        if kind == "path":
            problem = path_problem(token)
        elif kind == "flag":
            problem = None if token in defs.strings else "no argparse option of that name in pdserve/"
        elif kind == "name" and token.split(".")[0] in TIMELINE_SOURCES:
            # A timeline event (``decode.pull_start``): recorded under that name somewhere.
            event = token.split(".", 1)[1]
            problem = None if {event, token} & defs.strings else "no timeline event of that name in pdserve/"
        elif token.split(".")[0] == "pdserve":
            problem = module_problem(token)
        else:
            problem = defs.problem_with(token, called=kind == "call")
        if problem:
            out.append(f"{kind} {token!r}: {problem}")
    return sorted(set(out))


def test_architecture_doc_points_only_at_things_that_exist():
    text = ARCHITECTURE.read_text()
    assert len(pointers(text)) > 200, "the pointer extraction found suspiciously little"
    assert problems(text) == []


@pytest.mark.parametrize("path", ROLE_PACKAGES, ids=lambda p: p.parent.name)
def test_role_package_docstring_maps_its_life_cycle_with_real_pointers(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "life cycle" in docstring.lower()
    assert len(pointers(docstring)) > 10
    assert problems(docstring) == []


def test_class_index_names_the_file_each_class_is_defined_in():
    lines = CLASS_INDEX.findall(ARCHITECTURE.read_text())
    assert len(lines) > 10
    for path, names in lines:
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        listed = re.findall(r"`(\w+)`", names)
        assert set(listed) <= defined, f"{path} does not define {set(listed) - defined}"


def test_readme_and_docs_link_only_inside_the_repository():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in MARKDOWN_LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            resolved = (doc.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
            assert resolved.exists(), f"{doc.name} links to a missing file: {target}"


def test_the_checker_catches_a_wrong_pointer():
    wrong = (
        "`pdserve/engine/no_such_file.py`, `Scheduler.no_such_method()`, `no_such_function()`, "
        "`LiveRequest.no_such_field`, `core_proc.no_such_name()`, `--no-such-flag`, `decode.no_such_event`, "
        "`RequestMetrics.no_such_field`, `Engine.NoSuchRpc`, `pdserve.engine.no_such_module`"
    )
    assert len(problems(wrong)) == 10, problems(wrong)
    right = (
        "`pdserve/engine/core.py`, `Scheduler.admit_remote_loads()`, `run_busy_loop()`, `--trace-file`, "
        "`decode.pull_start`, `RequestMetrics.timeline_ms`, `Engine.Generate`, `pdserve.engine.core_proc`, "
        "`pdserve.client.Client`"
    )
    assert problems(right) == []


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def perf_names(doc: Path, text: str) -> set[Path]:
    """Every path into docs/perf/ that ``text`` (the document ``doc``) names, resolved."""
    names = set()
    for name in PERF_NAME.findall(text):
        base = ROOT if name.startswith("docs/") else doc.parent
        names.add((base / name).resolve())
    return names


def unnamed_perf_files(named: set[Path]) -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in PERF.rglob("*") if p.is_file() and p.resolve() not in named
    )


def test_every_file_under_docs_perf_is_named_by_a_document():
    """A result no document names is a result no reader finds: name it where its table is, or
    delete it (git keeps it)."""
    named = set().union(*(perf_names(doc, doc.read_text()) for doc in documents()))
    assert len(named) > 20, "the name extraction found suspiciously little"
    assert unnamed_perf_files(named) == []


def test_every_docs_perf_path_a_document_names_exists():
    """Links are checked by the link test; this covers code spans and prose too."""
    for doc in documents():
        missing = [str(p) for p in perf_names(doc, doc.read_text()) if not p.exists()]
        assert missing == [], f"{doc.name} names missing results: {missing}"


def test_the_perf_checks_see_links_code_spans_and_both_bases():
    doc = ROOT / "docs" / "performance.md"
    text = "[`docs/perf/a.json`](perf/b.json), `perf/c.png`, docs/perf/d.json. ~/.cache/perf/x"
    assert perf_names(doc, text) == {PERF / name for name in ("a.json", "b.json", "c.png", "d.json")}
    readme = ROOT / "README.md"
    assert perf_names(readme, "see perf/e.json or `docs/perf/`") == {(ROOT / "perf/e.json"), PERF}
    assert unnamed_perf_files({PERF.resolve()}) != []  # naming the folder names no file in it
