"""The checked-in fixtures and benchmark programs: schema, parameters, gradients, aliasing."""

from __future__ import annotations

import gzip
import json
import pathlib
import re

import jsonschema
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "fx-graph-v1.schema.json").read_text())
FIXTURES = ROOT / "tests" / "fixtures"
BENCHES = ROOT / "benches" / "data"


def load(path: pathlib.Path) -> dict:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)


def files(d: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in d.glob("*.json*") if p.name.endswith((".json", ".json.gz")))


FAMILIES = FIXTURES / "families"
FIXTURE_FILES = files(FIXTURES) + files(FAMILIES)
BENCH_FILES = files(BENCHES)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
NODE_VALIDATOR = jsonschema.Draft202012Validator({"$ref": "#/$defs/node", "$defs": SCHEMA["$defs"]})
_NAMES = re.compile(r'"(node|name)":"[^"]+"')


def schema_errors(doc: dict) -> list[str]:
    """Validates a document; nodes one at a time, each distinct node shape once.

    Node names cannot change a node's validity beyond being non-empty strings, so nodes that
    differ only in names (the same op in every layer) are validated once: the 80-layer program
    validates in seconds instead of a minute.
    """
    graphs = doc.get("graphs") if isinstance(doc, dict) and doc.get("format") == "fx-program" else None
    containers = graphs if isinstance(graphs, list) else [doc]
    skeleton = json.loads(json.dumps(doc))
    for g in skeleton["graphs"] if graphs is not None else [skeleton]:
        if isinstance(g, dict) and isinstance(g.get("nodes"), list):
            g["nodes"] = []
    errors = [f"{e.message} at {list(e.absolute_path)}" for e in VALIDATOR.iter_errors(skeleton)]
    seen: set[str] = set()
    for gi, g in enumerate(containers):
        for ni, n in enumerate(g.get("nodes", []) if isinstance(g, dict) else []):
            key = _NAMES.sub(r'"\1":"x"', json.dumps(n, sort_keys=True, separators=(",", ":")))
            if key in seen:
                continue
            seen.add(key)
            errors += [f"graph {gi} node {ni}: {e.message} at {list(e.absolute_path)}" for e in NODE_VALIDATOR.iter_errors(n)]
    return errors


def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_there_are_fixtures_and_benches():
    prefixes = {p.name.split(".")[0].rsplit("_", 2)[0] for p in FIXTURE_FILES}
    for m in ("llama", "qwen2_moe", "gpt2"):
        assert (FIXTURES / f"{m}.program.json").exists(), m
        assert m in prefixes
    assert BENCH_FILES, "benches/data has no programs"


@pytest.mark.parametrize("path", FIXTURE_FILES + BENCH_FILES, ids=lambda p: p.name)
def test_validates_against_schema(path):
    doc = load(path)
    errors = schema_errors(doc)
    assert not errors, f"{path.name}: {errors[0]}"
    if path.parent in (FIXTURES, FAMILIES):  # small files: the whole document in one go as well
        assert VALIDATOR.is_valid(doc), path.name


def test_schema_rejects_bad_documents():
    good = load(FIXTURES / "gpt2_fwd_0.json")
    assert VALIDATOR.is_valid(good) and not schema_errors(good)
    prog = load(FIXTURES / "gpt2.program.json")
    bad = json.loads(json.dumps(prog))
    bad["graphs"][1]["nodes"][5]["args"] = [{"dtype": 3}]
    assert schema_errors(bad) and not VALIDATOR.is_valid(bad)
    bad = json.loads(json.dumps(prog))
    bad["graphs"][0]["grads"] = [{"param": "x", "output_index": -1}]
    assert schema_errors(bad) and not VALIDATOR.is_valid(bad)
    bad = json.loads(json.dumps(good))
    bad["format"] = "fx-graf"
    assert not VALIDATOR.is_valid(bad)
    bad = json.loads(json.dumps(good))
    bad["nodes"][0]["op"] = "call_module"
    assert not VALIDATOR.is_valid(bad)
    bad = json.loads(json.dumps(good))
    bad["nodes"][0]["meta"]["val"]["shape"][0] = -1
    assert not VALIDATOR.is_valid(bad)
    bad = json.loads(json.dumps(good))
    bad["params"][0].pop("dtype")
    assert not VALIDATOR.is_valid(bad)
    ok = json.loads(json.dumps(good))
    ok["nodes"][0]["future_field"] = {"anything": 1}  # unknown extras are allowed
    ok["future"] = 2
    assert VALIDATOR.is_valid(ok)


def graphs_of(prefix: str, root: pathlib.Path = FIXTURES) -> list[dict]:
    return load(root / f"{prefix}.program.json")["graphs"]


def check_program(graphs: list[dict]) -> None:
    """Structural rules the schema cannot state, checked the way the importer will."""
    for g in graphs:
        names = [n["name"] for n in g["nodes"]]
        assert len(set(names)) == len(names), g["name"]
        index = {n: i for i, n in enumerate(names)}

        def refs(a):
            if isinstance(a, list):
                for x in a:
                    yield from refs(x)
            elif isinstance(a, dict):
                if set(a) == {"node"}:
                    yield a["node"]
                elif "slice" in a:
                    yield from refs(a["slice"])

        for i, n in enumerate(g["nodes"]):
            for r in refs(n["args"] + list(n["kwargs"].values())):
                assert index[r] < i, f"{g['name']}: {n['name']} uses later/unknown {r}"
        assert sum(n["op"] == "output" for n in g["nodes"]) == 1
        ph = {n["name"]: n for n in g["nodes"] if n["op"] == "placeholder"}
        for p in g["params"]:
            assert p["node"] in ph, (g["name"], p)
            assert ph[p["node"]]["meta"]["val"]["shape"] == p["shape"]
            assert ph[p["node"]]["meta"]["val"]["dtype"] == p["dtype"]


@pytest.mark.parametrize("prefix", ["llama", "qwen2_moe", "qwen2_moe_batched", "gpt2"])
def test_program_structure(prefix):
    graphs = graphs_of(prefix)
    check_program(graphs)
    kinds = [g["kind"] for g in graphs]
    assert kinds == sorted(kinds, key=lambda k: k == "backward"), "forwards first, then backwards"
    # The bundle holds exactly the per-graph files, byte for byte as documents.
    for g in graphs:
        assert load(FIXTURES / f"{g['name']}.json") == g


def model_params(prefix: str) -> dict[str, tuple[list[int], bool]]:
    from zerosched import models

    spec = dict(models.fixture_specs_by_prefix())[prefix]
    model, _ = models.build(spec)
    return {n: (list(p.shape), p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefix", ["llama", "qwen2_moe", "gpt2"])
def test_params_cover_model_parameters_by_fqn(prefix):
    expected = model_params(prefix)
    seen: dict[str, list[int]] = {}
    for g in graphs_of(prefix):
        names = [p["name"] for p in g["params"]]
        assert len(names) == len(set(names)), f"{g['name']}: a parameter appears twice"
        nodes = [p["node"] for p in g["params"]]
        assert len(nodes) == len(set(nodes))
        for p in g["params"]:
            assert seen.setdefault(p["name"], p["shape"]) == p["shape"]
    assert set(seen) == set(expected)
    for name, shape in seen.items():
        assert expected[name][0] == shape, name


def test_gpt2_tied_embedding_appears_once():
    for g in graphs_of("gpt2"):
        names = [p["name"] for p in g["params"]]
        assert "lm_head.weight" not in names
    fw = graphs_of("gpt2")[0]
    assert [p["name"] for p in fw["params"]].count("transformer.wte.weight") == 1
    # and it is used twice in the forward: the embedding lookup and the lm_head matmul
    node = next(p["node"] for p in fw["params"] if p["name"] == "transformer.wte.weight")
    uses = [n for n in fw["nodes"] if {"node": node} in n["args"]]
    assert len(uses) >= 2, [n["target"] for n in uses]


def test_moe_experts_are_sharded_params_in_compiled_graphs():
    for prefix in ("qwen2_moe", "qwen2_moe_batched"):
        graphs = graphs_of(prefix)
        names = {p["name"] for g in graphs for p in g["params"]}
        for layer in (0, 1):
            for w in ("gate_up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{w}" in names
            assert f"model.layers.{layer}.mlp.shared_expert.gate_proj.weight" in names
            assert f"model.layers.{layer}.mlp.shared_expert_gate.weight" in names
        assert not any(p.get("persistent") for g in graphs for p in g["params"]), "every parameter sharded"
        targets = {n["target"] for g in graphs for n in g["nodes"]}
        assert not {"aten.nonzero.default", "aten._local_scalar_dense.default"} & targets
    targets = {n["target"] for g in graphs_of("qwen2_moe") for n in g["nodes"]}
    assert "aten._grouped_mm.default" in targets


@pytest.mark.parametrize("prefix", ["llama", "qwen2_moe", "qwen2_moe_batched", "gpt2"])
def test_grads_cover_every_trainable_parameter(prefix):
    graphs = graphs_of(prefix)
    fw_params = {p["name"]: p["shape"] for g in graphs if g["kind"] == "forward" for p in g["params"]}
    got: dict[str, list[int]] = {}
    for g in graphs:
        if g["kind"] != "backward":
            continue
        out = next(n for n in g["nodes"] if n["op"] == "output")
        outs = out["args"][0]
        by_name = {n["name"]: n for n in g["nodes"]}
        for gr in g["grads"]:
            ref = outs[gr["output_index"]]
            assert isinstance(ref, dict) and "node" in ref, gr
            got[gr["param"]] = by_name[ref["node"]]["meta"]["val"]["shape"]
        assert len({gr["output_index"] for gr in g["grads"]}) == len(g["grads"])
    assert set(got) == set(fw_params)
    for name, shape in got.items():
        assert shape == fw_params[name], name


def test_aliases_and_mutates_on_view_ops_in_fixtures():
    views = {"aten.view.default", "aten.permute.default", "aten.unsqueeze.default", "aten.expand.default",
             "aten.slice.Tensor", "aten.alias.default", "aten.squeeze.dims", "operator.getitem"}
    seen = set()
    for prefix in ("llama", "qwen2_moe", "gpt2"):
        for g in graphs_of(prefix):
            for n in g["nodes"]:
                if n["op"] != "call_function":
                    continue
                assert "aliases" in n["meta"] and "mutates" in n["meta"], n["name"]
                if n["target"] in views:
                    seen.add(n["target"])
                    assert n["meta"]["aliases"] == [0], (n["name"], n["target"])
                if n["target"] in ("aten.mm.default", "aten.add.Tensor", "aten.embedding.default"):
                    assert n["meta"]["aliases"] == [] and n["meta"]["mutates"] == [], n["name"]
    assert {"aten.view.default", "aten.permute.default", "operator.getitem"} <= seen


def test_benches_are_large_and_sharded():
    for p in BENCH_FILES:
        assert p.name.endswith(".json.gz"), p.name
        assert p.stat().st_size < 8 * 2**20 or "l80" in p.name, f"{p.name} is over 8 MB"
        graphs = load(p)["graphs"]
        assert any(g["kind"] == "backward" for g in graphs)
        assert all(g["params"] for g in graphs if g["kind"] == "forward")


# --------------------------------------------------------------------------------------------
# model families (tests/fixtures/families): other architectures, core and no decompositions
# --------------------------------------------------------------------------------------------


def _families() -> list[tuple[str, str]]:
    from zerosched import arch

    return [(f, m) for f in arch.FAMILY_FIXTURES for m in arch.FAMILY_DECOMPOSITIONS]


def test_every_family_fixture_is_checked_in():
    want = sorted(f"{f}_{m}.program.json.gz" for f, m in _families())
    assert sorted(p.name for p in files(FAMILIES)) == want
    for p in files(FAMILIES):
        assert p.stat().st_size < 100_000, f"{p.name} is no longer tiny"


def _smallest_budget(data: bytes) -> int:
    """The smallest budget every graph's prefetch schedule fits: each refusal names the smallest
    for the first graph over it."""
    import zerosched
    from zerosched import _core

    budget = 1
    for _ in range(100):
        try:
            _core.schedule(data, {"world_size": 2, "budget": budget})
            return budget
        except zerosched.OverBudgetError as e:
            assert e.needed > budget
            budget = e.needed
    raise AssertionError("no budget found")


@pytest.mark.parametrize("family, mode", _families(), ids=lambda x: x)
def test_a_family_fixture_schedules_with_every_scheduler_and_passes_the_checker(family, mode):
    from zerosched import _core

    path = FAMILIES / f"{family}_{mode}.program.json.gz"
    graphs = load(path)["graphs"]
    check_program(graphs)
    data = path.read_bytes()
    runs = [(s, None) for s in ("prefetch", "jit", "deepcompile")] + [("prefetch", _smallest_budget(data))]
    for scheduler, budget in runs:  # unlimited, and the smallest budget a prefetch schedule fits
        out, _ = _core.schedule(data, {"world_size": 2, "scheduler": scheduler, "budget": budget})
        summary = json.loads(_core.check(out, {"world_size": 2, "budget": budget}))
        gathered = [s for s in summary["schedules"] if s["gathers"] + s["reuses"] > 0]
        assert gathered, f"{scheduler}: no graph gathers a parameter"
    targets = {n["target"] for g in graphs for n in g["nodes"]}
    # AOTAutograd's own loss op survives only without a decomposition table.
    assert ("aten.nll_loss_forward.default" in targets) == (mode == "none")
    names = {p["name"] for g in graphs for p in g["params"]}
    grads = {gr["param"] for g in graphs for gr in g.get("grads", [])}
    assert grads <= names and grads


def _params(family: str) -> set[str]:
    return {p["name"] for g in load(FAMILIES / f"{family}_core.program.json.gz")["graphs"] for p in g["params"]}


def test_family_fixtures_hold_what_their_family_is_chosen_for():
    assert "bert.encoder.layer.1.attention.self.query.weight" in _params("bert")
    t5 = _params("t5")  # encoder-decoder, the LM head tied to the shared embedding
    assert {"shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
            "decoder.block.0.layer.1.EncDecAttention.q.weight"} <= t5
    assert "lm_head.weight" not in t5
    assert "gpt_neox.layers.1.attention.query_key_value.weight" in _params("gpt_neox")  # fused QKV
    gemma = _params("gemma")
    assert "model.embed_tokens.weight" in gemma and "lm_head.weight" not in gemma  # tied
    assert "vit.embeddings.patch_embeddings.projection.weight" in _params("vit")
    # Eager routing: a loop over the experts hit breaks the step into many graphs.
    olmoe = load(FAMILIES / "olmoe_none.program.json.gz")["graphs"]
    assert len(olmoe) > 4 and any("mlp.gate.weight" in p["name"] for g in olmoe for p in g["params"])
    gelu = {n["kwargs"].get("approximate") for g in load(FAMILIES / "gemma_core.program.json.gz")["graphs"]
            for n in g["nodes"] if n["target"] == "aten.gelu.default"}
    assert gelu == {"tanh"}


def test_a_family_fixture_exports_to_the_same_bytes(tmp_path):
    from zerosched import arch, export

    export.export_model(arch.FAMILY_FIXTURES["vit"], str(tmp_path), prefix="vit_none", program_only=True,
                        gzip_threshold=0, decompositions="none", log=lambda *_: None)
    name = "vit_none.program.json.gz"
    assert (tmp_path / name).read_bytes() == (FAMILIES / name).read_bytes(), \
        "regenerate with `python -m zerosched.export --fixtures tests/fixtures`"


@pytest.mark.parametrize("mode", ["core", "none"])
def test_each_olmoe_backward_names_the_forward_that_saved_its_values(mode):
    graphs = load(FAMILIES / f"olmoe_{mode}.program.json.gz")["graphs"]
    by_name = {g["name"]: (i, g) for i, g in enumerate(graphs)}
    backwards = [(i, g) for i, g in enumerate(graphs) if g["kind"] == "backward"]
    assert len(backwards) > 4
    named = [g["forward"] for _, g in backwards]
    assert len(set(named)) == len(named), "one backward per forward"
    for i, g in backwards:
        fi, f = by_name[g["forward"]]
        assert fi < i and f["kind"] == "forward"
        (out,) = [n for n in f["nodes"] if n["op"] == "output"]
        returned = {a["node"] for a in out["args"][0] if isinstance(a, dict)}
        saved = {n["name"] for n in g["nodes"] if n["op"] == "placeholder" and not n["name"].startswith("tangents_")}
        assert saved <= returned, f"{g['name']} reads {sorted(saved - returned)}, which {f['name']} does not return"
