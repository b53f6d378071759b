//! Writes 64 generated ZeRO-3-like programs (`zerosched_ir::testing`, small), in both
//! encodings, into the fuzz corpora: `<dir>/import_json/generated_NN.json` and
//! `<dir>/import_binary/generated_NN.zsg`. The same seeds every run (proptest's deterministic
//! runner). Run by `fuzz/seed.sh`:
//!
//! `cargo run -p zerosched-ir --example fuzz_seeds -- fuzz/corpus`

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;
use std::path::PathBuf;
use zerosched_ir::testing::{self, Config};
use zerosched_ir::{binary, json};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .ok_or("usage: fuzz_seeds CORPUS_DIR")?,
    );
    let (jdir, bdir) = (root.join("import_json"), root.join("import_binary"));
    std::fs::create_dir_all(&jdir)?;
    std::fs::create_dir_all(&bdir)?;
    let mut runner = TestRunner::deterministic();
    let strategy = testing::program(&Config::small());
    for i in 0..64 {
        let p = strategy
            .new_tree(&mut runner)
            .map_err(|r| r.to_string())?
            .current();
        std::fs::write(
            jdir.join(format!("generated_{i:02}.json")),
            json::export(&p),
        )?;
        std::fs::write(
            bdir.join(format!("generated_{i:02}.zsg")),
            binary::export(&p),
        )?;
    }
    Ok(())
}
