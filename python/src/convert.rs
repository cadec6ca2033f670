//! Requests from Python arguments and views into Python dicts. A view has the fields of the
//! HTTP API's JSON (it is made from the same serialization), except that `room` is an int
//! (JSON carries it as a string only because of JSON numbers), every `state` (the room's and
//! each transfer's) is a `kvferry.RoomState` (a `str` enum, equal to the JSON's string) and a
//! taken room's `aux` is bytes. The views' fields are typed in `kvferry/rooms.py`.

use kvferry::agent::RoomError;
use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyType};
use serde::Serialize;
use serde_json::Value;

/// A Python object of a JSON value.
pub(crate) fn object(py: Python<'_>, value: &Value) -> PyResult<Py<PyAny>> {
    Ok(match value {
        Value::Null => py.None(),
        Value::Bool(b) => b.into_py_any(py)?,
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_py_any(py)?,
            (None, Some(i)) => i.into_py_any(py)?,
            _ => n.as_f64().unwrap_or(f64::NAN).into_py_any(py)?,
        },
        Value::String(s) => s.into_py_any(py)?,
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(object(py, item)?)?;
            }
            list.into_any().unbind()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, object(py, v)?)?;
            }
            dict.into_any().unbind()
        }
    })
}

/// The dict of a view (any of the agents' serializable views).
pub(crate) fn view<'py>(
    py: Python<'py>,
    room: u64,
    v: &impl Serialize,
) -> PyResult<Bound<'py, PyDict>> {
    let json =
        serde_json::to_value(v).map_err(|e| crate::errors::Error::new_err(format!("view: {e}")))?;
    let dict = object(py, &json)?.into_bound(py).cast_into::<PyDict>()?;
    dict.set_item("room", room)?;
    room_state(&dict)?;
    if let Some(transfers) = dict.get_item("transfers")? {
        for transfer in transfers.try_iter()? {
            room_state(transfer?.cast::<PyDict>()?)?;
        }
    }
    Ok(dict)
}

/// Makes a dict's `state` string a `kvferry.RoomState`.
fn room_state(dict: &Bound<'_, PyDict>) -> PyResult<()> {
    static ROOM_STATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let py = dict.py();
    if let Some(state) = dict.get_item("state")? {
        let class = ROOM_STATE.import(py, "kvferry.rooms", "RoomState")?;
        dict.set_item("state", class.call1((state,))?)?;
    }
    Ok(())
}

/// The dict of a taken room: the view's fields, `aux` as bytes (or None), `verified`.
pub(crate) fn taken<'py>(
    py: Python<'py>,
    room: u64,
    t: &kvferry::agent::decode::TakenRoom,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = view(py, room, t)?;
    match &t.aux {
        Some(aux) => dict.set_item("aux", PyBytes::new(py, aux))?,
        None => dict.set_item("aux", py.None())?,
    }
    Ok(dict)
}

/// A room key: 32 hex digits (as the HTTP API takes it) or 16 bytes.
pub(crate) fn room_key(key: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Value>> {
    let Some(key) = key else { return Ok(None) };
    if key.is_none() {
        return Ok(None);
    }
    if let Ok(bytes) = key.extract::<Vec<u8>>()
        && !key.is_instance_of::<pyo3::types::PyString>()
    {
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        return Ok(Some(Value::String(hex)));
    }
    Ok(Some(Value::String(key.extract::<String>()?)))
}

/// A request struct from its JSON form (the HTTP API's parser, so the same checks and
/// messages), refused as a bad request when malformed.
pub(crate) fn request<T: serde::de::DeserializeOwned>(json: Value) -> PyResult<T> {
    serde_json::from_value(json)
        .map_err(|e| crate::errors::room_error(RoomError::BadRequest(e.to_string())))
}

/// The rooms of any iterable of ints (a list, a set, a generator).
pub(crate) fn rooms(items: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    items.try_iter()?.map(|r| r?.extract::<u64>()).collect()
}
