"""The package's rooms: imports that run one way everywhere (TYPE_CHECKING imports
count), no module past 700 lines, and the names each face split into rooms (the layout,
the demo, the tpu-inference integration) offered before its split."""

import ast
import importlib
import importlib.util
import pathlib

import pytest

import kvxfer

ROOT = pathlib.Path(kvxfer.__file__).parent

# Every public name each face offered when it was one file; they stay importable there.
FACES = {
    "kvxfer.layout": [
        "LayoutError", "dtype_of", "dtype_name", "short_dtype_name", "natural_bits",
        "shape_text", "Layout", "Axis", "PhysicalGeometry", "SliceGeometry", "inspect",
        "require_addressable"],
    "kvxfer.demo.model": [
        "LayerParams", "LayerKV", "ModelConfig", "tiny_llama", "mixed_layers", "scaled",
        "Params", "init_params", "make_kv_caches", "pad_block_table", "blocks_needed",
        "rms_norm", "rope", "compiled_layer_programs", "layer_step", "decode_layer_step",
        "embed", "logits", "greedy_token", "Model", "main"],
    "kvxfer.integrations.tpu_inference": [
        "ENGINE_COMMIT", "OffloadStats", "KvxferOffloadWorker", "_ENGINE_MODULE"],
    "kvxfer.demo": [
        "DemoOptions", "run_demo", "format_summary", "add_arguments", "build_parser",
        "register_cli", "main", "InjectMode", "INJECT_MODES", "FaultInjector", "Injection",
        "PrefixCacheServer", "Request", "RequestKind", "RequestOutcome", "ServeStats",
        "DeviceBlocks", "page_keys", "make_workload", "shard_caches", "reference_tokens"],
}

@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_still_offers_its_names(face):
    module = importlib.import_module(face)
    missing = [n for n in FACES[face] if not hasattr(module, n)]
    assert not missing, f"{face} lost {missing}"


def _name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvxfer", *parts])


def _is_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _imported_modules(path):
    """The kvxfer modules ``path`` imports anywhere (``from a import b`` is ``a.b`` when
    that is a module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                       else node.module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == "kvxfer")
    return found


def _cycle_from(start, graph):
    """A path of imports from ``start`` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_the_package_imports_one_way():
    graph = {_name(p): _imported_modules(p) for p in ROOT.rglob("*.py")}
    cycles = [c for p in ROOT.rglob("*.py") if (c := _cycle_from(_name(p), graph))]
    assert cycles == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_from("d", graph) is None


def test_no_module_passes_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700}
    assert long == {}
