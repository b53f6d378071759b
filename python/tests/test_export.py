"""The exporter itself: determinism, encoding, schema-derived aliasing, clear errors."""

from __future__ import annotations

import gzip
import json
import math
import operator
import pathlib

import pytest
import torch
import torch.fx

from zerosched import export, models

ROOT = pathlib.Path(__file__).resolve().parents[2]
aten = torch.ops.aten


def test_export_is_byte_identical_to_the_checked_in_fixture(tmp_path):
    """Exporting twice gives the same bytes: once when the fixtures were generated (another
    process), once here."""
    spec = dict(models.fixture_specs_by_prefix())["gpt2"]
    a = export.export_model(spec, str(tmp_path / "a"), prefix="gpt2", log=lambda *_: None)
    names_a = sorted(pathlib.Path(p).name for p in a["files"])
    assert names_a == ["gpt2.program.json", "gpt2_bwd_0.json", "gpt2_fwd_0.json"]
    for name in names_a:
        da = (tmp_path / "a" / name).read_bytes()
        assert da == (ROOT / "tests" / "fixtures" / name).read_bytes(), (
            f"{name} differs from tests/fixtures: regenerate with `python -m zerosched.export --fixtures tests/fixtures`"
        )
        assert b"0x" not in da, "a memory address leaked into a repr"


def test_same_module_exported_twice_in_one_process_gives_identical_bytes(tmp_path):
    def export_once(d):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        x = torch.randn(3, 8)
        graphs = export.capture(m, lambda cm: cm(x).pow(2).sum().backward())
        return export.write_program(str(tmp_path / d), "seq", graphs)

    pa, pb = export_once("a"), export_once("b")
    assert [pathlib.Path(p).name for p in pa] == [pathlib.Path(p).name for p in pb]
    for x, y in zip(pa, pb):
        assert pathlib.Path(x).read_bytes() == pathlib.Path(y).read_bytes(), x


def test_gzip_output_is_deterministic(tmp_path):
    text = '{"format":"fx-graph","version":1,"nodes":[]}\n' * 10
    p1 = export.write_text(str(tmp_path / "x"), text, gzip_threshold=0)
    d1 = pathlib.Path(p1).read_bytes()
    p2 = export.write_text(str(tmp_path / "x"), text, gzip_threshold=0)
    assert p1 == p2 and p1.endswith(".json.gz")
    assert pathlib.Path(p2).read_bytes() == d1
    assert d1[4:8] == b"\0\0\0\0", "gzip mtime must be 0"
    assert gzip.decompress(d1).decode() == text
    p3 = export.write_text(str(tmp_path / "x"), text)  # small: plain .json, the .gz is removed
    assert p3.endswith(".json") and not (tmp_path / "x.json.gz").exists()


class _Obj:
    pass


def test_encode_arg_table():
    enc = export.encode_arg
    assert enc(None) is None and enc(True) is True and enc(3) == 3 and enc(1.5) == 1.5 and enc("sum") == "sum"
    assert enc(math.inf) == {"float": "inf"} and enc(-math.inf) == {"float": "-inf"}
    assert enc(math.nan) == {"float": "nan"}
    assert enc(torch.bfloat16) == {"dtype": "bfloat16"} and enc(torch.int64) == {"dtype": "int64"}
    assert enc(torch.device("cpu")) == {"device": "cpu"}
    assert enc(torch.strided) == {"layout": "strided"}
    assert enc(torch.contiguous_format) == {"memory_format": "contiguous_format"}
    assert enc(torch.channels_last) == {"memory_format": "channels_last"}
    assert enc(slice(1, None, 2)) == {"slice": [1, None, 2]}
    assert enc((1, [2, torch.float32])) == [1, [2, {"dtype": "float32"}]]
    assert enc(torch.Size([2, 3])) == [2, 3]
    assert enc(2**70) == {"repr": str(2**70)}
    r = enc(_Obj())
    assert set(r) == {"repr"} and "0x" not in r["repr"]
    g = torch.fx.Graph()
    x = g.placeholder("x")
    assert enc(x) == {"node": "x"}


def test_encode_symint_with_hint():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_unbacked_symint() if False else None  # unbacked ints have no hint; use a backed one
    from torch._dynamo.source import ConstantSource

    sym = env.create_symintnode(env.create_symbol(256, ConstantSource("n")), hint=256)
    out = export.encode_arg(sym * 2)
    assert out["hint"] == 512 and "sym" in out and isinstance(out["sym"], str)


def _graph(build) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    build(g)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _fake(*shape):
    return torch.empty(*shape, device="meta")


def test_aliases_and_mutates_from_schemas():
    def build(g):
        x = g.placeholder("x")
        x.meta["val"] = _fake(4, 6)

        def cf(name, target, args):
            return g.create_node("call_function", target, args, {}, name=name)

        v = cf("view", aten.view.default, (x, [24]))
        t = cf("t", aten.t.default, (x,))
        sp = cf("split", aten.split.Tensor, (x, 2, 1))
        it = cf("getitem", operator.getitem, (sp, 0))
        ub = cf("unbind", aten.unbind.int, (x,))
        mm = cf("mm", aten.mm.default, (x, t))
        cp = cf("copy_", aten.copy_.default, (x, x))
        ad = cf("add_", aten.add_.Tensor, (x, x))
        ip = cf("index_put_", aten.index_put_.default, (x, [None], x))
        g.output((v, it, ub, mm, cp, ad, ip))

    doc = export.graph_to_doc(_graph(build), name="t")
    meta = {n["name"]: n["meta"] for n in doc["nodes"]}
    assert (meta["view"]["aliases"], meta["view"]["mutates"]) == ([0], [])
    assert meta["t"]["aliases"] == [0]
    assert meta["split"]["aliases"] == [0], "list-returning views alias their input"
    assert meta["unbind"]["aliases"] == [0]
    assert meta["getitem"]["aliases"] == [0]
    assert (meta["mm"]["aliases"], meta["mm"]["mutates"]) == ([], [])
    assert (meta["copy_"]["aliases"], meta["copy_"]["mutates"]) == ([0], [0])
    assert (meta["add_"]["aliases"], meta["add_"]["mutates"]) == ([0], [0])
    assert meta["index_put_"]["mutates"] == [0]
    out = doc["nodes"][-1]
    assert out["op"] == "output" and out["target"] == "output" and len(out["args"]) == 1
    assert doc["nodes"][0]["meta"]["val"] == {"shape": [4, 6], "dtype": "float32", "stride": [6, 1],
                                              "storage_offset": 0, "device": "meta", "requires_grad": False}


def test_targets_drop_torch_ops_prefix():
    def build(g):
        x = g.placeholder("x")
        a = g.call_function(aten.mm.default, (x, x))
        b = g.call_function(torch.ops.prims.convert_element_type.default, (a, torch.bfloat16))
        c = g.call_function(operator.getitem, (b, 0))
        g.output(c)

    targets = [n["target"] for n in export.graph_to_doc(_graph(build))["nodes"]]
    assert targets == ["x", "aten.mm.default", "prims.convert_element_type.default", "operator.getitem", "output"]


class _WithSub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x).relu()


def test_unrepresentable_graph_gives_clear_error():
    gm = torch.fx.symbolic_trace(_WithSub())  # call_module + call_method: not an AOT graph
    with pytest.raises(export.ExportError, match=r"node 'lin'.*call_module.*cannot be represented"):
        export.graph_to_doc(gm, name="sub")

    def build(g):
        x = g.placeholder("x")
        y = g.create_node("call_method", "relu", (x,), {}, name="relu")
        g.output(y)

    with pytest.raises(export.ExportError, match=r"node 'relu'.*call_method"):
        export.graph_to_doc(_graph(build), name="m")


def test_higher_order_op_gives_clear_error():
    from torch._higher_order_ops.wrap import wrap

    def build(g):
        x = g.placeholder("x")
        y = g.call_function(wrap, (x,))
        g.output(y)

    with pytest.raises(export.ExportError, match="higher-order operator"):
        export.graph_to_doc(_graph(build), name="hop")


def test_rng_wrappers_of_activation_checkpointing_are_the_op_they_wrap():
    """AOTAutograd wraps a random op that activation checkpointing recomputes: the forward runs
    it through run_and_save_rng_state, the backward again through run_with_rng_state."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    def build(g):
        x = g.placeholder("x")
        state = g.placeholder("state")
        saved = g.call_function(run_and_save_rng_state, (aten.native_dropout.default, x, 0.5, True))
        again = g.call_function(run_with_rng_state, (state, aten.native_dropout.default, x, 0.5, True))
        g.output((g.call_function(operator.getitem, (saved, 1)), again))

    doc = export.graph_to_doc(_graph(build), name="rng")
    by_target = {n["target"].rsplit(".", 1)[-1]: n for n in doc["nodes"]}
    for name, shift in (("run_and_save_rng_state", 1), ("run_with_rng_state", 2)):
        node = [n for t, n in by_target.items() if name in t][0]
        assert node["args"][shift - 1] == {"repr": "aten.native_dropout.default"}
        assert (node["meta"]["aliases"], node["meta"]["mutates"]) == ([], [])


def test_capture_maps_params_and_grads_on_a_plain_module():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    m[2].bias.requires_grad_(False)
    x = torch.randn(5, 8)

    def step(cm):
        cm(x).sum().backward()

    graphs = export.capture(m, step)
    assert [g.kind for g in graphs] == ["forward", "backward"]
    fw, bw = graphs
    assert [p.name for p in fw.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(name for name, _ in bw.grads) == ["0.bias", "0.weight", "2.weight"]
    export.name_graphs("seq", graphs)
    doc = bw.to_doc()
    outs = doc["nodes"][-1]["args"][0]
    shapes = {n["name"]: n["meta"]["val"]["shape"] for n in doc["nodes"] if n["op"] != "output"}
    for gr in doc["grads"]:
        assert shapes[outs[gr["output_index"]]["node"]] == list(dict(m.named_parameters())[gr["param"]].shape)
    fdoc = fw.to_doc()
    ph = {n["name"]: n["meta"]["val"] for n in fdoc["nodes"] if n["op"] == "placeholder"}
    p2b = next(p for p in fw.params if p.name == "2.bias")
    assert ph[p2b.node]["requires_grad"] is False
    assert ph[fw.params[0].node]["requires_grad"] is True


def test_cli_rejects_missing_arguments(capsys):
    with pytest.raises(SystemExit):
        export.main([])


# --------------------------------------------------------------------------------------------
# any transformers architecture: --config FILE, --arch NAME --set KEY=VALUE
# --------------------------------------------------------------------------------------------

TINY_NEOX = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "num_hidden_layers": 1,
             "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 128,
             "max_position_embeddings": 64, "use_parallel_residual": True}


def _program(out: pathlib.Path, prefix: str) -> bytes:
    return (out / f"{prefix}.program.json").read_bytes()


def _schedules_and_checks(data: bytes) -> dict:
    from zerosched import _core

    out, _ = _core.schedule(data, {"world_size": 2})
    summary = json.loads(_core.check(out, {"world_size": 2}))
    assert summary["schedules"] and all(s["gathers"] + s["reuses"] > 0 for s in summary["schedules"])
    return json.loads(data)


def test_a_config_file_of_an_architecture_outside_the_built_in_four_exports(tmp_path):
    import transformers

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_NEOX))
    assert export.main(["--config", str(cfg), "-o", str(tmp_path / "out")]) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["gpt_neox.program.json", "gpt_neox_bwd_0.json", "gpt_neox_fwd_0.json"]
    doc = _schedules_and_checks(_program(tmp_path / "out", "gpt_neox"))
    assert [g["kind"] for g in doc["graphs"]] == ["forward", "backward"]
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**TINY_NEOX))
    fw_params = {p["name"]: p["shape"] for p in doc["graphs"][0]["params"]}
    assert fw_params == {n: list(p.shape) for n, p in model.named_parameters()}
    assert {g["param"] for g in doc["graphs"][1]["grads"]} == set(fw_params)
    # the fused QKV projection of a parallel-residual block, one parameter
    assert fw_params["gpt_neox.layers.0.attention.query_key_value.weight"] == [96, 32]
    # the same command gives the same bytes
    assert export.main(["--config", str(cfg), "-o", str(tmp_path / "again")]) == 0
    assert _program(tmp_path / "again", "gpt_neox") == _program(tmp_path / "out", "gpt_neox")


def test_an_architecture_by_name_takes_its_defaults_and_the_overrides(tmp_path):
    sets = ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64",
            "vocab_size=128", "max_position_embeddings=32"]
    argv = ["--arch", "bert", "--seq", "8", "--prefix", "enc", "--program-only", "-o", str(tmp_path)]
    assert export.main(argv + [f"--set={s}" for s in sets]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enc.program.json"]
    doc = _schedules_and_checks(_program(tmp_path, "enc"))
    fw = doc["graphs"][0]
    names = {p["name"] for p in fw["params"]}
    assert "bert.encoder.layer.0.attention.self.query.weight" in names, "BertForMaskedLM, the encoder's head"
    assert not any(k.startswith("bert.encoder.layer.1.") for k in names), "--set num_hidden_layers=1"
    ids = next(n for n in fw["nodes"] if n["op"] == "placeholder" and n["meta"]["val"]["dtype"] == "int64")
    assert ids["meta"]["val"]["shape"] == [2, 8]
    targets = {n["target"] for g in doc["graphs"] for n in g["nodes"]}
    assert not {t for t in targets if "dropout" in t or "rand" in t}, "dropout is 0: no RNG ops"


@pytest.mark.parametrize("argv, message", [
    (["--arch", "no_such_arch"], "neither a transformers model type"),
    (["--arch", "bert", "--set", "num_hiden_layers=1"], "BertConfig has no field 'num_hiden_layers'"),
])
def test_an_architecture_export_names_what_is_wrong(tmp_path, capsys, argv, message):
    assert export.main(argv + ["-o", str(tmp_path)]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--arch", "bert", "--layers", "2"], ["--model", "llama", "--set", "a=1"],
                                  ["--arch", "bert", "--config", "c.json"], ["--arch", "bert", "--set", "novalue"]])
def test_flags_of_the_other_kind_of_model_are_refused(tmp_path, argv):
    with pytest.raises(SystemExit):
        export.main(argv + ["-o", str(tmp_path)])


# --------------------------------------------------------------------------------------------
# a user's own module: --module package.module:factory (export_factories.py)
# --------------------------------------------------------------------------------------------


def test_a_factory_returning_a_batch_exports_its_step(tmp_path):
    import export_factories

    assert export.main(["--module", "export_factories:two_tower_batch", "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "two_tower_batch.program.json", "two_tower_batch_bwd_0.json", "two_tower_batch_fwd_0.json"]
    doc = _schedules_and_checks(_program(tmp_path, "two_tower_batch"))
    fw, bw = doc["graphs"]
    model, _ = export_factories.two_tower_batch()
    assert {p["name"] for p in fw["params"]} == {n for n, _ in model.named_parameters()}
    assert {g["param"] for g in bw["grads"]} == {n for n, _ in model.named_parameters()}
    assert "aten.mse_loss.default" not in {n["target"] for n in fw["nodes"]}, "core ATen: mse_loss decomposed"


def test_a_factory_returning_a_step_function_exports_it(tmp_path):
    assert export.main(["--module", "export_factories:mlp_step", "--prefix", "mlp", "-o", str(tmp_path)]) == 0
    doc = _schedules_and_checks(_program(tmp_path, "mlp"))
    assert [g["kind"] for g in doc["graphs"]] == ["forward", "backward"]
    assert [p["name"] for p in doc["graphs"][0]["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_the_module_flag_works_from_the_shell(tmp_path):
    import os
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([sys.executable, "-m", "zerosched.export", "--module", "export_factories:mlp_step",
                        "--program-only", "-o", str(tmp_path)], cwd=tests, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mlp_step.program.json").exists()


@pytest.mark.parametrize("ref, message", [
    ("export_factories:logits_only", "returned Tensor, not a scalar loss"),
    ("export_factories:nothing", "export_factories has no 'nothing'"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("export_factories", "expected package.module:factory"),
])
def test_a_bad_factory_is_named_in_the_error(tmp_path, capsys, ref, message):
    assert export.main(["--module", ref, "-o", str(tmp_path)]) == 1
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --decompositions core|none|inductor
# --------------------------------------------------------------------------------------------

#: Ops that tell the tables apart in GPT-2's step: AOTAutograd's own ops without a table, the
#: loss and layer norm decomposed by core ATen, layer norm as var_mean under Inductor's table.
DECOMPOSED = {
    "none": ({"aten.nll_loss_forward.default", "aten.native_layer_norm_backward.default", "aten.t.default"},
             {"aten.gather.default"}),
    "core": ({"aten.gather.default", "aten.native_layer_norm.default"},
             {"aten.nll_loss_forward.default", "aten.t.default", "aten.var_mean.correction"}),
    "inductor": ({"aten.var_mean.correction"}, {"aten.native_layer_norm.default", "aten.t.default"}),
}


@pytest.mark.parametrize("mode", export.DECOMPOSITIONS)
def test_each_decomposition_table_exports_imports_and_schedules(tmp_path, mode):
    from zerosched import _core

    argv = ["--model", "gpt2", "--decompositions", mode, "--program-only", "-o", str(tmp_path)]
    assert export.main(argv) == 0
    data = _program(tmp_path, "gpt2")
    targets = {n["target"] for g in json.loads(data)["graphs"] for n in g["nodes"]}
    present, absent = DECOMPOSED[mode]
    assert present <= targets and not absent & targets, (present - targets, absent & targets)
    for scheduler in ("prefetch", "jit", "deepcompile"):
        out, _ = _core.schedule(data, {"world_size": 2, "scheduler": scheduler})
        assert json.loads(_core.check(out, {"world_size": 2}))["schedules"], scheduler
    if mode == "core":
        assert data == (ROOT / "tests" / "fixtures" / "gpt2.program.json").read_bytes(), "core is the default"
