//! Arguments and results across the boundary: page counts, `u32` ids as little-endian
//! bytes, JSON values and request statistics as Python objects.

use crate::errors::{usage, CacheError};
use cp_hicache::rank::RequestStats;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// A page count argument: a whole number in `1..=u32::MAX`, or a `UsageError` naming it.
pub(super) fn pages_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    let bad = || {
        let shown = value
            .repr()
            .map_or_else(|_| "?".to_string(), |r| r.to_string());
        usage(format!(
            "{name}={shown}: a page count is a whole number from 1 to {}",
            u32::MAX
        ))
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad());
    }
    let n: i64 = value.extract().map_err(|_| bad())?;
    u32::try_from(n).ok().filter(|&n| n > 0).ok_or_else(bad)
}

/// `u32` ids from little-endian bytes.
pub(super) fn ids(bytes: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if bytes.len() % 4 != 0 {
        return Err(usage(format!(
            "{what}: {} bytes is not a whole number of u32 ids",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

/// Little-endian bytes of `u32` ids.
pub(super) fn id_bytes<'py>(
    py: Python<'py>,
    v: impl IntoIterator<Item = u32>,
) -> Bound<'py, PyBytes> {
    let b: Vec<u8> = v.into_iter().flat_map(u32::to_le_bytes).collect();
    PyBytes::new(py, &b)
}

/// A JSON value as a Python object (dicts, lists, numbers, strings, None).
pub(crate) fn to_object(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    use pyo3::IntoPyObjectExt;
    Ok(match v {
        serde_json::Value::Null => py.None(),
        serde_json::Value::Bool(b) => b.into_py_any(py)?,
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_py_any(py)?,
            (None, Some(i)) => i.into_py_any(py)?,
            _ => n.as_f64().unwrap_or(f64::NAN).into_py_any(py)?,
        },
        serde_json::Value::String(s) => s.into_py_any(py)?,
        serde_json::Value::Array(a) => a
            .iter()
            .map(|x| to_object(py, x))
            .collect::<PyResult<Vec<_>>>()?
            .into_py_any(py)?,
        serde_json::Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, to_object(py, x)?)?;
            }
            d.into_any().unbind()
        }
    })
}

/// A request's statistics as a dict.
pub(super) fn stats_object(py: Python<'_>, stats: &RequestStats) -> PyResult<Py<PyAny>> {
    let v = serde_json::to_value(stats).map_err(|e| CacheError::new_err(e.to_string()))?;
    let out = to_object(py, &v)?;
    out.bind(py)
        .set_item("first_mismatched_token", stats.first_mismatched_token)?;
    Ok(out)
}

/// A request's statistics as a dict, with `tokens`: the request's tokens so far (what `begin`
/// took, then every token `extend` added), which an engine sizes its views of the request
/// by (`token_locations`); `prompt_tokens` stays what `begin` took.
pub(super) fn request_stats_object(
    py: Python<'_>,
    stats: &RequestStats,
    tokens: usize,
) -> PyResult<Py<PyAny>> {
    let out = stats_object(py, stats)?;
    out.bind(py).set_item("tokens", tokens)?;
    Ok(out)
}
