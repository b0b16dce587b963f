//! The Torch-GPU-contract backend: K/V as one tensor set per attention group (all full-attention layers,
//! each sliding window's layers), as a paged GPU engine keeps it. f32 on the wire unless the host asks for
//! another dtype with the `dtype` key. The prefill is real: the `model` crate's forward pass on the CPU
//! stands in for the GPU.

use pdhost_backend_kit::ModelBackend;
use pdhost_plugin_abi::{Backend, BackendError, Capabilities, Description, PdhostLayout, Prefill, Writer};
use shm_format::Dtype;

/// The backend instance.
#[derive(Debug)]
pub struct Gpu(ModelBackend);

impl Backend for Gpu {
    fn open(config: &str) -> Result<Self, BackendError> {
        ModelBackend::open(config, PdhostLayout::Grouped, Dtype::F32).map(Gpu)
    }

    fn describe(&self) -> Description {
        self.0.describe()
    }

    fn release(&mut self, request_id: u64) {
        self.0.release(request_id)
    }

    fn stage(&mut self, requests: &[Prefill<'_>]) -> Result<(), BackendError> {
        self.0.stage(requests)
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    fn prefill(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        self.0.compute(request)?;
        self.0.write_regions(&self.0.manifest(request), writer, None)
    }
}

pdhost_plugin_abi::export_backend!(Gpu, c"gpu");
