//! The unsafe boundary of the CUDA executor: probing for the driver library before any cudarc
//! call (cudarc panics when libcuda is missing).

use cudarc::driver::{result, sys};

/// Whether libcuda can be loaded.
fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its known names
    // and closes it again; it has no preconditions.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, or why none can be counted.
pub(crate) fn device_count() -> Result<usize, String> {
    if !driver_present() {
        return Err("the CUDA driver library (libcuda) was not found".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// The name of device `ordinal` (the driver must be present: call after [`device_count`]).
pub(crate) fn device_name(ordinal: usize) -> Result<String, String> {
    let dev =
        result::device::get(ordinal as i32).map_err(|e| format!("cuDeviceGet failed: {e:?}"))?;
    result::device::get_name(dev).map_err(|e| format!("cuDeviceGetName failed: {e:?}"))
}
