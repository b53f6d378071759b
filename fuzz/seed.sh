#!/bin/sh
# Fills fuzz/corpus/<target>/ with seeds: every JSON document under tests/fixtures and
# tests/import_errors for import_json, and the same fixtures converted to the binary form
# (zerosched_ir::binary::export, through `zerosched convert`) for import_binary.
# Run from anywhere; corpora are gitignored.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --quiet --bin zerosched
mkdir -p fuzz/corpus/import_json fuzz/corpus/import_binary
for f in $(find tests/fixtures tests/import_errors -name '*.json' | sort); do
    seed=$(echo "$f" | tr '/' '_')
    cp "$f" "fuzz/corpus/import_json/$seed"
    # Malformed documents do not convert; the valid ones become binary seeds.
    target/debug/zerosched convert "$f" -o "fuzz/corpus/import_binary/${seed%.json}.zsg" --to binary 2>/dev/null || true
done
echo "import_json seeds: $(ls fuzz/corpus/import_json | wc -l), import_binary seeds: $(ls fuzz/corpus/import_binary | wc -l)"
# Generated ZeRO-3-like programs (zerosched_ir::testing), small, in both encodings.
cargo run --quiet -p zerosched-ir --example fuzz_seeds -- fuzz/corpus
echo "with generated seeds: import_json $(ls fuzz/corpus/import_json | wc -l), import_binary $(ls fuzz/corpus/import_binary | wc -l)"
