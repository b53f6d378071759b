//! The one table of elementwise op expressions every elementwise kernel is generated from.
//!
//! An expression is C over the loaded operands `a`, `b`, `c` (in the kernel's compute type,
//! `C`: `float` for floating-point tensors, `long long` for integer and boolean ones), the
//! op's scalars `s`, `t` (`double` kernel parameters) and the output element's row-major
//! index `i` (the creation ops, which have no operand). The names are aten's where one aten op
//! is one expression; the `.Scalar` forms of aten's binary ops are the unary `*_scalar` rows.

/// One elementwise op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpExpr {
    pub name: &'static str,
    /// Tensor operands (0 to 3).
    pub arity: usize,
    pub expr: &'static str,
    /// Meaningful only in floating point (math functions): refused for integer compute.
    pub float_only: bool,
}

const fn op(name: &'static str, arity: usize, expr: &'static str, float_only: bool) -> OpExpr {
    OpExpr {
        name,
        arity,
        expr,
        float_only,
    }
}

pub const OPS: &[OpExpr] = &[
    // Creation (no operand).
    op("fill", 0, "(C)s", false),
    op("arange", 0, "(C)(s + t * (double)i)", false),
    // Unary.
    op("copy", 1, "a", false),
    op("logical_not", 1, "(C)(a == (C)0)", false),
    op("erf", 1, "erff(a)", true),
    op("neg", 1, "-a", false),
    op("abs", 1, "(a < (C)0 ? -a : a)", false),
    op("exp", 1, "expf(a)", true),
    op("log", 1, "logf(a)", true),
    op("cos", 1, "cosf(a)", true),
    op("sin", 1, "sinf(a)", true),
    op("sqrt", 1, "sqrtf(a)", true),
    op("rsqrt", 1, "rsqrtf(a)", true),
    op("reciprocal", 1, "1.0f / a", true),
    op("sigmoid", 1, "1.0f / (1.0f + expf(-a))", true),
    op("tanh", 1, "tanhf(a)", true),
    op("relu", 1, "((a > (C)0 || a != a) ? a : (C)0)", false),
    op("silu", 1, "a / (1.0f + expf(-a))", true),
    op(
        "gelu",
        1,
        "0.5f * a * (1.0f + erff(a * 0.70710678118654752f))",
        true,
    ),
    op(
        "gelu_tanh",
        1,
        "0.5f * a * (1.0f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)))",
        true,
    ),
    op("pow_scalar", 1, "powf(a, (float)s)", true),
    op("add_scalar", 1, "a + (C)s", false),
    op("mul_scalar", 1, "a * (C)s", false),
    op("div_scalar", 1, "a / (C)s", false),
    op("eq_scalar", 1, "(C)(a == (C)s)", false),
    op("lt_scalar", 1, "(C)(a < (C)s)", false),
    op("gt_scalar", 1, "(C)(a > (C)s)", false),
    // Binary (`add`/`sub` carry aten's `alpha` as `s`).
    op("add", 2, "a + (C)s * b", false),
    op("sub", 2, "a - (C)s * b", false),
    op("mul", 2, "a * b", false),
    op("div", 2, "a / b", false),
    op("div_floor", 2, "zs_floordiv(a, b)", false),
    op("div_trunc", 2, "zs_truncdiv(a, b)", false),
    // NaN-propagating, as torch's.
    op("maximum", 2, "zs_max(a, b)", false),
    op("minimum", 2, "zs_min(a, b)", false),
    op("eq", 2, "(C)(a == b)", false),
    op("ne", 2, "(C)(a != b)", false),
    op("lt", 2, "(C)(a < b)", false),
    op("le", 2, "(C)(a <= b)", false),
    op("gt", 2, "(C)(a > b)", false),
    op("ge", 2, "(C)(a >= b)", false),
    op("bitwise_and", 2, "(C)((long long)a & (long long)b)", false),
    op("bitwise_or", 2, "(C)((long long)a | (long long)b)", false),
    // Backward of activations: `a` is the gradient, `b` the forward input.
    op(
        "gelu_backward",
        2,
        "a * (0.5f * (1.0f + erff(b * 0.70710678118654752f)) + b * 0.39894228040143268f * expf(-0.5f * b * b))",
        true,
    ),
    op(
        "gelu_tanh_backward",
        2,
        "a * (0.5f * (1.0f + tanhf(0.79788456080286536f * (b + 0.044715f * b * b * b))) + 0.5f * b * (1.0f - tanhf(0.79788456080286536f * (b + 0.044715f * b * b * b)) * tanhf(0.79788456080286536f * (b + 0.044715f * b * b * b))) * 0.79788456080286536f * (1.0f + 0.134145f * b * b))",
        true,
    ),
    op(
        "silu_backward",
        2,
        "a * (1.0f / (1.0f + expf(-b))) * (1.0f + b * (1.0f - 1.0f / (1.0f + expf(-b))))",
        true,
    ),
    op("threshold_backward", 2, "(b <= (C)s ? (C)0 : a)", false),
    // `a` where the mask `b` is false, the scalar `s` where it is true.
    op("masked_fill", 2, "(b != (C)0 ? (C)s : a)", false),
    // `b` a score row's log-sum-exp: its softmax entry, 0 on a row of only -inf.
    op(
        "exp_sub_lse",
        2,
        "(b == -ZS_INF ? 0.0f : expf(a - b))",
        true,
    ),
    // `b` a boolean mask: the score kept, or -inf where masked out.
    op("mask_scores", 2, "(b != (C)0 ? a : -ZS_INF)", true),
    // Ternary.
    op("where", 3, "(a != (C)0 ? b : c)", false),
    op("lerp", 3, "a + c * (b - a)", true),
    op("addcmul", 3, "a + (C)s * b * c", false),
    // Softmax backward (`a` output, `b` gradient, `c` the row sum of their product) and
    // attention's dS = P * (dP - D).
    op("mul_sub", 3, "a * (b - c)", true),
    // Log-softmax backward: `a` gradient, `b` output, `c` the gradient's row sum.
    op("log_softmax_backward", 3, "a - expf(b) * c", true),
];

/// The op named `name`.
pub fn find(name: &str) -> Option<&'static OpExpr> {
    OPS.iter().find(|o| o.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_expressions_use_only_their_operands() {
        for (i, o) in OPS.iter().enumerate() {
            assert!(
                OPS[..i].iter().all(|p| p.name != o.name),
                "{} twice",
                o.name
            );
            assert!(o.arity <= 3, "{}", o.name);
            let uses = |v: char| {
                o.expr
                    .split(|ch: char| !ch.is_ascii_alphanumeric() && ch != '_')
                    .any(|w| w.len() == 1 && w.starts_with(v))
            };
            for (k, v) in ['a', 'b', 'c'].into_iter().enumerate() {
                assert_eq!(
                    uses(v),
                    k < o.arity,
                    "`{}`: operand {v} in {:?}",
                    o.name,
                    o.expr
                );
            }
        }
    }
}
