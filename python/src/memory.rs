//! The engine's memory as kvferry sees it: each region a Python object (anything with the
//! buffer protocol, `__array_interface__`, or `data_ptr()` and `nbytes` like a torch tensor)
//! or a raw `(address, length)` pair, turned into [`EngineRegion`]s and a pool over them: host
//! memory, or device memory (CUDA tensors, or raw pairs the caller names as device memory).
//!
//! The only `unsafe` of the package is here: [`engine_pool`] vouches to
//! [`HostPool::engine`] and [`DevicePool::engine`] that the regions stay valid. The agent keeps
//! every object returned in [`Regions::keep`] until its tasks are joined (`agents.rs`). How
//! much that holds depends on the object:
//! - a buffer (buffer protocol): a buffer export, which keeps the memory allocated and, for
//!   objects that honour exports (`bytearray`, numpy arrays), from being resized;
//! - a tensor (`data_ptr()`): the tensor and its storage, so the memory is not freed when the
//!   tensor is pointed elsewhere (`set_`) or dropped; an in-place resize of the storage can
//!   still move it, which the package documents the caller must not do;
//! - an `__array_interface__` object or a raw `(address, length)` pair: the object at most;
//!   that the memory stays is the caller's promise, documented as such.

#![allow(unsafe_code)]

use kvferry::agent::EnginePool;
use kvferry::kernel::cuda::{CudaKernel, DevicePool};
use kvferry::layout::KvLayout;
use kvferry::pool::{EngineRegion, HostPool};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::RegionError;

/// Regions and the Python objects that own their memory.
pub(crate) struct Regions {
    pub(crate) regions: Vec<EngineRegion>,
    /// References the agent holds for its whole life: the objects themselves, or for buffers
    /// the ctypes view that holds a buffer export (which also keeps a `bytearray` from being
    /// resized, that is, moved).
    pub(crate) keep: Vec<Py<PyAny>>,
    /// The CUDA device the regions are memory of; `None`: host memory.
    pub(crate) device: Option<usize>,
}

/// Where one region's memory is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Place {
    /// A raw `(address, length)` pair: host memory unless the caller names a device.
    Raw,
    Host,
    /// A CUDA tensor on this device.
    Device(usize),
}

/// Reads a list of regions; `device` names the CUDA device that raw pairs are memory of
/// (tensors say where they are themselves).
pub(crate) fn regions(items: &Bound<'_, PyAny>, device: Option<usize>) -> PyResult<Regions> {
    let mut out = Regions {
        regions: Vec::new(),
        keep: Vec::new(),
        device,
    };
    for (i, item) in items.try_iter()?.enumerate() {
        let item = item?;
        let bad = |e: String| RegionError::new_err(format!("region {i}: {e}"));
        let (addr, len, keep, place) = region(&item).map_err(bad)?;
        match (place, out.device) {
            (Place::Raw, _) | (Place::Host, None) => {}
            (Place::Device(d), None) if i == 0 => out.device = Some(d),
            (Place::Device(d), Some(want)) if d == want => {}
            (Place::Device(d), _) => {
                let other = out
                    .device
                    .map_or("host memory".to_owned(), |o| format!("CUDA device {o}"));
                return Err(bad(format!(
                    "memory of CUDA device {d}, the other regions are {other}"
                )));
            }
            (Place::Host, Some(d)) => {
                return Err(bad(format!(
                    "host memory, the regions are memory of CUDA device {d}"
                )));
            }
        }
        out.regions.push(EngineRegion { addr, len });
        out.keep.push(keep);
    }
    Ok(out)
}

/// One region: address, length, the object to keep and where its memory is.
fn region<'py>(item: &Bound<'py, PyAny>) -> Result<(usize, usize, Py<PyAny>, Place), String> {
    let py = item.py();
    let text = |e: PyErr| e.to_string();
    if let Ok(pair) = item.cast::<PyTuple>() {
        let (addr, len): (usize, usize) = pair
            .extract()
            .map_err(|_| "a tuple region is (address, length), two non-negative ints".to_owned())?;
        return Ok((addr, len, item.clone().unbind(), Place::Raw));
    }
    if item.hasattr("data_ptr").map_err(text)? && item.hasattr("nbytes").map_err(text)? {
        if item.hasattr("is_contiguous").map_err(text)?
            && !item
                .call_method0("is_contiguous")
                .map_err(text)?
                .extract::<bool>()
                .map_err(text)?
        {
            return Err("the tensor is not contiguous".into());
        }
        let mut place = Place::Host;
        if let Ok(device) = item.getattr("device") {
            let kind: String = match device.getattr("type") {
                Ok(t) => t.extract().map_err(text)?,
                Err(_) => device.str().map_err(text)?.to_string(),
            };
            place = match kind.as_str() {
                "cpu" => Place::Host,
                "cuda" => {
                    let index: Option<usize> = device
                        .getattr("index")
                        .map_err(text)?
                        .extract()
                        .map_err(text)?;
                    Place::Device(index.unwrap_or(0))
                }
                other => {
                    return Err(format!(
                        "the tensor is on device {other}; kvferry serves host and CUDA memory"
                    ));
                }
            };
        }
        let addr: usize = item
            .call_method0("data_ptr")
            .map_err(text)?
            .extract()
            .map_err(text)?;
        let nbytes = item.getattr("nbytes").map_err(text)?;
        let len: usize = match nbytes.is_callable() {
            true => nbytes.call0().map_err(text)?.extract().map_err(text)?,
            false => nbytes.extract().map_err(text)?,
        };
        // The storage too: a tensor pointed at other memory (`set_`) or dropped by the engine
        // would otherwise free this memory under the agent.
        let keep = match item.getattr("untyped_storage") {
            Ok(storage) if storage.is_callable() => {
                let storage = storage.call0().map_err(text)?;
                PyTuple::new(py, [item.clone(), storage])
                    .map_err(text)?
                    .into_any()
                    .unbind()
            }
            _ => item.clone().unbind(),
        };
        return Ok((addr, len, keep, place));
    }
    let ctypes = py.import("ctypes").map_err(text)?;
    if let Ok(view) = py
        .import("builtins")
        .and_then(|b| b.getattr("memoryview")?.call1((item,)))
    {
        let readonly: bool = view
            .getattr("readonly")
            .map_err(text)?
            .extract()
            .map_err(text)?;
        let contiguous: bool = view
            .getattr("c_contiguous")
            .map_err(text)?
            .extract()
            .map_err(text)?;
        let len: usize = view
            .getattr("nbytes")
            .map_err(text)?
            .extract()
            .map_err(text)?;
        view.call_method0("release").map_err(text)?;
        if readonly {
            return Err("the buffer is read-only".into());
        }
        if !contiguous {
            return Err("the buffer is not C-contiguous".into());
        }
        // A ctypes array over the buffer: its address, and a buffer export that lives as long
        // as the array (the agent keeps the array).
        let array_type = ctypes
            .getattr("c_char")
            .map_err(text)?
            .mul(len)
            .map_err(text)?;
        let array = array_type
            .call_method1("from_buffer", (item,))
            .map_err(text)?;
        let addr: usize = ctypes
            .call_method1("addressof", (&array,))
            .map_err(text)?
            .extract()
            .map_err(text)?;
        return Ok((addr, len, array.unbind(), Place::Host));
    }
    if let Ok(iface) = item.getattr("__array_interface__") {
        let iface = iface
            .cast_into::<PyDict>()
            .map_err(|_| "__array_interface__ is not a dict".to_owned())?;
        let get = |key: &str| -> Result<Bound<'py, PyAny>, String> {
            iface
                .get_item(key)
                .map_err(text)?
                .ok_or_else(|| format!("__array_interface__ has no {key:?}"))
        };
        let (addr, readonly): (usize, bool) = get("data")?
            .extract()
            .map_err(|_| "__array_interface__'s data is not (address, read-only)".to_owned())?;
        if readonly {
            return Err("the array is read-only".into());
        }
        let shape: Vec<usize> = get("shape")?.extract().map_err(text)?;
        let typestr: String = get("typestr")?.extract().map_err(text)?;
        let itemsize: usize = typestr
            .get(2..)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("unknown typestr {typestr:?}"))?;
        if let Some(strides) = iface.get_item("strides").map_err(text)?
            && !strides.is_none()
        {
            let strides: Vec<isize> = strides.extract().map_err(text)?;
            let mut want = itemsize as isize;
            for (&n, &s) in shape.iter().zip(&strides).rev() {
                if n > 1 && s != want {
                    return Err("the array is not C-contiguous".into());
                }
                want *= n as isize;
            }
        }
        let len = shape.iter().product::<usize>() * itemsize;
        return Ok((addr, len, item.clone().unbind(), Place::Host));
    }
    Err(format!(
        "{} is neither (address, length), a writable buffer, an object with __array_interface__, nor one with data_ptr() and nbytes",
        item.get_type().name().map_err(text)?
    ))
}

/// An event of the agent's kernel that follows the engine's CUDA event `event` (a `CUevent`
/// handle, e.g. `torch.cuda.Event().cuda_event`) on the pool's `device`.
pub(crate) fn follow(
    device: Option<usize>,
    event: u64,
) -> PyResult<kvferry::kernel::cuda::ReadyEvent> {
    let device = device.ok_or_else(|| {
        RegionError::new_err(
            "cuda_event marks device memory ready; this agent's pool is host memory",
        )
    })?;
    if event == 0 {
        return Err(RegionError::new_err("cuda_event is a null CUevent"));
    }
    // A CUevent is the address of the driver's event object in this process: one that is
    // misaligned or beyond user space cannot be one.
    if !event.is_multiple_of(8) || event >= 1 << 56 {
        return Err(RegionError::new_err(format!(
            "cuda_event {event:#x} is not a CUevent handle (the address of a driver event)"
        )));
    }
    let kernel = CudaKernel::shared(device).map_err(|e| RegionError::new_err(e.to_string()))?;
    // SAFETY: only the caller can vouch that `event` is a live CUevent of this process in the
    // primary context of the pool's device (what torch.cuda.Event.cuda_event is): the package
    // documents that it must be, and the checks above refuse only what cannot be one. The
    // driver dereferences the handle; it may be destroyed as soon as this returns.
    unsafe { kernel.follow(event) }.map_err(|e| RegionError::new_err(e.to_string()))
}

/// The pool over the engine's regions: host memory, or device memory on `regions.device` (the
/// CUDA driver, the device and NVRTC are needed; the error says which is missing).
pub(crate) fn engine_pool(
    layout: KvLayout,
    pages: usize,
    regions: &Regions,
) -> PyResult<EnginePool> {
    let err = |e: String| RegionError::new_err(e);
    // SAFETY (both): the agent built on this pool holds `regions.keep` until its tasks are
    // joined. That keeps a buffer's memory allocated and unresizable (its export) and a
    // tensor's storage allocated (module doc); that the memory also stays in place (no in-place
    // resize of a tensor's storage, nothing freed behind an `__array_interface__` or a raw
    // pair) is the caller's promise, which the package documents. Buffers were checked
    // writable; the pools check lengths and overlaps, and a device pool asks the driver that
    // every region lies inside one of its allocations.
    match regions.device {
        None => unsafe { HostPool::engine(layout, pages, &regions.regions) }
            .map(EnginePool::Host)
            .map_err(|e| err(e.to_string())),
        Some(device) => {
            let kernel = CudaKernel::shared(device).map_err(|e| err(e.to_string()))?;
            unsafe { DevicePool::engine(&kernel, layout, pages, &regions.regions) }
                .map(EnginePool::Device)
                .map_err(|e| err(e.to_string()))
        }
    }
}
