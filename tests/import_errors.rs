//! Every malformed document under tests/import_errors is rejected by `zerosched check` with
//! exit code 1 and exactly the message in its snapshot `NAME.snap` beside it (insta; `cargo
//! insta review` accepts an intended change).

mod common;

#[test]
fn each_malformed_document_is_rejected_with_its_message() {
    let cases = common::files("tests/import_errors", &[".json"]);
    assert!(
        cases.len() >= 30,
        "the malformed-document cases are present"
    );
    let mut failures = Vec::new();
    for case in &cases {
        let rel = common::relative(case);
        let out = common::zerosched(&["check", &rel]);
        if out.status.code() != Some(1) {
            failures.push(format!(
                "{rel}: exit code {:?}, expected 1",
                out.status.code()
            ));
            continue;
        }
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let name = case.file_stem().map(|s| s.to_string_lossy().into_owned());
        insta::with_settings!({
            snapshot_path => "import_errors",
            prepend_module_to_snapshot => false,
            input_file => case,
            omit_expression => true,
        }, {
            insta::assert_snapshot!(name.unwrap_or_default(), stderr);
        });
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
