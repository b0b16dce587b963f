//! The checked-in C header must be exactly what the pinned cbindgen generates from the Rust ABI.

use std::path::Path;

#[test]
fn c_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = dir.join("include/pdhost_backend.h");
    if std::env::var_os("PDHOST_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write header");
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is stale: expected what cbindgen generates from src/lib.rs; run `PDHOST_BLESS=1 cargo test -p \
         pdhost-plugin-abi` and commit the result",
        path.display()
    );
}
