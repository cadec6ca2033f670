//! NVRTC, loaded at run time under the names of every CUDA major version kvferry supports.
//!
//! cudarc's own NVRTC loader tries the names of the CUDA version its bindings were generated for
//! (12) and older ones, and panics when none loads; CUDA 13 ships `libnvrtc.so.13`. NVRTC's C
//! API for what kvferry does (create a program, compile it, read its PTX and log) is the same
//! in CUDA 12 and 13, so this module binds those few functions itself: it probes
//! [`CANDIDATES`] in order, and a missing library is `None`, never a panic.
//!
//! Invariant: [`Nvrtc`] holds the library for the life of the process (a `OnceLock`), so the
//! function pointers it copied out stay valid.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

/// Library names tried, in order (the ordinary library search: `LD_LIBRARY_PATH`, the loader
/// cache): CUDA 12's first, the version kvferry's driver bindings target, then CUDA 13's; the
/// unversioned name is a toolkit's development link. NVRTC 13 calls into the CUDA driver while
/// it compiles (`cuGetExportTable`), which NVRTC 12 does not: where both are loadable (a venv
/// with PyTorch's CUDA 13 wheels beside the `nvidia-cuda-nvrtc-cu12` wheel) the one that needs
/// no driver wins.
pub const CANDIDATES: [&str; 3] = ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"];

type Program = *mut c_void;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type ReadFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The loaded NVRTC: which library, its version, and the functions kvferry calls.
pub struct Nvrtc {
    /// The name it was loaded by (one of [`CANDIDATES`]).
    pub library: &'static str,
    /// NVRTC's own version, `(major, minor)`.
    pub version: (i32, i32),
    create: CreateFn,
    compile: CompileFn,
    ptx_size: SizeFn,
    ptx: ReadFn,
    log_size: SizeFn,
    log: ReadFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("library", &self.library)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// Why one compilation failed: NVRTC's error name and, when it compiled, its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileFailure {
    /// NVRTC's name for the result (e.g. `NVRTC_ERROR_INVALID_OPTION`).
    pub error: String,
    /// The program log (empty when the program never compiled).
    pub log: String,
}

/// NVRTC, loaded on first use; `None` when no candidate loads or one lacks a function.
pub fn get() -> Option<&'static Nvrtc> {
    static NVRTC: OnceLock<Option<Nvrtc>> = OnceLock::new();
    NVRTC
        .get_or_init(|| CANDIDATES.iter().find_map(|name| load(name)))
        .as_ref()
}

fn load(name: &'static str) -> Option<Nvrtc> {
    // SAFETY: loading NVRTC runs no initialisation code with preconditions of ours.
    let lib = unsafe { libloading::Library::new(name) }.ok()?;
    // SAFETY: each symbol is NVRTC's documented C function with exactly this signature (nvrtc.h
    // of CUDA 12 and 13); the pointers are copied out and `lib` is kept beside them.
    unsafe {
        let version: VersionFn = *lib.get(b"nvrtcVersion\0").ok()?;
        let nvrtc = Nvrtc {
            library: name,
            version: (0, 0),
            create: *lib.get(b"nvrtcCreateProgram\0").ok()?,
            compile: *lib.get(b"nvrtcCompileProgram\0").ok()?,
            ptx_size: *lib.get(b"nvrtcGetPTXSize\0").ok()?,
            ptx: *lib.get(b"nvrtcGetPTX\0").ok()?,
            log_size: *lib.get(b"nvrtcGetProgramLogSize\0").ok()?,
            log: *lib.get(b"nvrtcGetProgramLog\0").ok()?,
            destroy: *lib.get(b"nvrtcDestroyProgram\0").ok()?,
            error_string: *lib.get(b"nvrtcGetErrorString\0").ok()?,
            _lib: lib,
        };
        let (mut major, mut minor) = (0, 0);
        if version(&mut major, &mut minor) != 0 {
            return None;
        }
        Some(Nvrtc {
            version: (major, minor),
            ..nvrtc
        })
    }
}

impl Nvrtc {
    /// Compiles `source` (named `name` in messages) with `options` to PTX, NUL stripped.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<String, CompileFailure> {
        let plain = |what: &str| CompileFailure {
            error: format!("{what} contains a NUL byte"),
            log: String::new(),
        };
        let source = CString::new(source).map_err(|_| plain("the source"))?;
        let name = CString::new(name).map_err(|_| plain("the name"))?;
        let options: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|_| plain("an option"))?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let count = c_int::try_from(option_ptrs.len()).map_err(|_| plain("options"))?;
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings that outlive the call; no headers.
        let rc = unsafe {
            (self.create)(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(rc, String::new())?;
        let program = Owned(self, program);
        // SAFETY: a program NVRTC created; the option pointers outlive the call.
        let rc = unsafe { (self.compile)(program.1, count, option_ptrs.as_ptr()) };
        if rc != 0 {
            let log = self
                .read(program.1, self.log_size, self.log)
                .unwrap_or_default();
            return Err(self.failure(rc, log));
        }
        self.read(program.1, self.ptx_size, self.ptx)
            .map_err(|rc| self.failure(rc, String::new()))
    }

    /// A NUL-terminated text of the program (its PTX or its log), sized by `size` and read by
    /// `read`; the NVRTC result on failure.
    fn read(&self, program: Program, size: SizeFn, read: ReadFn) -> Result<String, c_int> {
        let mut len = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        let rc = unsafe { size(program, &mut len) };
        if rc != 0 {
            return Err(rc);
        }
        let mut buf = vec![0u8; len.max(1)];
        // SAFETY: `buf` holds the `len` bytes NVRTC said it writes (at least one).
        let rc = unsafe { read(program, buf.as_mut_ptr().cast()) };
        if rc != 0 {
            return Err(rc);
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        buf.truncate(end);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn check(&self, rc: c_int, log: String) -> Result<(), CompileFailure> {
        match rc {
            0 => Ok(()),
            rc => Err(self.failure(rc, log)),
        }
    }

    fn failure(&self, rc: c_int, log: String) -> CompileFailure {
        // SAFETY: NVRTC returns a static string for any result value (or null).
        let name = unsafe { (self.error_string)(rc) };
        let error = match name.is_null() {
            true => format!("NVRTC error {rc}"),
            // SAFETY: non-null, NUL-terminated, static.
            false => unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        };
        CompileFailure { error, log }
    }
}

/// A program destroyed when dropped.
struct Owned<'a>(&'a Nvrtc, Program);

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        // SAFETY: a program NVRTC created, destroyed once.
        let _ = unsafe { (self.0.destroy)(&mut self.1) };
    }
}
