//! Arbitrary bytes as a Hugging Face checkpoint directory (`model::fuzzing::hf_checkpoint`: a length,
//! `config.json`, then `model.safetensors`): loading gives a model that runs or a typed error, never a
//! crash or an allocation past libFuzzer's limits.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // One directory per fuzzing process, in memory, removed after each input (a server's tests look for
    // anything of pdhost's left in /dev/shm).
    let dir = std::path::PathBuf::from(format!("/dev/shm/pdhost-fuzz-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory in /dev/shm");
    model::fuzzing::hf_checkpoint(&dir, data);
    let _ = std::fs::remove_dir_all(&dir);
});
