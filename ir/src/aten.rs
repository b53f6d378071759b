//! Facts about aten ops that every consumer of the format needs alike.

/// The op name of an aten target: `NAME` in `aten.NAME` or `aten.NAME.overload`.
pub fn op_name(target: &str) -> Option<&str> {
    let rest = target.strip_prefix("aten.")?;
    // Names are a few bytes long: a plain scan beats a call into `memchr`.
    let end = rest.bytes().position(|b| b == b'.').unwrap_or(rest.len());
    rest.get(..end)
}

/// Whether a target is one of the built-in view ops (`aten.NAME.overload`, in any overload).
pub fn is_view(target: &str) -> bool {
    op_name(target).is_some_and(is_view_op)
}

/// Whether an aten op name ([`op_name`]) is one of the built-in view ops: `_reshape_alias`,
/// `_unsafe_view`, `alias`, `as_strided`, `chunk`, `detach`, `diagonal`, `expand`,
/// `expand_as`, `flatten`, `movedim`, `narrow`, `permute`, `reshape`, `select`,
/// `slice`, `split`, `split_with_sizes`, `squeeze`, `swapaxes`, `t`, `tensor_split`,
/// `transpose`, `unbind`, `unflatten`, `unfold`, `unsqueeze`, `view`, `view_as`,
/// `view_as_complex`, `view_as_real`.
pub fn is_view_op(name: &str) -> bool {
    // Every pass asks this of every node: a `match` compiles to a length switch and a few
    // byte comparisons.
    matches!(
        name,
        "_reshape_alias"
            | "_unsafe_view"
            | "alias"
            | "as_strided"
            | "chunk"
            | "detach"
            | "diagonal"
            | "expand"
            | "expand_as"
            | "flatten"
            | "movedim"
            | "narrow"
            | "permute"
            | "reshape"
            | "select"
            | "slice"
            | "split"
            | "split_with_sizes"
            | "squeeze"
            | "swapaxes"
            | "t"
            | "tensor_split"
            | "transpose"
            | "unbind"
            | "unflatten"
            | "unfold"
            | "unsqueeze"
            | "view"
            | "view_as"
            | "view_as_complex"
            | "view_as_real"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn view_table_matches_overloads() {
        assert!(super::is_view("aten.view.default"));
        assert!(super::is_view("aten.split.Tensor"));
        assert!(super::is_view("aten.t.default"));
        assert!(!super::is_view("aten.mm.default"));
        assert!(!super::is_view("aten.tanh.default"));
        assert!(!super::is_view("prims.view_of.default"));
        assert!(super::is_view("aten.view_as_real"));
        assert!(!super::is_view("aten.views.default"));
        assert!(!super::is_view("aten."));
    }
}
