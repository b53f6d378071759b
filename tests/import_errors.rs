//! Every malformed document under tests/import_errors is rejected by `zerosched check` with
//! exit code 1 and exactly the message in its `.expected` file (`ZEROSCHED_BLESS=1 cargo test`
//! rewrites those files).

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
        if let Some(m) = common::check_expected(&case.with_extension("expected"), &stderr) {
            failures.push(m);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
