"""Nothing in the library can unpickle or evaluate what arrives: a scan of its source (with ``ast``).

Flagged anywhere under kv_pipe/, kv_store/, lookup_buffer/, connector/ and launch/: any reference (a call, or
the function passed along) to pickle-style loaders (pickle, cloudpickle, dill, marshal, shelve,
jsonpickle, pandas.read_pickle), torch.load, numpy.load with ``allow_pickle`` not literally False,
unsafe YAML loaders, torch.distributed's object collectives (they pickle), ZeroMQ's
``recv_pyobj``/``recv_serialized``, and the ``eval``/``exec`` builtins. Import aliases
(``import pickle as p``, ``from pickle import loads as l``) are resolved.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("kv_pipe", "kv_store", "lookup_buffer", "connector", "launch")

#: Fully qualified names whose use is unsafe on untrusted bytes.
UNSAFE_NAMES = {
    *(
        f"{module}.{name}"
        for module in ("pickle", "_pickle", "cPickle", "cloudpickle", "dill")
        for name in ("load", "loads", "Unpickler")
    ),
    "marshal.load",
    "marshal.loads",
    "shelve.open",
    "jsonpickle.decode",
    "pandas.read_pickle",
    "torch.load",
    "torch.serialization.load",
    "numpy.lib.format.read_array",
    "yaml.load",
    "yaml.load_all",
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
    "yaml.full_load",
    "yaml.full_load_all",
    "yaml.UnsafeLoader",
    "yaml.Loader",
    *(
        f"torch.distributed.{name}"
        for name in (
            "recv_object_list",
            "broadcast_object_list",
            "all_gather_object",
            "gather_object",
            "scatter_object_list",
        )
    ),
    "builtins.eval",
    "builtins.exec",
}
#: Method names unsafe whatever object they are called on (the receiver's type is unknown statically).
UNSAFE_METHODS = {
    "recv_pyobj",
    "recv_serialized",
    "recv_object_list",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "read_pickle",
    "unsafe_load",
}
#: Loaders that are safe unless a keyword enables pickle.
PICKLE_KEYWORD_LOADERS = {"numpy.load": "allow_pickle"}


@dataclasses.dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {"eval": "builtins.eval", "exec": "builtins.exec"}
        self.findings: list[Finding] = []

    def flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, node.lineno, what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            qualified = f"{node.module}.{alias.name}" if node.module else alias.name
            self.aliases[alias.asname or alias.name] = qualified
            if qualified in UNSAFE_NAMES:
                self.flag(node, f"imports {qualified}")

    def qualified(self, node: ast.AST) -> str | None:
        """``a.b.c`` with the root resolved through the imports, or None if it is not a plain name chain."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id if node.id in ("eval", "exec") else None)
        if isinstance(node, ast.Attribute):
            base = self.qualified(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Name(self, node: ast.Name) -> None:
        name = self.qualified(node)
        if name in UNSAFE_NAMES:
            self.flag(node, f"uses {name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.qualified(node)
        if name in UNSAFE_NAMES:
            self.flag(node, f"uses {name}")
        elif node.attr in UNSAFE_METHODS:
            self.flag(node, f"calls .{node.attr}() (deserialises with pickle)")
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        keyword = PICKLE_KEYWORD_LOADERS.get(self.qualified(node.func) or "")
        if keyword is not None:
            for item in node.keywords:
                literal_false = isinstance(item.value, ast.Constant) and item.value.value is False
                if item.arg == keyword and not literal_false:
                    self.flag(node, f"calls {self.qualified(node.func)} with {keyword} not False")
                if item.arg is None:  # **kwargs could carry it
                    self.flag(node, f"calls {self.qualified(node.func)} with **kwargs")
        self.generic_visit(node)


def scan_source(source: str, path: str) -> list[Finding]:
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return sorted(set(scanner.findings), key=lambda f: (f.path, f.line, f.what))


def scan_tree(root: Path, folders: tuple[str, ...]) -> tuple[list[Finding], int]:
    findings, files = [], 0
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            findings += scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
            files += 1
    return findings, files


def test_library_never_unpickles_or_evaluates() -> None:
    findings, files = scan_tree(REPO, SCANNED)
    assert files >= 20, f"only {files} files scanned: the layout changed?"
    assert not findings, "unsafe deserialisation in the library:\n" + "\n".join(map(str, findings))


UNSAFE_SNIPPET = textwrap.dedent("""\
    import pickle
    import pickle as pk
    import numpy as np
    import torch
    import torch.distributed as dist
    from dill import loads as undill
    from marshal import loads
    import yaml

    def handle(sock, frame, options):
        a = pickle.loads(frame)
        b = pk.Unpickler(frame).load()
        c = undill(frame)
        d = torch.load(frame)
        e = eval(frame)
        exec(frame)
        f = sock.recv_pyobj()
        g = sock.recv_serialized(lambda x: x)
        h = np.load(frame, allow_pickle=True)
        i = np.load(frame, **options)
        dist.broadcast_object_list([None])
        callback = pickle.load
        j = yaml.load(frame, Loader=yaml.Loader)
        k = loads(frame)
    """)


def test_scanner_flags_every_unsafe_form() -> None:
    findings = scan_source(UNSAFE_SNIPPET, "snippet.py")
    # The two unsafe imports (6, 7) and every line of the function body (11-24); nothing else.
    assert {finding.line for finding in findings} == {6, 7, *range(11, 25)}, "\n".join(map(str, findings))
    assert all(finding.path == "snippet.py" for finding in findings)


def test_scanner_leaves_safe_code_alone() -> None:
    safe = textwrap.dedent("""\
        import json
        import msgspec
        import numpy as np

        def handle(frame, decoder):
            a = msgspec.msgpack.decode(frame)
            b = json.loads(frame)
            c = np.load(frame)
            d = np.load(frame, allow_pickle=False)
            e = decoder.decode(frame)
            evaluate = "eval"
            return a, b, c, d, e, evaluate
        """)
    assert scan_source(safe, "safe.py") == []
