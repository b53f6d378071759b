//! Arbitrary bytes through the JSON importer: it must return `Ok` or `Err`, never panic,
//! overflow the stack or allocate without bound. Whatever it accepts must survive the
//! round trips the rest of the project relies on: JSON export is a fixed point, and the
//! binary form carries exactly the same program. The fast path agrees with the careful one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerosched_ir::{binary, json};

fuzz_target!(|data: &[u8]| {
    // The fast path must give exactly what the careful path gives.
    let careful = json::import_careful(data).map(|p| json::export(&p)).map_err(|e| e.to_string());
    let fast = json::import(data);
    assert_eq!(
        fast.as_ref().map(json::export).map_err(|e| e.to_string()),
        careful,
        "fast and careful paths differ"
    );
    let Ok(program) = fast else {
        return;
    };
    let first = json::export(&program);
    let again = json::import(&first).expect("an exported document imports");
    assert_eq!(first, json::export(&again), "JSON export is not a fixed point");
    let bin = binary::export(&program);
    let back = binary::import(&bin).expect("a binary export imports");
    assert_eq!(first, json::export(&back), "the binary form changed the program");
});
