"""The package's layers: outside pagedecode/runtime/ nothing reads the engine's internals (it
reads `engine.snapshot()` and public methods), and no modules import each other in a circle,
directly or through others, deferred (function-level) imports included; imports under
`if TYPE_CHECKING:` (annotations only, never run) are not edges. The server's state is worked on
by admission and the reader only; a model layer's tensors are named, never numbered; model/ has no
finalizer. Speculation and the output side are runtime/'s subpackages, speculation read through
its package's names; env.py alone reads the environment, and runtime/process.py alone changes the
process (threads, the heap, malloc)."""
import ast
from pathlib import Path

import pagedecode

PACKAGE = Path(pagedecode.__file__).parent
# the engine's parts: they change with the runtime, so only runtime/ may reach them
INTERNALS = {"scheduler", "pool", "slots", "stats", "requests"}


def engine_like(node):
    """`engine`, `self.engine`, `state.engine`, `ae.engine`, ...: an expression naming an engine."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("engine", "eng") or name.endswith("_engine")


def internal_reads(tree):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if node.attr == "scheduler" or (engine_like(node.value) and (private or node.attr in INTERNALS)):
            yield node.lineno, ast.unparse(node)


def outer_modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "runtime" not in p.relative_to(PACKAGE).parts)


def test_nothing_outside_runtime_reads_the_engines_internals():
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}: {text}" for p in outer_modules()
             for line, text in sorted(internal_reads(ast.parse(p.read_text(), str(p))))]
    assert not found, "read engine.snapshot() or a public method instead:\n" + "\n".join(found)


def test_the_check_sees_what_it_forbids():
    src = ("n = len(self.engine.scheduler.waiting)\nengine._get(rid)\nstate.engine.pool.free_pages\n"
           "x = ae.engine.stats\nself.engine.snapshot().waiting\nengine.__class__\n")
    assert [text for _, text in sorted(internal_reads(ast.parse(src)))] == [
        "self.engine.scheduler", "engine._get", "state.engine.pool", "ae.engine.stats"]


def module_names():
    """Module name -> file, for every module of the package (compiled extensions too)."""
    out = {}
    for p in PACKAGE.rglob("*"):
        if p.suffix not in (".py", ".so", ".pyd") or "__pycache__" in p.parts:
            continue
        parts = p.relative_to(PACKAGE.parent).parts
        parts = parts[:-1] + (p.name.split(".")[0],)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def executed(tree):
    """Every node, except the bodies of `if TYPE_CHECKING:` (imports for annotations only, which
    never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imports_of(name, path, modules):
    """The package's modules `name` imports (a package, for `from pkg import attribute`)."""
    if path.suffix != ".py":
        return set()
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in executed(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph():
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert "pagedecode.runtime.engine" in graph["pagedecode.runtime.async_engine"]
    found = cycles(graph)
    assert not found, "modules that import each other: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in found)


def test_imports_for_annotations_only_are_not_edges(tmp_path):
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                                   "else:\n    from . import c\ndef f():\n    from . import d\n")
    modules = {m: tmp_path / f"{m.split('.')[-1]}.py" for m in ("p.a", "p.b", "p.c", "p.d")}
    assert imports_of("p.a", modules["p.a"], modules) == {"p.c", "p.d"}


def test_the_cycle_finder_finds_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# -- the server: one owner per HTTP exchange ----------------------------------------------------
SERVER = PACKAGE / "server"
STATE_OWNERS = {"admission.py", "reader.py"}     # the two modules that work on the server state


def takes_state_first(tree):
    """Functions whose first argument (after self / cls) is the server state: named `state`, or
    annotated ServerState."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args.posonlyargs + node.args.args
        if args and args[0].arg in ("self", "cls"):
            args = args[1:]
        if args and (args[0].arg == "state" or "ServerState" in ast.unparse(args[0].annotation or ast.Constant(""))):
            yield node.lineno, node.name


def test_only_admission_and_the_reader_take_the_server_state_first():
    found = [f"server/{p.name}:{line}: {name}" for p in sorted(SERVER.glob("*.py")) if p.name not in STATE_OWNERS
             for line, name in takes_state_first(ast.parse(p.read_text(), str(p)))]
    assert not found, "a renderer or handler takes what it needs, not the state:\n" + "\n".join(found)


def test_the_state_check_sees_what_it_forbids():
    src = ("def a(state, x): pass\nasync def b(s: ServerState): pass\nclass C:\n    def m(self, state): pass\n"
           "def ok(request, state): pass\ndef fine(track: Track): pass\n")
    assert [name for _, name in takes_state_first(ast.parse(src))] == ["a", "b", "m"]


def test_the_server_state_is_small():
    assert len((SERVER / "state.py").read_text().splitlines()) <= 150


def test_only_a_track_counts_its_clients():
    """track.attach() / track.detach() (called by the Reader), never a bare `attached -= 1`."""
    found = [f"server/{p.name}:{node.lineno}" for p in sorted(SERVER.glob("*.py")) if p.name != "tracks.py"
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, (ast.AugAssign, ast.Assign)) and "attached" in ast.unparse(node).split("=")[0]]
    assert not found, "count clients with Track.attach / Track.detach:\n" + "\n".join(found)


# A Llama layer's tensors are named on both sides of the compiled forward's boundary
# (csrc/cpu_forward.cpp's Slot, model/cpu_forward.py's LAYER_SLOTS): a layer is never a run of
# positions in a flat list, nor a projection a tuple of slot numbers.
POSITIONAL_SLOTS = [
    r"\[\s*16\s*\*",                             # flat_layers[16 * i + 12: ...]: 16 slots a layer
    r"\bkPerLayer\b|\bflat_layers\b",
    r"\bL\[\s*\d+\s*\]",                        # L[5]: a slot by number
    r"\blayers\[[^\]]*\]\s*\[\s*\d+\s*\]",      # layers[i][6]
    r"\bmm\(\s*\w+\s*,\s*-?\d",                 # mm(x, 1, 2, 8, 12, ...)
]


def positional_slots(text):
    import re
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if any(re.search(p, line) for p in POSITIONAL_SLOTS)]


def test_no_layer_slot_is_a_number_in_model_or_csrc():
    files = sorted((PACKAGE / "model").rglob("*.py")) + sorted((PACKAGE.parent / "csrc").glob("*.[ch]*"))
    found = [f"{p.name}:{n}: {line}" for p in files for n, line in positional_slots(p.read_text())]
    assert not found, "name the slot (Slot / LAYER_SLOTS) instead:\n" + "\n".join(found)


def test_the_slot_check_sees_what_it_forbids():
    src = ("self.flat_layers[16 * i + 12:16 * i + 16] = packed\nTensor qkv = mm(x, 1, 2, 8, 12, L, buf);\n"
           "add_then_norm(hp, o, L[5].data_ptr<T>());\nconst T* ln = layers[i + 1][0].data_ptr<T>();\n"
           "mm(x, kQkv, L, buf); L[kLn2]; m.layers[0][kLn1]; a[i] = load(acc + 16 * i);\n")
    assert [n for n, _ in positional_slots(src)] == [1, 2, 3, 4]


def test_no_finalizer_in_model():
    """What a model holds is freed when its last reference goes, by nobody's __del__: the compiled
    pool keeps a call's inputs itself (csrc/work_pool.h)."""
    found = [f"{p.relative_to(PACKAGE.parent)}:{node.lineno}" for p in sorted((PACKAGE / "model").rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.FunctionDef) and node.name == "__del__"]
    assert not found, "no __del__ in model/: " + ", ".join(found)


# -- folders that show the concepts -------------------------------------------------------------
RUNTIME = PACKAGE / "runtime"
SUBPACKAGES = {"spec": {"speculative", "gates", "rejection", "verify_run", "ngram", "draft_model", "prediction"},
               "output": {"pipeline", "detokenizer", "stop", "events", "delivery", "history", "result"}}


def test_speculation_and_the_output_side_are_subpackages():
    for folder, modules in SUBPACKAGES.items():
        assert (RUNTIME / folder / "__init__.py").is_file()
        assert {p.stem for p in (RUNTIME / folder).glob("*.py")} >= modules
    flat = {p.stem for p in RUNTIME.glob("*.py")}
    assert not flat & {"speculative", "ngram", "draft_model", "prediction", "detokenizer", "stop", "output",
                       "events", "delivery", "history", "result"}
    assert not any(name.startswith("spec_") for name in flat)


def imported_modules(tree, name, is_package=False):
    """Every module a module imports, as absolute names (annotation-only imports included;
    `from pkg import module` names the module)."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file()
                yield node.lineno, sub if is_module else base


def module_name(path):
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_speculation_is_read_through_its_package_only():
    """Outside runtime/spec/, code imports `pagedecode.runtime.spec` (its __init__'s names), never
    one of its modules: what speculation is made of may change without the engine noticing."""
    inside = RUNTIME / "spec"
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}: {module}" for p in sorted(PACKAGE.rglob("*.py"))
             if inside not in p.parents
             for line, module in imported_modules(ast.parse(p.read_text(), str(p)), module_name(p),
                                                  p.name == "__init__.py")
             if module.startswith("pagedecode.runtime.spec.")]
    assert not found, "import from pagedecode.runtime.spec (its package) instead:\n" + "\n".join(found)


def test_the_spec_check_sees_what_it_forbids():
    src = ("from .spec import Speculator\nfrom .spec.gates import Gate\nfrom .spec import ngram\n"
           "import pagedecode.runtime.spec.rejection\nfrom ..runtime.spec import PredictionCursor\n")
    assert [m for _, m in imported_modules(ast.parse(src), "pagedecode.runtime.engine")] == [
        "pagedecode.runtime.spec", "pagedecode.runtime.spec.gates", "pagedecode.runtime.spec.ngram",
        "pagedecode.runtime.spec.rejection", "pagedecode.runtime.spec"]


# -- the environment and the process: one owner each --------------------------------------------
# modules that may read the environment besides env.py, and why
ENV_READERS = {"kernels/_backend.py": "TRITON_INTERPRET, Triton's own switch"}


def environment_reads(tree):
    for node in ast.walk(tree):
        text = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.Name)) else ""
        if text in ("os.environ", "os.getenv", "environ", "getenv"):
            yield node.lineno, text


def test_only_env_reads_the_environment():
    found = [f"{rel}:{line}: {text}" for p in sorted(PACKAGE.rglob("*.py"))
             if (rel := p.relative_to(PACKAGE).as_posix()) not in ("env.py", *ENV_READERS)
             for line, text in environment_reads(ast.parse(p.read_text(), str(p)))]
    assert not found, "ask pagedecode/env.py (add the variable there, with its default and meaning):\n" + "\n".join(found)


def test_the_environment_check_sees_what_it_forbids():
    src = 'a = os.environ.get("X")\nb = os.getenv("Y")\nfrom os import environ\nc = environ["Z"]\nd = env.cpu_matmul()\n'
    assert sorted(line for line, _ in environment_reads(ast.parse(src))) == [1, 2, 4]


# calls that change the whole process: only runtime/process.py makes them, besides these
PROCESS_WIDE = ("set_num_threads", "apply_num_threads", "freeze", "unfreeze", "freeze_heap", "mallopt", "malloc_trim",
                "keep_freed_memory")
PROCESS_OWNERS = {
    "runtime/process.py": PROCESS_WIDE,
    "model/cpu_forward.py": ("keep_freed_memory",),     # the binding's own wrapper, which process.py calls
    "model/parallel.py": ("set_num_threads",),          # a tensor-parallel worker: its own process
    "ray/replica.py": ("set_num_threads",),             # a Ray replica's process, before its engine loads
    "model/loader.py": ("set_num_threads",),            # one_torch_thread: the load's copies, the count put back
}


def process_wide_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in PROCESS_WIDE and not ast.unparse(node.func).startswith(("self.process.", "engine.process.",
                                                                              "self.engine.process.")):
                yield node.lineno, name


def test_only_the_process_owner_changes_the_process():
    found = [f"{rel}:{line}: {name}" for p in sorted(PACKAGE.rglob("*.py"))
             if (rel := p.relative_to(PACKAGE).as_posix())
             for line, name in process_wide_calls(ast.parse(p.read_text(), str(p)))
             if name not in PROCESS_OWNERS.get(rel, ())]
    assert not found, "go through the engine's ProcessEffects (runtime/process.py):\n" + "\n".join(found)


def test_the_process_check_sees_what_it_forbids():
    src = ("torch.set_num_threads(2)\ngc.freeze()\nself.engine.process.set_threads(1)\nengine.process.freeze_heap()\n"
           "lib.mallopt(1, 2)\nkeep_freed_memory()\npd.freeze_heap()\nself.process.keep_freed_memory()\n")
    assert [name for _, name in sorted(process_wide_calls(ast.parse(src)))] == ["set_num_threads", "freeze", "mallopt",
                                                                       "keep_freed_memory", "freeze_heap"]
