//! Facts about aten ops that every consumer of the format needs alike.

/// aten ops whose output is a view of their first argument (`aten.NAME.overload`).
const VIEW_OPS: &[&str] = &[
    "_reshape_alias",
    "_unsafe_view",
    "alias",
    "as_strided",
    "chunk",
    "detach",
    "diagonal",
    "expand",
    "expand_as",
    "flatten",
    "movedim",
    "narrow",
    "permute",
    "reshape",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "swapaxes",
    "t",
    "tensor_split",
    "transpose",
    "unbind",
    "unflatten",
    "unfold",
    "unsqueeze",
    "view",
    "view_as",
    "view_as_complex",
    "view_as_real",
];

/// Whether a target is one of the built-in view ops, in any overload.
pub fn is_view(target: &str) -> bool {
    target
        .strip_prefix("aten.")
        .and_then(|rest| rest.split('.').next())
        .is_some_and(|name| VIEW_OPS.binary_search(&name).is_ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn view_table_is_sorted_and_matches_overloads() {
        assert!(super::VIEW_OPS.windows(2).all(|w| w[0] < w[1]));
        assert!(super::is_view("aten.view.default"));
        assert!(super::is_view("aten.split.Tensor"));
        assert!(super::is_view("aten.t.default"));
        assert!(!super::is_view("aten.mm.default"));
        assert!(!super::is_view("aten.tanh.default"));
        assert!(!super::is_view("prims.view_of.default"));
    }
}
