//! Arbitrary bytes through the binary importer (and the magic-sniffing `zerosched_ir::import`):
//! `Ok` or `Err`, never a panic, a stack overflow or an unbounded allocation. An accepted
//! document must re-export to the same bytes and survive a trip through JSON.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerosched_ir::{binary, json};

fuzz_target!(|data: &[u8]| {
    // The fast path must give exactly what the careful path gives.
    let careful = binary::import_careful(data).map(|p| binary::export(&p)).map_err(|e| e.to_string());
    let fast = binary::import(data);
    assert_eq!(
        fast.as_ref().map(binary::export).map_err(|e| e.to_string()),
        careful,
        "fast and careful paths differ"
    );
    let Ok(program) = fast else {
        let _ = zerosched_ir::import(data);
        return;
    };
    let bin = binary::export(&program);
    let again = binary::import(&bin).expect("a binary export imports");
    assert_eq!(bin, binary::export(&again), "binary export is not a fixed point");
    let text = json::export(&program);
    let back = json::import(&text).expect("the JSON export of an accepted document imports");
    assert_eq!(text, json::export(&back), "JSON export of a binary document is not a fixed point");
});
