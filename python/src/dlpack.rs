//! [`Pool`]: one of a rank's device pools as a DLPack producer, so an engine's attention
//! kernels read and write the pool in place (`torch.from_dlpack(pool)`,
//! `numpy.from_dlpack(pool)`), without a copy.
//!
//! The tensor is `uint8[layers, local_pages, page_bytes]`, the pool's layout; an engine views
//! the last dimension as its own dtype. The memory belongs to the rank's cache: every
//! exported tensor holds a reference to its `RankCache`, so the pool outlives the tensors
//! taken from it. The DLPack structures are the stable C ABI of `dlpack.h` (v0.8), written
//! out here since they are a few plain structs.

use crate::rank::ViewToken;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: c_int,
    device_id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: c_int,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// DLPack device types.
const KDL_CPU: c_int = 1;
const KDL_CUDA: c_int = 2;
/// DLPack's unsigned-integer type code.
const KDL_UINT: u8 = 1;

/// The capsule's name until a consumer takes the tensor (it renames it `used_dltensor`).
const CAPSULE_NAME: &CStr = c"dltensor";

/// What a managed tensor keeps alive: its shape and strides, and the cache that owns the
/// memory.
struct Context {
    shape: [i64; 3],
    strides: [i64; 3],
    /// Never read: holding it keeps the cache, hence the pool, alive.
    _owner: Py<PyAny>,
    /// Keeps a closed cache's memory until this tensor is gone.
    _view: ViewToken,
}

/// One rank's device pool of one buffer kind, as a DLPack producer.
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct Pool {
    /// The cache, visible to the garbage collector (`__traverse__`) and let go by it
    /// (`__clear__`) when this pool is part of a cycle no one reaches: a pool kept by the
    /// engine object that is the cache's group, say. `None` once cleared.
    pub(crate) owner: Mutex<Option<Py<PyAny>>>,
    /// Keeps a closed cache's memory while this object is alive.
    pub(crate) view: ViewToken,
    pub(crate) buffer: String,
    pub(crate) ptr: u64,
    pub(crate) device: (c_int, c_int),
    pub(crate) shape: [i64; 3],
}

impl Pool {
    /// A pool at `address` of `shape` (`[layers, local_pages, page_bytes]`), kept alive by
    /// `owner`.
    pub(crate) fn new(
        owner: Py<PyAny>,
        view: ViewToken,
        buffer: String,
        address: cp_hicache::exec::Address,
        shape: [i64; 3],
    ) -> Pool {
        let device = match address.space {
            cp_hicache::exec::AddressSpace::Host => (KDL_CPU, 0),
            cp_hicache::exec::AddressSpace::Cuda(ordinal) => (KDL_CUDA, ordinal),
        };
        Pool {
            owner: Mutex::new(Some(owner)),
            view,
            buffer,
            ptr: address.ptr,
            device,
            shape,
        }
    }
}

unsafe extern "C" fn delete_managed(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `__dlpack__`, and
    // DLPack calls the deleter once.
    let managed = unsafe { Box::from_raw(managed) };
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Context>()) };
    // Dropping the owner reference needs the interpreter. A tensor freed once the
    // interpreter has begun to shut down (after its `atexit` handlers: `Py_IsInitialized`
    // still says yes then, and attaching a thread there can hang or abort) leaks its context
    // instead: the process is ending anyway.
    // SAFETY: a plain query of the runtime's state.
    if SHUTTING_DOWN.load(Ordering::Acquire) || unsafe { ffi::Py_IsInitialized() } == 0 {
        std::mem::forget(ctx);
        return;
    }
    // The GIL is taken from the interpreter itself, never from PyO3's record of this thread:
    // torch runs this deleter with the GIL released (a tensor freed by the garbage
    // collector), and when that happens inside one of this module's calls (another cache's
    // collective round, which runs Python: the collector may run there), PyO3 still counts
    // the thread as attached, so `Python::attach` alone would not take the GIL. Freeing the
    // cache object without it (this may be its last reference) crashed the process in
    // `PyObject_GC_Del` (issue 45). `PyGILState_Ensure` takes the GIL when this thread does
    // not hold it, does nothing when it does, and gives a thread that never ran Python a
    // thread state; `PyGILState_Release` puts back what was.
    // SAFETY: the interpreter is initialised and not shutting down (checked above).
    let state = unsafe { ffi::PyGILState_Ensure() };
    Python::attach(|_| drop(ctx));
    // SAFETY: pairs the `PyGILState_Ensure` above, on the same thread.
    unsafe { ffi::PyGILState_Release(state) };
}

/// Set by an `atexit` handler the module registers ([`register_shutdown_hook`]): from then
/// on the DLPack deleter never attaches to Python.
static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);

#[pyfunction]
fn _interpreter_shutting_down() {
    SHUTTING_DOWN.store(true, Ordering::Release);
}

/// Registers the `atexit` handler that tells the deleter the interpreter is shutting down.
pub(crate) fn register_shutdown_hook(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_interpreter_shutting_down, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumer renames the capsule when it takes the tensor; then the tensor is its to
    // delete, and nothing is left to do. An unconsumed capsule still owns it. An exception
    // may be unwinding while the capsule is freed: it is kept aside while the context goes
    // (dropping the cache reference can run arbitrary code) and put back.
    // SAFETY: `capsule` is the capsule being destroyed; the name is a valid C string;
    // `PyCapsule_IsValid` never sets an error.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) != 1 {
            return;
        }
        let (mut kind, mut value, mut trace) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        ffi::PyErr_Fetch(&mut kind, &mut value, &mut trace);
        let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr());
        delete_managed(managed.cast());
        ffi::PyErr_Restore(kind, value, trace);
    }
}

#[pymethods]
impl Pool {
    /// The garbage collector's view of the cache this pool holds.
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        // Never wait here: the lock is only held to clone or take the reference.
        if let Ok(owner) = self.owner.try_lock() {
            if let Some(owner) = owner.as_ref() {
                visit.call(owner)?;
            }
        }
        Ok(())
    }

    /// Breaks a cycle through the cache. The memory stays valid for the tensors taken from
    /// this pool (each keeps its own view of it); a capsule asked for afterwards is refused.
    fn __clear__(&self) {
        let owner = match self.owner.lock() {
            Ok(mut owner) => owner.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        drop(owner);
    }

    /// The buffer kind (`mla_kv`; NSA: `nsa_kv`, `nsa_idx`).
    #[getter]
    fn buffer(&self) -> &str {
        &self.buffer
    }

    /// `(layers, local_pages, page_bytes)`.
    #[getter]
    fn shape(&self) -> (i64, i64, i64) {
        (self.shape[0], self.shape[1], self.shape[2])
    }

    /// The address of the pool's first byte.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// `(device_type, device_id)` as DLPack numbers them (1: CPU, 2: CUDA).
    fn __dlpack_device__(&self) -> (c_int, c_int) {
        self.device
    }

    /// A DLPack capsule viewing the pool in place (no copy). The pool's work is ordered on
    /// the cache's own stream; a consumer on another stream synchronises with it first
    /// (`stream` is accepted for the protocol and not used: the CPU has no streams, and on a
    /// GPU the cache's load handle says when a layer is ready).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(c_int, c_int)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, max_version);
        if let Some(d) = dl_device.filter(|&d| d != self.device) {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "the {} pool is on DLPack device {:?} and cannot be exported to {d:?} without \
                 a copy",
                self.buffer, self.device
            )));
        }
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "a pool is exported in place only (copy=True is not supported)",
            ));
        }
        let owner = self
            .owner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|o| o.clone_ref(py))
            .ok_or_else(|| {
                pyo3::exceptions::PyBufferError::new_err(format!(
                    "the {} pool was let go of its cache by the garbage collector (a cycle \
                     no one reached): take the pool from the cache again",
                    self.buffer
                ))
            })?;
        let [_, pages, bytes] = self.shape;
        // The context is moved to the heap first, so that the shape and stride pointers
        // are taken from where they stay.
        let ctx = Box::into_raw(Box::new(Context {
            shape: self.shape,
            strides: [pages * bytes, bytes, 1],
            _owner: owner,
            _view: self.view.another(),
        }));
        // SAFETY: `ctx` is a live allocation owned by the managed tensor until its deleter.
        let (shape, strides) = unsafe {
            (
                std::ptr::addr_of_mut!((*ctx).shape).cast::<i64>(),
                std::ptr::addr_of_mut!((*ctx).strides).cast::<i64>(),
            )
        };
        let managed = Box::new(DLManagedTensor {
            dl_tensor: DLTensor {
                data: self.ptr as *mut c_void,
                device: DLDevice {
                    device_type: self.device.0,
                    device_id: self.device.1,
                },
                ndim: 3,
                dtype: DLDataType {
                    code: KDL_UINT,
                    bits: 8,
                    lanes: 1,
                },
                shape,
                strides,
                byte_offset: 0,
            },
            manager_ctx: ctx.cast(),
            deleter: Some(delete_managed),
        });
        let raw = Box::into_raw(managed);
        // SAFETY: `raw` is a valid managed tensor, the name a static C string; the capsule
        // owns `raw` until a consumer renames it.
        let capsule = unsafe {
            ffi::PyCapsule_New(raw.cast(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor))
        };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so `raw` is still ours to delete.
            unsafe { delete_managed(raw) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `capsule` is a new, owned reference.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
    }

    fn __repr__(&self) -> String {
        format!(
            "Pool(buffer={:?}, shape={:?}, device={:?})",
            self.buffer, self.shape, self.device
        )
    }
}
