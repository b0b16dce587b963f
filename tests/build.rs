//! Builds the plain-C example backend (`plugins/example-c`) into a shared library with the compiler the
//! `cc` crate finds, strict warnings as errors, and tells the tests where it is (`EXAMPLE_C_BACKEND`).

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo")).join("..");
    let source = root.join("plugins/example-c/example.c");
    let include = root.join("plugins/abi/include");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo")).join("libpdhost_backend_example_c.so");
    println!("cargo:rerun-if-changed={}", source.display());
    println!("cargo:rerun-if-changed={}", include.join("pdhost_backend.h").display());
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let status = compiler
        .to_command()
        .args(["-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&out)
        .status()
        .expect("running the C compiler");
    assert!(status.success(), "compiling {} failed", source.display());
    println!("cargo:rustc-env=EXAMPLE_C_BACKEND={}", out.display());
}
