//! Python backends: this cdylib embeds CPython and runs a Python class as a pdhost backend, so that a
//! vendor whose SDK is Python (torch, vLLM, furiosa-llm) writes the backend contract in Python. The
//! producer loads this library like any other; confinement, deadlines and crash handling are the
//! producer's and hold unchanged: a Python exception is the backend's error text, a hang is a timeout, a
//! crash of the interpreter is a producer crash.
//!
//! Configuration: `python_module` and `python_class` name the class (`--producer py:MODULE:CLASS` sets
//! both), `python_path` (a list of directories) goes in front of `sys.path`; everything else, the host's
//! keys included, reaches the class as a dict. The class (docs/plugin-abi.md, "Python backends"):
//!
//! ```python
//! class Backend:
//!     def open(self, config: dict) -> None: ...
//!     def describe(self) -> dict: ...          # layout, dtype, layers, and optionally identity, max_tokens
//!     def prefill(self, request: int, tokens: list[int], start: int, writer) -> None: ...
//!     def release(self, request: int) -> None: ...   # optional
//!     takes_context = True   # optional: prefill(..., context=[tokens before start]) on a prefix-cache hit
//! ```
//!
//! `writer.region(i)` hands out entry `i` as a writable `memoryview` of bytes over the ring slot itself (no
//! copy; `numpy.frombuffer` or `torch.frombuffer` view it in place); `writer.entries` is their number.

use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::path::{Path, PathBuf};

use pdhost_plugin_abi::{
    BackendError, Capabilities, Description, PdhostDtype, PdhostLayer, PdhostLayerKind, PdhostLayout, PdhostStatus,
    Prefill, Writer,
};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// An instance of the Python class, and what it described at open.
#[derive(Debug)]
pub struct PyBackend {
    instance: Py<PyAny>,
    description: Description,
    max_tokens: u64,
    /// The class says `takes_context = True` (read once, at open: what its capabilities tell the host and
    /// what its calls do cannot disagree).
    takes_context: bool,
}

// SAFETY: the producer calls a backend from one thread at a time (docs/plugin-abi.md, threading), and
// every touch of the Python object holds the GIL.
unsafe impl Send for PyBackend {}

/// Finds the libpython this library runs on, and makes its symbols global. The producer loads this
/// library, and with it libpython, with `RTLD_LOCAL`, so an extension module the interpreter loads later
/// (numpy's, torch's) would not find the C API it links against (`undefined symbol: PyObject_SelfIter`).
/// Opening libpython again by the path it was loaded from, with `RTLD_NOLOAD | RTLD_GLOBAL`, promotes the
/// loaded copy; it loads nothing new.
fn promote_libpython() -> Result<PathBuf, BackendError> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `dladdr` fills `info` for an address in a loaded object; `Py_IsInitialized` is libpython's.
    let found = unsafe { libc::dladdr(pyo3::ffi::Py_IsInitialized as *const libc::c_void, info.as_mut_ptr()) };
    // SAFETY: `dladdr` returned non-zero, so it filled `info`.
    let path = (found != 0).then(|| unsafe { info.assume_init() }.dli_fname).filter(|p| !p.is_null());
    let Some(path) = path else {
        return Err(bad_config("libpython: expected dladdr to name the loaded interpreter library, found nothing"));
    };
    // SAFETY: `path` is the NUL-terminated name dladdr returned; NOLOAD only re-flags a loaded object.
    let handle = unsafe { libc::dlopen(path, libc::RTLD_NOW | libc::RTLD_GLOBAL | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(bad_config("libpython: it could not be made global (dlopen with RTLD_NOLOAD failed)"));
    }
    // The handle is deliberately kept: the interpreter stays loaded for the process's life.
    // SAFETY: `path` is a NUL-terminated string owned by the loader, valid while the object is loaded.
    let path = unsafe { std::ffi::CStr::from_ptr(path) };
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(path.to_bytes())))
}

/// The installation prefix of `libpython` (`libpython3.11.so.1.0`): the nearest directory above it that
/// holds its standard library (`lib/python3.11/os.py`): `/usr` for a distribution's, the version's own
/// directory for pyenv's.
fn stdlib_home(libpython: &Path) -> Option<PathBuf> {
    let name = libpython.file_name()?.to_str()?;
    let version = name.strip_prefix("lib")?.split(".so").next()?;
    let real = std::fs::canonicalize(libpython).ok()?;
    real.ancestors().skip(1).find(|dir| dir.join("lib").join(version).join("os.py").is_file()).map(Path::to_path_buf)
}

/// Starts the interpreter with the standard library of the libpython it runs on. Left to itself, CPython
/// finds its home through `python3` on `PATH`; under pyenv that is another build's standard library, whose
/// extension modules need symbols this libpython lacks (`_ssl`: `undefined symbol: _PyModule_Add`). A
/// `PYTHONHOME` the user set wins. Signal handlers stay the producer's, as with pyo3's own start.
fn initialize(libpython: &Path) -> Result<(), BackendError> {
    // SAFETY: callable at any time.
    if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
        return Ok(());
    }
    let home = if std::env::var_os("PYTHONHOME").is_some() { None } else { stdlib_home(libpython) };
    let home = home.map(|h| std::ffi::CString::new(h.into_os_string().into_vec())).transpose();
    let home = home.map_err(|_| bad_config("libpython: its home has a NUL byte"))?;
    let failed = |what: &str, status: pyo3::ffi::PyStatus| {
        // SAFETY: a status's message is null or a static C string.
        let message = (!status.err_msg.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(status.err_msg) });
        bad_config(format!("{what}: {}", message.map_or("failed".into(), |m| m.to_string_lossy())))
    };
    let mut config = std::mem::MaybeUninit::<pyo3::ffi::PyConfig>::uninit();
    let config = config.as_mut_ptr();
    // SAFETY: `config` is initialised by `PyConfig_InitPythonConfig` before any other use, its strings are
    // set through the API, and it is cleared once the interpreter has copied what it needs.
    unsafe {
        pyo3::ffi::PyConfig_InitPythonConfig(config);
        (*config).install_signal_handlers = 0;
        if let Some(home) = &home {
            let status = pyo3::ffi::PyConfig_SetBytesString(config, &raw mut (*config).home, home.as_ptr());
            if pyo3::ffi::PyStatus_Exception(status) != 0 {
                pyo3::ffi::PyConfig_Clear(config);
                return Err(failed("setting the interpreter's home", status));
            }
        }
        let status = pyo3::ffi::Py_InitializeFromConfig(config);
        pyo3::ffi::PyConfig_Clear(config);
        if pyo3::ffi::PyStatus_Exception(status) != 0 {
            return Err(failed("starting the interpreter", status));
        }
        // As pyo3's own start does: the interpreter is then ready for `Python::attach` from this thread.
        pyo3::ffi::PyEval_SaveThread();
    }
    Ok(())
}

fn bad_config(message: impl Into<String>) -> BackendError {
    BackendError::new(PdhostStatus::BadConfig, message)
}

/// A Python exception as one line: its type, its message, and where it was raised.
fn exception_text(py: Python<'_>, err: &PyErr) -> String {
    let kind = err.get_type(py).name().map_or_else(|_| "exception".to_string(), |n| n.to_string());
    let mut text = format!("{kind}: {}", err.value(py));
    if let Some(tb) = err.traceback(py) {
        let mut frame = tb.into_any();
        while let Ok(next) = frame.getattr("tb_next") {
            if next.is_none() {
                break;
            }
            frame = next;
        }
        let file = frame.getattr("tb_frame").and_then(|f| f.getattr("f_code")).and_then(|c| c.getattr("co_filename"));
        let line = frame.getattr("tb_lineno");
        if let (Ok(file), Ok(line)) = (file, line) {
            text += &format!(" (at {file}:{line})");
        }
    }
    text.replace('\n', " ")
}

fn backend_error(py: Python<'_>, what: &str, err: &PyErr) -> BackendError {
    BackendError::new(PdhostStatus::BackendError, format!("{what}: {}", exception_text(py, err)))
}

/// What `describe()` returned, checked.
fn description(d: &Bound<'_, PyAny>) -> Result<(Description, u64), String> {
    let get = |key: &str| d.get_item(key).map_err(|_| format!("describe(): expected a {key:?} key, found none"));
    let text = |key: &str| -> Result<String, String> {
        get(key)?.extract::<String>().map_err(|_| format!("describe()[{key:?}]: expected a string"))
    };
    let layout = match text("layout")?.as_str() {
        "dense" => PdhostLayout::Dense,
        "grouped" => PdhostLayout::Grouped,
        other => return Err(format!("describe()[\"layout\"]: expected dense or grouped, found {other:?}")),
    };
    let dtype = match text("dtype")?.as_str() {
        "f32" => PdhostDtype::F32,
        "f16" => PdhostDtype::F16,
        "bf16" => PdhostDtype::Bf16,
        other => return Err(format!("describe()[\"dtype\"]: expected f32, f16 or bf16, found {other:?}")),
    };
    /// More layers than any model has.
    const MAX_LAYERS: usize = 1 << 16;
    let mut layers = Vec::new();
    let list = get("layers")?;
    let items = list.try_iter().map_err(|_| "describe()[\"layers\"]: expected a list of dicts".to_string())?;
    for (i, item) in items.enumerate() {
        // An endless iterable stops here, not at the memory limit.
        if i == MAX_LAYERS {
            return Err(format!("describe()[\"layers\"]: expected at most {MAX_LAYERS} layers, found more"));
        }
        let item = item.map_err(|e| e.to_string())?;
        let field = |key: &str| -> Result<u64, String> {
            match item.get_item(key) {
                Ok(v) => v.extract::<u64>().map_err(|_| format!("layer {i} {key:?}: expected a non-negative integer")),
                Err(_) => Ok(0),
            }
        };
        let kind: String = item
            .get_item("kind")
            .and_then(|k| k.extract())
            .map_err(|_| format!("layer {i}: expected a \"kind\" of full, sliding or recurrent"))?;
        let kind = match kind.as_str() {
            "full" => PdhostLayerKind::Full,
            "sliding" => PdhostLayerKind::Sliding,
            "recurrent" => PdhostLayerKind::Recurrent,
            other => return Err(format!("layer {i} kind: expected full, sliding or recurrent, found {other:?}")),
        };
        let small = |key: &str| -> Result<u32, String> {
            u32::try_from(field(key)?).map_err(|_| format!("layer {i} {key:?}: expected at most {}", u32::MAX))
        };
        layers.push(PdhostLayer {
            kind: kind as u32,
            kv_heads: small("kv_heads")?,
            head_dim: small("head_dim")?,
            window: small("window")?,
            state_elems: field("state_elems")?,
        });
    }
    let identity = match d.get_item("identity") {
        Ok(v) if !v.is_none() => {
            Some(v.extract::<String>().map_err(|_| "describe()[\"identity\"]: expected a string")?)
        }
        _ => None,
    };
    let max_tokens = match d.get_item("max_tokens") {
        Ok(v) if !v.is_none() => v.extract::<u64>().map_err(|_| "describe()[\"max_tokens\"]: expected an integer")?,
        _ => 0,
    };
    Ok((Description { layout, dtype, layers, fingerprint: 0, identity }, max_tokens))
}

/// One region's bytes, exported through the buffer protocol so that every view of it (a memoryview, a
/// cast of one, a numpy array over one) is counted: after `prefill` returns, a count above zero means
/// Python still reaches the ring slot. The region itself (a view's `.obj`) may outlive the call; it
/// exports nothing after it.
#[pyclass(unsendable)]
struct Region {
    /// The slot's bytes; null once the call has returned.
    ptr: std::cell::Cell<*mut u8>,
    len: usize,
    exports: std::cell::Cell<usize>,
}

#[pymethods]
impl Region {
    /// Exports the region, writable, as unsigned bytes.
    ///
    /// # Safety
    ///
    /// Called by the interpreter with a `Py_buffer` to fill (the buffer protocol).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let this = slf.borrow();
        let ptr = this.ptr.get();
        if ptr.is_null() {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "a region is only valid during the prefill call that handed it out",
            ));
        }
        // SAFETY: `view` is the interpreter's to fill; `ptr` and `len` are the region, valid while the
        // export count is checked (the producer fails the call when it is not zero after `prefill`, and
        // the region exports nothing after it: `ptr` is null then).
        let status = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), this.len as pyo3::ffi::Py_ssize_t, 0, flags)
        };
        if status != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        this.exports.set(this.exports.get() + 1);
        Ok(())
    }

    /// A view of the region was released.
    ///
    /// # Safety
    ///
    /// Called by the interpreter for a buffer `__getbuffer__` filled.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {
        self.exports.set(self.exports.get().saturating_sub(1));
    }
}

/// The writer a Python `prefill` gets: `region(i)` hands out entry `i` once, as a writable memoryview
/// over the ring slot. Valid only during the call: afterwards every view is released, and `region`
/// refuses.
#[pyclass(unsendable)]
struct PyWriter {
    /// The producer's writer, for the duration of one `prefill` call; null after it.
    writer: *mut Writer<'static>,
    /// The views handed out, released when the call returns, and the regions under them.
    views: Vec<(u32, Py<PyAny>, Py<Region>)>,
    #[pyo3(get)]
    entries: u32,
}

#[pymethods]
impl PyWriter {
    /// Entry `entry`'s destination as a writable memoryview of bytes.
    fn region(&mut self, py: Python<'_>, entry: u32) -> PyResult<Py<PyAny>> {
        if self.writer.is_null() {
            return Err(PyValueError::new_err("the writer is only valid during prefill"));
        }
        if entry >= self.entries {
            return Err(PyIndexError::new_err(format!("region {entry}: expected an entry below {}", self.entries)));
        }
        // SAFETY: `writer` points to the `Writer` of the `prefill` call in progress (it is nulled before
        // that call returns), used from the thread that made the call.
        let writer = unsafe { &mut *self.writer };
        let region =
            writer.region(entry).map_err(|e| PyValueError::new_err(format!("region {entry}: {}", e.message)))?;
        // The region is `len` writable bytes of the ring slot, valid until `prefill` returns; `finish`
        // checks that no view of it is left by then.
        let region = Region { ptr: region.as_mut_ptr().into(), len: region.len(), exports: Default::default() };
        let exported = Bound::new(py, region)?;
        let view = py.import("builtins")?.getattr("memoryview")?.call1((exported.clone(),))?;
        self.views.push((entry, view.clone().unbind(), exported.unbind()));
        Ok(view.unbind())
    }
}

impl PyWriter {
    /// Ends the call: no more regions, and every view handed out released. A view the backend kept (a
    /// cast, a slice, a numpy array over a region) would still reach the ring slot after the host took
    /// it, and it cannot be revoked: the call then fails as a `PANIC`, so that the host kills this
    /// process, and the view with it.
    fn finish(&mut self, py: Python<'_>) -> Result<(), BackendError> {
        self.writer = std::ptr::null_mut();
        let mut kept = Vec::new();
        for (entry, view, region) in self.views.drain(..) {
            let _ = view.bind(py).call_method0("release");
            drop(view);
            let region = region.borrow(py);
            // Kept (as a view's `.obj`), the region gives no new view of the slot.
            region.ptr.set(std::ptr::null_mut());
            if region.exports.get() > 0 {
                kept.push(entry.to_string());
            }
        }
        if kept.is_empty() {
            return Ok(());
        }
        Err(BackendError::new(
            PdhostStatus::Panic,
            format!(
                "prefill returned with a view of region(s) {} still alive (a cast, slice or array of the \
                 memoryview kept past the call): it would reach a slot the host owns",
                kept.join(", ")
            ),
        ))
    }
}

impl pdhost_plugin_abi::Backend for PyBackend {
    fn open(config: &str) -> Result<Self, BackendError> {
        let json: serde_json::Value =
            serde_json::from_str(config).map_err(|e| bad_config(format!("config: expected JSON, found {e}")))?;
        let name = |key: &str| {
            json.get(key).and_then(|v| v.as_str()).map(str::to_string).ok_or_else(|| {
                bad_config(format!("config: expected {key:?} (set by --producer py:MODULE:CLASS), found none"))
            })
        };
        let (module, class) = (name("python_module")?, name("python_class")?);
        let path: Vec<String> = match json.get("python_path") {
            None => Vec::new(),
            Some(p) => serde_json::from_value(p.clone())
                .map_err(|_| bad_config("config python_path: expected a list of directories"))?,
        };
        let libpython = promote_libpython()?;
        initialize(&libpython)?;
        Python::attach(|py| {
            let sys = py.import("sys").map_err(|e| backend_error(py, "import sys", &e))?;
            let sys_path = sys.getattr("path").and_then(|p| p.cast_into::<PyList>().map_err(Into::into));
            let sys_path = sys_path.map_err(|e| backend_error(py, "sys.path", &e))?;
            for dir in path.iter().rev() {
                sys_path.insert(0, dir).map_err(|e| backend_error(py, "sys.path", &e))?;
            }
            // A module or class that is not there is not there on the next start either: BAD_CONFIG.
            let module_obj = py
                .import(module.as_str())
                .map_err(|e| bad_config(format!("importing {module}: {}", exception_text(py, &e))))?;
            let cls = module_obj
                .getattr(class.as_str())
                .map_err(|_| bad_config(format!("{module}: expected a class {class}, found none")))?;
            let instance = cls.call0().map_err(|e| backend_error(py, &format!("{module}.{class}()"), &e))?;
            let loads =
                py.import("json").and_then(|j| j.getattr("loads")).map_err(|e| backend_error(py, "json", &e))?;
            let config_obj = loads.call1((config,)).map_err(|e| backend_error(py, "config", &e))?;
            let config_dict = config_obj.cast::<PyDict>().map_err(|_| bad_config("config: expected a JSON object"))?;
            instance.call_method1("open", (config_dict,)).map_err(|e| backend_error(py, "open", &e))?;
            let described = instance.call_method0("describe").map_err(|e| backend_error(py, "describe", &e))?;
            let (description, max_tokens) = description(&described).map_err(bad_config)?;
            let takes_context = instance.getattr("takes_context").and_then(|v| v.is_truthy()).unwrap_or(false);
            Ok(PyBackend { instance: instance.unbind(), description, max_tokens, takes_context })
        })
    }

    fn describe(&self) -> Description {
        self.description.clone()
    }

    fn capabilities(&self) -> Capabilities {
        // A class without `takes_context` refuses a prefix-cache hit's call: the host is told so now, and
        // never sends one (its requests take no hit and are prefilled from 0).
        Capabilities { max_tokens: self.max_tokens, refuses_context: !self.takes_context, ..Capabilities::default() }
    }

    fn prefill(&mut self, request: &Prefill<'_>, writer: &mut Writer<'_>) -> Result<(), BackendError> {
        Python::attach(|py| {
            // A request that starts past 0 with the tokens before it (a prefix-cache hit) goes only to a
            // class that says it takes one (the host, told by the capabilities, sends no other one).
            let context = if request.context.is_empty() {
                None
            } else if self.takes_context {
                Some(PyList::new(py, request.context).map_err(|e| backend_error(py, "context", &e))?)
            } else {
                return Err(BackendError::new(
                    PdhostStatus::Unsupported,
                    "a request that starts past position 0 (a prefix-cache hit): this class has no \
                     `takes_context = True`",
                ));
            };
            let entries = writer.entries();
            let tokens = PyList::new(py, request.tokens).map_err(|e| backend_error(py, "tokens", &e))?;
            // SAFETY (of the cast): the pointer is used only by `PyWriter::region` during this call, and
            // `finish` nulls it before the call returns, whatever Python did.
            let raw = (writer as *mut Writer<'_>).cast::<Writer<'static>>();
            let py_writer = Bound::new(py, PyWriter { writer: raw, views: Vec::new(), entries })
                .map_err(|e| backend_error(py, "writer", &e))?;
            let args = (request.request_id, tokens, request.start_pos, py_writer.clone());
            let instance = self.instance.bind(py);
            let called = match context {
                None => instance.call_method1("prefill", args),
                Some(context) => {
                    let kwargs = PyDict::new(py);
                    kwargs.set_item("context", context).map_err(|e| backend_error(py, "context", &e))?;
                    instance.call_method("prefill", args, Some(&kwargs))
                }
            };
            let finished = py_writer.borrow_mut().finish(py);
            // A view of the slot still held outlives the call, whatever Python raised: `finish`'s error
            // (which has the producer replaced) comes first.
            finished?;
            called.map_err(|e| backend_error(py, "prefill", &e))?;
            Ok(())
        })
    }

    fn release(&mut self, request_id: u64) {
        Python::attach(|py| {
            let instance = self.instance.bind(py);
            if instance.hasattr("release").unwrap_or(false) {
                if let Err(e) = instance.call_method1("release", (request_id,)) {
                    pdhost_plugin_abi::log(
                        pdhost_plugin_abi::PdhostLogLevel::Warn,
                        &format!("release({request_id}): {}", exception_text(py, &e)),
                    );
                }
            }
        })
    }
}

pdhost_plugin_abi::export_backend!(PyBackend, c"python");

#[cfg(test)]
mod tests {
    use super::*;

    /// The home is the nearest directory above the library with its version's standard library, through
    /// symlinks (Debian's `/lib` is `/usr/lib`); a library with no standard library near it has none.
    #[test]
    fn the_interpreter_home_is_found_above_its_library() {
        let root = std::env::temp_dir().join(format!("pdhost-stdlib-{}", std::process::id()));
        let prefix = root.join("usr");
        std::fs::create_dir_all(prefix.join("lib/python3.11")).unwrap();
        std::fs::create_dir_all(prefix.join("lib/x86_64-linux-gnu")).unwrap();
        std::fs::write(prefix.join("lib/python3.11/os.py"), "").unwrap();
        let lib = prefix.join("lib/x86_64-linux-gnu/libpython3.11.so.1.0");
        std::fs::write(&lib, "").unwrap();
        std::os::unix::fs::symlink(prefix.join("lib"), root.join("lib")).unwrap();
        let canonical = std::fs::canonicalize(&prefix).unwrap();
        assert_eq!(stdlib_home(&lib), Some(canonical.clone()));
        assert_eq!(stdlib_home(&root.join("lib/x86_64-linux-gnu/libpython3.11.so.1.0")), Some(canonical));
        let other = prefix.join("lib/x86_64-linux-gnu/libpython3.99.so.1.0");
        std::fs::write(&other, "").unwrap();
        assert_eq!(stdlib_home(&other), None, "no python3.99 standard library anywhere above it");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
