"""scripts/compare-outputs, the fixture table's judge of the CUDA backend against the CPU
backend: its bounds, and the cases it must refuse."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare-outputs"


def outputs(tmp_path, name, graphs):
    """A `zerosched run --outputs` file of (graph, [(dtype, values)]) pairs."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"graphs": [
        {"graph": g, "outputs": [{"dtype": d, "shape": [len(v)], "values": v} for d, v in outs]}
        for g, outs in graphs]}))
    return str(path)


def compare(tmp_path, ref, got):
    r = subprocess.run([sys.executable, str(SCRIPT), outputs(tmp_path, "ref", ref), outputs(tmp_path, "got", got)],
                       capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def test_equal_outputs_pass_with_no_error(tmp_path):
    g = [("fwd", [("float32", [1.0, -2.0]), ("int64", [3, 4])])]
    assert compare(tmp_path, g, g) == (0, "0 -")


def test_a_float32_output_is_held_to_its_own_bound_in_a_float32_program(tmp_path):
    ref = [("fwd", [("float32", [1.0, 1.0])])]
    got = [("fwd", [("float32", [1.0, 1.004])])]
    rc, out = compare(tmp_path, ref, got)
    assert rc == 1 and out.endswith("fwd output 0")


def test_a_float32_output_of_a_bfloat16_program_carries_bfloat16_rounding(tmp_path):
    ref = [("fwd", [("float32", [1.0, 1.0]), ("bfloat16", [0.5])])]
    got = [("fwd", [("float32", [1.0, 1.004]), ("bfloat16", [0.5])])]
    rc, out = compare(tmp_path, ref, got)
    assert rc == 0, out
    # Even the looser bound holds a real error.
    got = [("fwd", [("float32", [1.0, 1.5]), ("bfloat16", [0.5])])]
    assert compare(tmp_path, ref, got)[0] == 1


def test_nan_where_the_reference_is_finite_fails(tmp_path):
    ref = [("bwd", [("bfloat16", [1.0, 2.0])])]
    got = [("bwd", [("bfloat16", [1.0, "NaN"])])]
    assert compare(tmp_path, ref, got) == (1, "inf bwd output 0")


def test_integers_must_be_equal(tmp_path):
    ref = [("fwd", [("int64", [1, 2])])]
    got = [("fwd", [("int64", [1, 3])])]
    assert compare(tmp_path, ref, got)[0] == 1


def test_a_missing_output_cannot_be_compared(tmp_path):
    ref = [("fwd", [("float32", [1.0]), ("float32", [2.0])])]
    got = [("fwd", [("float32", [1.0])])]
    rc, out = compare(tmp_path, ref, got)
    assert rc == 2 and "1 outputs against 2" in out
