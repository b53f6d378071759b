//! The self-test's op checks: each op of the CUDA backend beyond the generated kernels'
//! direct checks, run as a one-node graph by the executor on the GPU and by the CPU backend
//! on the same inputs, compared within docs/exec.md's per-dtype bound (times a slack for
//! products and sums, whose accumulation order differs).

use super::{Elem, Gpu, Reduce, Result, Row, bound, values};
use zerosched_exec::ProgramRun;
use zerosched_exec::host::{self, Data};
use zerosched_exec::inputs::{Given, Inputs};
use zerosched_exec::world::{run_program, run_threads};
use zerosched_exec_cpu::Cpu;
use zerosched_exec_cuda::backend::Cuda;
use zerosched_exec_cuda::comm::NcclComm;
use zerosched_exec_cuda::nccl::Comm;
use zerosched_exec_cuda::rendezvous::Launch;
use zerosched_ir::Dtype;

/// How an input is filled.
#[derive(Clone, Copy)]
enum Fill {
    /// Uniform floats in `[lo, hi)`.
    U(f64, f64),
    /// Integers in `[lo, hi)`.
    I(i64, i64),
    /// Booleans, about half true.
    B,
    /// Sorted group ends in `[0, n]`.
    Ends(i64),
    /// These values.
    V(&'static [f64]),
}

struct Case {
    name: &'static str,
    target: &'static str,
    ins: Vec<(Dtype, Vec<usize>, Fill)>,
    args: String,
    kwargs: &'static str,
    /// The output's `meta.val` (a tensor, or a list for multi-output ops).
    out: String,
    slack: f64,
}

fn t(dtype: &str, shape: &[usize]) -> String {
    format!(r#"{{"dtype":"{dtype}","shape":{shape:?}}}"#)
}

fn tuple(parts: &[Option<String>]) -> String {
    let p: Vec<String> = parts
        .iter()
        .map(|p| p.clone().unwrap_or_else(|| "null".into()))
        .collect();
    format!("[{}]", p.join(","))
}

fn input(seed: u64, dtype: Dtype, shape: &[usize], fill: Fill) -> host::Tensor {
    let n: usize = shape.iter().product();
    let raw: Vec<f64> = match fill {
        Fill::U(lo, hi) => values(n, seed, lo, hi),
        Fill::I(lo, hi) => values(n, seed, 0.0, 1.0)
            .iter()
            .map(|u| (lo + (u * (hi - lo) as f64) as i64).min(hi - 1) as f64)
            .collect(),
        Fill::B => values(n, seed, 0.0, 1.0)
            .iter()
            .map(|u| f64::from(u8::from(*u < 0.5)))
            .collect(),
        Fill::Ends(end) => {
            let mut v: Vec<f64> = values(n, seed, 0.0, 1.0)
                .iter()
                .map(|u| (u * end as f64).floor())
                .collect();
            v.sort_by(f64::total_cmp);
            if let Some(l) = v.last_mut() {
                *l = end as f64;
            }
            v
        }
        Fill::V(v) => v.to_vec(),
    };
    let sh = ndarray::IxDyn(shape);
    let data = match host::kind(dtype).expect("dtype") {
        host::Kind::F32 => Data::F32(
            ndarray::ArrayD::from_shape_vec(
                sh,
                raw.iter()
                    .map(|&x| host::round_to(dtype, x as f32))
                    .collect(),
            )
            .expect("shape")
            .into_shared(),
        ),
        host::Kind::F64 => Data::F64(
            ndarray::ArrayD::from_shape_vec(sh, raw)
                .expect("shape")
                .into_shared(),
        ),
        host::Kind::I64 => Data::I64(
            ndarray::ArrayD::from_shape_vec(sh, raw.iter().map(|&x| x as i64).collect())
                .expect("shape")
                .into_shared(),
        ),
        host::Kind::Bool => Data::Bool(
            ndarray::ArrayD::from_shape_vec(sh, raw.iter().map(|&x| x != 0.0).collect())
                .expect("shape")
                .into_shared(),
        ),
    };
    host::Tensor { dtype, data }
}

/// The one-node graph of case `k` (placeholders `c{k}x0`, `c{k}x1`, ...: unique over a
/// bundle of cases) as fx-graph JSON, its inputs added to `given`.
fn graph(case: &Case, k: usize, given: &mut Inputs) -> String {
    let seed = 100 + k as u64;
    let mut nodes = vec![];
    for (i, (dtype, shape, fill)) in case.ins.iter().enumerate() {
        nodes.push(format!(
            r#"{{"name":"c{k}x{i}","op":"placeholder","target":"c{k}x{i}","args":[],"kwargs":{{}},"meta":{{"val":{}}}}}"#,
            t(&dtype.to_string(), shape)
        ));
        given.given.insert(
            format!("c{k}x{i}"),
            Given {
                tensor: input(seed + i as u64, *dtype, shape, *fill),
                file: "selftest".into(),
            },
        );
    }
    let rename = |s: &str| s.replace(r#"{"node":"x"#, &format!(r#"{{"node":"c{k}x"#));
    nodes.push(format!(
        r#"{{"name":"y","op":"call_function","target":"{}","args":{},"kwargs":{},"meta":{{"val":{}}}}}"#,
        case.target,
        rename(&case.args),
        rename(case.kwargs),
        case.out
    ));
    // A multi-output op returns each of its tensors through a getitem.
    let outs: Vec<String> = if case.out.starts_with('[') {
        let parts: Vec<serde_json::Value> = serde_json::from_str(&case.out).expect("out");
        let mut names = vec![];
        for (j, p) in parts.iter().enumerate() {
            if p.is_null() {
                continue;
            }
            nodes.push(format!(
                r#"{{"name":"y_{j}","op":"call_function","target":"operator.getitem","args":[{{"node":"y"}},{j}],"kwargs":{{}},"meta":{{"val":{p}}}}}"#
            ));
            names.push(format!(r#"{{"node":"y_{j}"}}"#));
        }
        names
    } else {
        vec![r#"{"node":"y"}"#.to_string()]
    };
    nodes.push(format!(
        r#"{{"name":"output","op":"output","target":"output","args":[[{}]],"kwargs":{{}},"meta":{{}}}}"#,
        outs.join(",")
    ));
    format!(
        r#"{{"format":"fx-graph","version":1,"kind":"inference","name":"{}","params":[],"nodes":[{}]}}"#,
        case.name,
        nodes.join(",")
    )
}

/// The program of the cases `ks` (one graph each, in order) and their inputs.
fn program(cases: &[Case], ks: &[usize]) -> (zerosched_ir::Program, Inputs) {
    let mut given = Inputs::new(0);
    let graphs: Vec<String> = ks
        .iter()
        .map(|&k| graph(&cases[k], k, &mut given))
        .collect();
    let doc = format!(
        r#"{{"format":"fx-program","version":1,"graphs":[{}]}}"#,
        graphs.join(",")
    );
    (
        zerosched_ir::import(doc.as_bytes()).expect("valid cases"),
        given,
    )
}

fn run_cuda(
    g: &Gpu,
    p: &zerosched_ir::Program,
    inputs: &Inputs,
) -> std::result::Result<ProgramRun, String> {
    let launch = Launch {
        rank: 0,
        world: 1,
        local_rank: 0,
        master: None,
    };
    let comm = NcclComm::new(Comm::from_launch(&g.dev, &launch).map_err(|e| e.to_string())?);
    let plans = zerosched_exec::plans::<Cuda>(p).map_err(|e| e.to_string())?;
    let dev = g.dev.clone();
    run_threads(&plans, inputs, vec![comm], |_| {
        Cuda::new(&dev).map_err(|e| zerosched_exec::BackendError::Device(e.to_string()))
    })
    .map_err(|e| e.to_string())
}

/// Largest error of `got` against `want` over the bound of `want`'s dtype times `slack`
/// (integers and booleans exactly).
fn versus(got: &host::Tensor, want: &host::Tensor, slack: f64) -> std::result::Result<f64, String> {
    if got.shape() != want.shape() || got.dtype != want.dtype {
        return Err(format!(
            "{:?} {} against the CPU's {:?} {}",
            got.shape(),
            got.dtype,
            want.shape(),
            want.dtype
        ));
    }
    let e = Elem::of(want.dtype).unwrap_or(Elem::F32);
    let (atol, rtol) = bound(e);
    let mut worst = 0.0f64;
    for (a, b) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
        if a.is_nan() && b.is_nan() || a == &b {
            continue;
        }
        if !e.is_float() {
            return Err(format!("{a} where the CPU has {b}"));
        }
        worst = worst.max((a - b).abs() / ((atol + rtol * b.abs()) * slack));
    }
    Ok(worst)
}

fn cases() -> Vec<Case> {
    use Dtype::{Bool, Float32 as F, Int64 as L};
    let f = |s: &[usize]| t("float32", s);
    let l = |s: &[usize]| t("int64", s);
    let b = |s: &[usize]| t("bool", s);
    let x = |i: usize| format!(r#"{{"node":"x{i}"}}"#);
    // The first `n` inputs, as leading arguments.
    let xs = |n: usize| (0..n).map(x).collect::<Vec<_>>().join(", ");
    let u = Fill::U(-1.0, 1.0);
    let mut cs = vec![];
    let mut case = |name,
                    target,
                    ins: Vec<(Dtype, Vec<usize>, Fill)>,
                    args: String,
                    kwargs,
                    out: String,
                    slack| {
        cs.push(Case {
            name,
            target,
            ins,
            args,
            kwargs,
            out,
            slack,
        });
    };
    // A number first (`1 - 2x`, as an exported `rsub` reaches the executor).
    case(
        "sub number first",
        "aten.sub.Tensor",
        vec![(F, vec![4, 33], u)],
        format!("[1, {}]", x(0)),
        r#"{"alpha":2}"#,
        f(&[4, 33]),
        1.0,
    );
    // Activations and their backward forms.
    for (name, target) in [
        ("gelu", "aten.gelu.default"),
        ("relu", "aten.relu.default"),
        ("silu", "aten.silu.default"),
        ("erf", "aten.erf.default"),
        ("abs", "aten.abs.default"),
    ] {
        case(
            name,
            target,
            vec![(F, vec![4, 33], Fill::U(-3.0, 3.0))],
            format!("[{}]", x(0)),
            "{}",
            f(&[4, 33]),
            1.0,
        );
    }
    case(
        "gelu tanh",
        "aten.gelu.default",
        vec![(F, vec![4, 33], Fill::U(-3.0, 3.0))],
        format!("[{}]", x(0)),
        r#"{"approximate":"tanh"}"#,
        f(&[4, 33]),
        1.0,
    );
    for (name, target) in [
        ("gelu_backward", "aten.gelu_backward.default"),
        ("silu_backward", "aten.silu_backward.default"),
        ("minimum", "aten.minimum.default"),
        ("maximum", "aten.maximum.default"),
    ] {
        case(
            name,
            target,
            vec![(F, vec![4, 33], u), (F, vec![4, 33], Fill::U(-3.0, 3.0))],
            format!("[{}, {}]", x(0), x(1)),
            "{}",
            f(&[4, 33]),
            1.0,
        );
    }
    case(
        "threshold_backward",
        "aten.threshold_backward.default",
        vec![(F, vec![4, 33], u), (F, vec![4, 33], u)],
        format!("[{}, {}, 0]", x(0), x(1)),
        "{}",
        f(&[4, 33]),
        1.0,
    );
    case(
        "abs int64",
        "aten.abs.default",
        vec![(L, vec![16, 16], Fill::I(-20, 20))],
        format!("[{}]", x(0)),
        "{}",
        l(&[16, 16]),
        1.0,
    );
    case(
        "minimum int64",
        "aten.minimum.default",
        vec![
            (L, vec![16, 16], Fill::I(-20, 20)),
            (L, vec![16, 16], Fill::I(-20, 20)),
        ],
        format!("[{}, {}]", x(0), x(1)),
        "{}",
        l(&[16, 16]),
        1.0,
    );
    case(
        "div floor int64",
        "aten.div.Tensor_mode",
        vec![(L, vec![64], Fill::I(-50, 50))],
        format!("[{}, 3]", x(0)),
        r#"{"rounding_mode":"floor"}"#,
        l(&[64]),
        1.0,
    );
    case(
        "logical_not",
        "aten.logical_not.default",
        vec![(Bool, vec![2, 16], Fill::B)],
        format!("[{}]", x(0)),
        "{}",
        b(&[2, 16]),
        1.0,
    );
    case(
        "any dim",
        "aten.any.dim",
        vec![(Bool, vec![2, 2, 16, 16], Fill::B)],
        format!("[{}, -1, true]", x(0)),
        "{}",
        b(&[2, 2, 16, 1]),
        1.0,
    );
    case(
        "masked_fill",
        "aten.masked_fill.Scalar",
        vec![(F, vec![4, 33], u), (Bool, vec![33], Fill::B)],
        format!("[{}, {}, -5.0]", x(0), x(1)),
        "{}",
        f(&[4, 33]),
        1.0,
    );
    // Creation.
    case(
        "full",
        "aten.full.default",
        vec![],
        "[[4, 6], 2.5]".into(),
        r#"{"dtype":{"dtype":"float32"}}"#,
        f(&[4, 6]),
        1.0,
    );
    case(
        "zeros",
        "aten.zeros.default",
        vec![],
        "[[3, 5]]".into(),
        r#"{"dtype":{"dtype":"float32"}}"#,
        f(&[3, 5]),
        1.0,
    );
    case(
        "ones_like",
        "aten.ones_like.default",
        vec![(L, vec![7], Fill::I(0, 9))],
        format!("[{}]", x(0)),
        "{}",
        l(&[7]),
        1.0,
    );
    case(
        "full_like",
        "aten.full_like.default",
        vec![(F, vec![3, 4], u)],
        format!("[{}, -1.5]", x(0)),
        "{}",
        f(&[3, 4]),
        1.0,
    );
    case(
        "new_zeros",
        "aten.new_zeros.default",
        vec![(L, vec![2], Fill::I(0, 9))],
        format!("[{}, [2, 16]]", x(0)),
        "{}",
        l(&[2, 16]),
        1.0,
    );
    case(
        "new_ones",
        "aten.new_ones.default",
        vec![(F, vec![2], u)],
        format!("[{}, []]", x(0)),
        r#"{"dtype":{"dtype":"bool"}}"#,
        b(&[]),
        1.0,
    );
    case(
        "scalar_tensor -inf",
        "aten.scalar_tensor.default",
        vec![],
        r#"[{"float":"-inf"}]"#.into(),
        r#"{"dtype":{"dtype":"float32"}}"#,
        f(&[]),
        1.0,
    );
    case(
        "arange",
        "aten.arange.default",
        vec![],
        "[16]".into(),
        "{}",
        l(&[16]),
        1.0,
    );
    case(
        "arange start_step float",
        "aten.arange.start_step",
        vec![],
        "[-1.0, 2.0, 0.25]".into(),
        r#"{"dtype":{"dtype":"float32"}}"#,
        f(&[12]),
        1.0,
    );
    case(
        "empty_permuted",
        "aten.empty_permuted.default",
        vec![],
        "[[64], [0]]".into(),
        r#"{"dtype":{"dtype":"int64"}}"#,
        l(&[64]),
        1.0,
    );
    // Region writes.
    case(
        "slice_scatter",
        "aten.slice_scatter.default",
        vec![(F, vec![2, 2, 16, 16], u), (F, vec![2, 2, 16, 8], u)],
        format!("[{}, {}, 3, 8, 9223372036854775807]", x(0), x(1)),
        "{}",
        f(&[2, 2, 16, 16]),
        1.0,
    );
    case(
        "select_scatter",
        "aten.select_scatter.default",
        vec![(L, vec![2, 16], Fill::I(0, 9)), (L, vec![2], Fill::I(0, 9))],
        format!("[{}, {}, 1, 0]", x(0), x(1)),
        "{}",
        l(&[2, 16]),
        1.0,
    );
    case(
        "slice_backward",
        "aten.slice_backward.default",
        vec![(F, vec![2, 4, 16, 1], u)],
        format!("[{}, [2, 4, 16, 2], 3, 1, 9223372036854775807, 1]", x(0)),
        "{}",
        f(&[2, 4, 16, 2]),
        1.0,
    );
    case(
        "select_backward",
        "aten.select_backward.default",
        vec![(F, vec![2, 32], u)],
        format!("[{}, [2, 5, 32], 1, 0]", x(0)),
        "{}",
        f(&[2, 5, 32]),
        1.0,
    );
    case(
        "constant_pad_nd",
        "aten.constant_pad_nd.default",
        vec![(L, vec![2, 16], Fill::I(0, 99))],
        format!("[{}, [0, 1], -100.0]", x(0)),
        "{}",
        l(&[2, 17]),
        1.0,
    );
    case(
        "constant_pad_nd two dims",
        "aten.constant_pad_nd.default",
        vec![(F, vec![3, 4, 5], u)],
        format!("[{}, [1, 2, 0, 1], 0.5]", x(0)),
        "{}",
        f(&[3, 5, 8]),
        1.0,
    );
    case(
        "copy broadcast",
        "aten.copy.default",
        vec![(F, vec![2, 15], u), (F, vec![15], u)],
        format!("[{}, {}]", x(0), x(1)),
        "{}",
        f(&[2, 15]),
        1.0,
    );
    case(
        "fill tensor",
        "aten.fill.Tensor",
        vec![(L, vec![2], Fill::I(0, 9)), (L, vec![], Fill::I(0, 9))],
        format!("[{}, {}]", x(0), x(1)),
        "{}",
        l(&[2]),
        1.0,
    );
    // Views that are not the exporter's aliases, and splits.
    case(
        "select",
        "aten.select.int",
        vec![(F, vec![2, 5, 32], u)],
        format!("[{}, 1, 0]", x(0)),
        "{}",
        f(&[2, 32]),
        1.0,
    );
    case(
        "split_with_sizes",
        "aten.split_with_sizes.default",
        vec![(F, vec![64, 256], u)],
        format!("[{}, [128, 128], -1]", x(0)),
        "{}",
        tuple(&[Some(f(&[64, 128])), Some(f(&[64, 128]))]),
        1.0,
    );
    case(
        "split",
        "aten.split.Tensor",
        vec![(F, vec![2, 4, 16, 24], u)],
        format!("[{}, 8, -1]", x(0)),
        "{}",
        tuple(&[
            Some(f(&[2, 4, 16, 8])),
            Some(f(&[2, 4, 16, 8])),
            Some(f(&[2, 4, 16, 8])),
        ]),
        1.0,
    );
    // Indexing.
    case(
        "index two tensors",
        "aten.index.Tensor",
        vec![
            (L, vec![2, 16], Fill::I(0, 99)),
            (L, vec![2, 1, 1], Fill::I(0, 2)),
            (L, vec![16, 1], Fill::I(-16, 16)),
        ],
        format!("[{}, [{}, {}]]", x(0), x(1), x(2)),
        "{}",
        l(&[2, 16, 1]),
        1.0,
    );
    case(
        "index rows",
        "aten.index.Tensor",
        vec![(F, vec![7, 3, 5], u), (L, vec![4], Fill::I(-7, 7))],
        format!("[{}, [{}]]", x(0), x(1)),
        "{}",
        f(&[4, 3, 5]),
        1.0,
    );
    case(
        "index_put accumulate",
        "aten.index_put.default",
        vec![
            (F, vec![8, 6], u),
            (L, vec![10], Fill::I(0, 8)),
            (F, vec![10, 6], u),
        ],
        format!("[{}, [{}], {}, true]", x(0), x(1), x(2)),
        "{}",
        f(&[8, 6]),
        4.0,
    );
    case(
        "index_put",
        "aten.index_put.default",
        vec![
            (F, vec![8, 6], u),
            (L, vec![3], Fill::V(&[1.0, 5.0, 2.0])),
            (F, vec![6], u),
        ],
        format!("[{}, [{}], {}]", x(0), x(1), x(2)),
        "{}",
        f(&[8, 6]),
        1.0,
    );
    case(
        "scatter src",
        "aten.scatter.src",
        vec![
            (F, vec![32, 4], u),
            (
                L,
                vec![32, 2],
                Fill::V(&[
                    0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0, 2.0, 0.0, 3.0, 2.0, 1.0, 1.0, 0.0, 3.0, 2.0,
                    0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0, 2.0, 0.0, 3.0, 2.0, 1.0, 1.0, 0.0, 3.0, 2.0,
                    0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0, 2.0, 0.0, 3.0, 2.0, 1.0, 1.0, 0.0, 3.0, 2.0,
                    0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0, 2.0, 0.0, 3.0, 2.0, 1.0, 1.0, 0.0, 3.0, 2.0,
                ]),
            ),
            (F, vec![32, 2], u),
        ],
        format!("[{}, -1, {}, {}]", x(0), x(1), x(2)),
        "{}",
        f(&[32, 4]),
        1.0,
    );
    case(
        "scatter value",
        "aten.scatter.value",
        vec![(F, vec![32, 16], u), (L, vec![32, 1], Fill::I(0, 16))],
        format!("[{}, 1, {}, -1.0]", x(0), x(1)),
        "{}",
        f(&[32, 16]),
        1.0,
    );
    case(
        "embedding_dense_backward",
        "aten.embedding_dense_backward.default",
        vec![(F, vec![2, 16, 32], u), (L, vec![2, 16], Fill::I(0, 20))],
        format!("[{}, {}, 20, 3, false]", x(0), x(1)),
        "{}",
        f(&[20, 32]),
        4.0,
    );
    // Norms, losses, softmax backward.
    case(
        "native_layer_norm",
        "aten.native_layer_norm.default",
        vec![(F, vec![2, 16, 32], u), (F, vec![32], u), (F, vec![32], u)],
        format!("[{}, [32], {}, {}, 1e-5]", x(0), x(1), x(2)),
        "{}",
        tuple(&[
            Some(f(&[2, 16, 32])),
            Some(f(&[2, 16, 1])),
            Some(f(&[2, 16, 1])),
        ]),
        4.0,
    );
    case(
        "native_layer_norm_backward",
        "aten.native_layer_norm_backward.default",
        vec![
            (F, vec![2, 16, 32], u),
            (F, vec![2, 16, 32], u),
            (F, vec![2, 16, 1], Fill::U(-0.1, 0.1)),
            (F, vec![2, 16, 1], Fill::U(1.0, 2.0)),
            (F, vec![32], u),
            (F, vec![32], u),
        ],
        format!(
            "[{}, {}, [32], {}, {}, {}, {}, [true, true, true]]",
            x(0),
            x(1),
            x(2),
            x(3),
            x(4),
            x(5)
        ),
        "{}",
        tuple(&[Some(f(&[2, 16, 32])), Some(f(&[32])), Some(f(&[32]))]),
        20.0,
    );
    case(
        "_softmax_backward_data",
        "aten._softmax_backward_data.default",
        vec![
            (F, vec![2, 2, 16, 16], u),
            (F, vec![2, 2, 16, 16], Fill::U(0.0, 0.2)),
        ],
        format!(r#"[{}, {}, -1, {{"dtype":"float32"}}]"#, x(0), x(1)),
        "{}",
        f(&[2, 2, 16, 16]),
        4.0,
    );
    case(
        "_log_softmax_backward_data",
        "aten._log_softmax_backward_data.default",
        vec![
            (F, vec![32, 128], u),
            (F, vec![32, 128], Fill::U(-6.0, -3.0)),
        ],
        format!(r#"[{}, {}, 1, {{"dtype":"float32"}}]"#, x(0), x(1)),
        "{}",
        f(&[32, 128]),
        4.0,
    );
    case(
        "_safe_softmax",
        "aten._safe_softmax.default",
        vec![(F, vec![2, 2, 16, 16], Fill::U(-4.0, 4.0))],
        format!("[{}, -1]", x(0)),
        "{}",
        f(&[2, 2, 16, 16]),
        1.0,
    );
    case(
        "nll_loss_forward",
        "aten.nll_loss_forward.default",
        vec![
            (F, vec![32, 128], Fill::U(-6.0, 0.0)),
            (L, vec![32], Fill::I(0, 128)),
        ],
        format!("[{}, {}, null, 1, -100]", x(0), x(1)),
        "{}",
        tuple(&[Some(f(&[])), Some(f(&[]))]),
        4.0,
    );
    case(
        "nll_loss_backward",
        "aten.nll_loss_backward.default",
        vec![
            (F, vec![], u),
            (F, vec![32, 128], u),
            (L, vec![32], Fill::I(0, 128)),
            (F, vec![], Fill::U(16.0, 32.0)),
        ],
        format!("[{}, {}, {}, null, 1, -100, {}]", x(0), x(1), x(2), x(3)),
        "{}",
        f(&[32, 128]),
        1.0,
    );
    // Attention (GQA, a boolean mask), its backward, products, convolution.
    let sdpa_out = tuple(&[Some(f(&[2, 4, 16, 8])), Some(f(&[2, 4, 16]))]);
    case(
        "sdpa",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        vec![
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (Bool, vec![2, 1, 16, 16], Fill::B),
        ],
        format!("[{}, {}, {}]", x(0), x(1), x(2)),
        r#"{"attn_mask":{"node":"x3"},"scale":0.25}"#,
        sdpa_out.clone(),
        20.0,
    );
    case(
        "sdpa causal",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        vec![
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
        ],
        format!("[{}, {}, {}, 0.0, true]", x(0), x(1), x(2)),
        "{}",
        sdpa_out,
        20.0,
    );
    case(
        "sdpa backward",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        vec![
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16], Fill::U(2.0, 3.0)),
            (Bool, vec![2, 1, 16, 16], Fill::B),
        ],
        format!("[{}, 0.0, false]", xs(6)),
        r#"{"attn_mask":{"node":"x6"},"scale":0.25}"#,
        tuple(&[
            Some(f(&[2, 4, 16, 8])),
            Some(f(&[2, 2, 16, 8])),
            Some(f(&[2, 2, 16, 8])),
        ]),
        40.0,
    );
    // The GPU form (what an export on a GPU records): bookkeeping outputs past
    // (out, logsumexp), here an RNG offset and an empty debug mask, and the backward's
    // dropout and causality four places later.
    case(
        "sdpa gpu form causal",
        "aten._scaled_dot_product_flash_attention.default",
        vec![
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
        ],
        format!("[{}, {}, {}, 0.0, true]", x(0), x(1), x(2)),
        r#"{"scale":0.25}"#,
        tuple(&[
            Some(f(&[2, 4, 16, 8])),
            Some(f(&[2, 4, 16])),
            None,
            None,
            None,
            None,
            None,
            Some(t("uint64", &[])),
            Some(f(&[0])),
        ]),
        20.0,
    );
    case(
        "sdpa gpu form backward causal",
        "aten._scaled_dot_product_flash_attention_backward.default",
        vec![
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 2, 16, 8], u),
            (F, vec![2, 4, 16, 8], u),
            (F, vec![2, 4, 16], Fill::U(2.0, 3.0)),
        ],
        format!("[{}, null, null, 16, 16, 0.0, true, null, null]", xs(6)),
        r#"{"scale":0.25}"#,
        tuple(&[
            Some(f(&[2, 4, 16, 8])),
            Some(f(&[2, 2, 16, 8])),
            Some(f(&[2, 2, 16, 8])),
        ]),
        40.0,
    );
    case(
        "addmm",
        "aten.addmm.default",
        vec![(F, vec![64], u), (F, vec![32, 48], u), (F, vec![48, 64], u)],
        format!("[{}, {}, {}]", x(0), x(1), x(2)),
        "{}",
        f(&[32, 64]),
        70.0,
    );
    case(
        "grouped_mm 2d x 3d",
        "aten._grouped_mm.default",
        vec![
            (F, vec![64, 32], u),
            (F, vec![4, 32, 48], u),
            (Dtype::Int32, vec![4], Fill::Ends(64)),
        ],
        format!("[{}, {}, {}]", x(0), x(1), x(2)),
        "{}",
        f(&[64, 48]),
        60.0,
    );
    case(
        "grouped_mm 2d x 2d",
        "aten._grouped_mm.default",
        vec![
            (F, vec![48, 64], u),
            (F, vec![64, 32], u),
            (Dtype::Int32, vec![4], Fill::Ends(64)),
        ],
        format!("[{}, {}, {}]", x(0), x(1), x(2)),
        "{}",
        f(&[4, 48, 32]),
        80.0,
    );
    case(
        "convolution",
        "aten.convolution.default",
        vec![
            (F, vec![2, 3, 16, 16], u),
            (F, vec![32, 3, 8, 8], u),
            (F, vec![32], u),
        ],
        format!(
            "[{}, {}, {}, [8, 8], [0, 0], [1, 1], false, [0, 0], 1]",
            x(0),
            x(1),
            x(2)
        ),
        "{}",
        f(&[2, 32, 2, 2]),
        150.0,
    );
    case(
        "convolution padded",
        "aten.convolution.default",
        vec![
            (F, vec![2, 3, 9, 7], u),
            (F, vec![5, 3, 3, 3], u),
            (F, vec![5], u),
        ],
        format!(
            "[{}, {}, {}, [2, 1], [1, 1], [1, 2], false, [0, 0], 1]",
            x(0),
            x(1),
            x(2)
        ),
        "{}",
        f(&[2, 5, 5, 5]),
        60.0,
    );
    case(
        "convolution_backward",
        "aten.convolution_backward.default",
        vec![
            (F, vec![2, 5, 5, 5], u),
            (F, vec![2, 3, 9, 7], u),
            (F, vec![5, 3, 3, 3], u),
        ],
        format!(
            "[{}, {}, {}, [5], [2, 1], [1, 1], [1, 2], false, [0, 0], 1, [true, true, true]]",
            x(0),
            x(1),
            x(2)
        ),
        "{}",
        tuple(&[
            Some(f(&[2, 3, 9, 7])),
            Some(f(&[5, 3, 3, 3])),
            Some(f(&[5])),
        ]),
        60.0,
    );
    // Routing.
    case(
        "cumsum int64",
        "aten.cumsum.default",
        vec![(L, vec![2, 16], Fill::I(0, 2))],
        format!("[{}, -1]", x(0)),
        "{}",
        l(&[2, 16]),
        1.0,
    );
    case(
        "cumsum f32",
        "aten.cumsum.default",
        vec![(F, vec![3, 100, 5], u)],
        format!("[{}, 1]", x(0)),
        "{}",
        f(&[3, 100, 5]),
        10.0,
    );
    case(
        "sort int64",
        "aten.sort.default",
        vec![(L, vec![64], Fill::I(0, 4))],
        format!("[{}]", x(0)),
        "{}",
        tuple(&[Some(l(&[64])), Some(l(&[64]))]),
        1.0,
    );
    case(
        "sort descending f32",
        "aten.sort.default",
        vec![(F, vec![3, 40], u)],
        format!("[{}, 0, true]", x(0)),
        "{}",
        tuple(&[Some(f(&[3, 40])), Some(l(&[3, 40]))]),
        1.0,
    );
    case(
        "topk",
        "aten.topk.default",
        vec![(F, vec![32, 4], u)],
        format!("[{}, 2]", x(0)),
        "{}",
        tuple(&[Some(f(&[32, 2])), Some(l(&[32, 2]))]),
        1.0,
    );
    case(
        "histc",
        "aten.histc.default",
        vec![(F, vec![64], Fill::I(0, 4))],
        format!("[{}, 4, 0, 3]", x(0)),
        "{}",
        f(&[4]),
        1.0,
    );
    cs
}

/// Every case on the CPU backend alone (`gpu_selftest --cases-on-cpu`: the cases themselves
/// checked where there is no GPU); returns the number that failed.
pub fn cases_on_cpu() -> usize {
    let cs = cases();
    let mut failed = 0;
    for (k, case) in cs.iter().enumerate() {
        let (p, inputs) = program(&cs, &[k]);
        match run_program(&p, &inputs, 1, |_| Ok(Cpu)) {
            Ok(_) => println!("ok     {}", case.name),
            Err(e) => {
                failed += 1;
                println!("FAIL   {}: {e}", case.name);
            }
        }
    }
    // The bundle of every case, as the GPU runs it.
    let all: Vec<usize> = (0..cs.len()).collect();
    let (p, inputs) = program(&cs, &all);
    match run_program(&p, &inputs, 1, |_| Ok(Cpu)) {
        Ok(run) if run.graphs.len() == cs.len() => {
            println!("ok     all {} cases in one program", cs.len())
        }
        Ok(run) => {
            failed += 1;
            println!(
                "FAIL   the bundle ran {} graphs of {}",
                run.graphs.len(),
                cs.len()
            );
        }
        Err(e) => {
            failed += 1;
            println!("FAIL   the bundle: {e}");
        }
    }
    failed
}

/// The GPU's outputs of every case: one run of all of them (one device setup and NCCL
/// communicator), or, when that fails, one run per case, so each failure names its case.
fn gpu_outputs(
    g: &Gpu,
    cs: &[Case],
) -> Vec<std::result::Result<Vec<Option<host::Tensor>>, String>> {
    let all: Vec<usize> = (0..cs.len()).collect();
    let (p, inputs) = program(cs, &all);
    if let Ok(run) = run_cuda(g, &p, &inputs) {
        return run
            .graphs
            .into_iter()
            .map(|gr| Ok(gr.outputs.into_iter().next().unwrap_or_default()))
            .collect();
    }
    all.iter()
        .map(|&k| {
            let (p, inputs) = program(cs, &[k]);
            run_cuda(g, &p, &inputs).map(|mut run| {
                run.graphs
                    .pop()
                    .and_then(|gr| gr.outputs.into_iter().next())
                    .unwrap_or_default()
            })
        })
        .collect()
}

/// Every case on the GPU against the CPU backend.
pub fn ops(g: &mut Gpu, rows: &mut Vec<Row>) -> Result<()> {
    let cs = cases();
    let gpu = gpu_outputs(g, &cs);
    for (k, (case, uo)) in cs.iter().zip(gpu).enumerate() {
        let (p, inputs) = program(&cs, &[k]);
        let cpu = run_program(&p, &inputs, 1, |_| Ok(Cpu)).map_err(|e| e.to_string());
        let (ok, detail) = match (cpu, uo) {
            (Err(e), _) => (false, format!("cpu: {e}")),
            (_, Err(e)) => (false, format!("cuda: {e}")),
            (Ok(c), Ok(uo)) => {
                let co = c.graphs[0].outputs.first().cloned().unwrap_or_default();
                let mut worst = 0.0f64;
                let mut err = None;
                for (a, b) in uo.iter().zip(&co) {
                    match (a, b) {
                        (Some(a), Some(b)) => match versus(a, b, case.slack) {
                            Ok(w) => worst = worst.max(w),
                            Err(e) => err = Some(e),
                        },
                        (None, None) => {}
                        _ => err = Some("an output missing on one side".into()),
                    }
                }
                match err {
                    Some(e) => (false, e),
                    None if uo.len() != co.len() => {
                        (false, format!("{} outputs, the CPU {}", uo.len(), co.len()))
                    }
                    None => (
                        worst <= 1.0,
                        format!("{worst:.3} of bound × {}", case.slack),
                    ),
                }
            }
        };
        rows.push(Row {
            check: format!("op {} vs cpu", case.name),
            detail,
            ok,
        });
    }
    nan_max(g, rows)
}

/// max/min reductions and maximum/minimum propagate NaN, as torch's.
fn nan_max(g: &mut Gpu, rows: &mut Vec<Row>) -> Result<()> {
    let v = [1.0, f64::NAN, 3.0, -2.0];
    let (x, _) = g.upload(Elem::F32, &v)?;
    let out = g.alloc(Elem::F32, 2)?;
    g.k.reduce(Reduce::Max, x.ptr, Elem::F32, out.ptr, Elem::F32, 1, 4, 1)?;
    g.k.reduce(
        Reduce::Min,
        x.ptr,
        Elem::F32,
        out.ptr + 4,
        Elem::F32,
        1,
        4,
        1,
    )?;
    let got = g.download(out, Elem::F32, 2)?;
    rows.push(Row {
        check: "reduce max/min propagate NaN".into(),
        detail: format!("{got:?}"),
        ok: got.iter().all(|v| v.is_nan()),
    });
    g.free(&[x, out])
}
