//! Arbitrary bytes through the JSON importer: it must return `Ok` or `Err`, never panic,
//! overflow the stack or allocate without bound. Whatever it accepts must survive the
//! round trips the rest of the project relies on: JSON export is a fixed point, and the
//! binary form carries exactly the same program.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerosched_ir::{binary, json};

fuzz_target!(|data: &[u8]| {
    let Ok(program) = json::import(data) else {
        return;
    };
    let first = json::export(&program);
    let again = json::import(&first).expect("an exported document imports");
    assert_eq!(first, json::export(&again), "JSON export is not a fixed point");
    let bin = binary::export(&program);
    let back = binary::import(&bin).expect("a binary export imports");
    assert_eq!(first, json::export(&back), "the binary form changed the program");
});
