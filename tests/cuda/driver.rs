//! The harness of the CUDA driver emulator's tests: the emulator built by `emu/cuda/build` and
//! loaded by path (no GPU and no library path involved), its functions called through their C
//! ABI. Each case runs in a forked child, so that the library's process-wide state
//! (initialisation, the current context) starts fresh and a crash is an observable outcome
//! (nextest runs every test in a process of its own, so nothing else runs when it forks).
#![allow(dead_code, unsafe_code, unreachable_pub)]

use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

pub type R = i32;
pub type Ptr = *mut c_void;
pub const SUCCESS: R = 0;
pub const INVALID_VALUE: R = 1;
pub const NOT_INITIALIZED: R = 3;
pub const INVALID_DEVICE: R = 101;
pub const INVALID_CONTEXT: R = 201;
pub const NOT_FOUND: R = 500;

/// The emulator in its one place (`emu/cuda/build` with no argument: target/cuda-emu), built by
/// the first process of the run that asks (the script takes turns and builds only what
/// changed) and shared by every other test, scripts/test's emulator step and pytest.
pub fn library() -> &'static PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(root.join("emu/cuda/build"))
            .output()
            .expect("running emu/cuda/build");
        assert!(
            out.status.success(),
            "emu/cuda/build failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("libcuda.so")
    })
}

pub struct Driver(libloading::Library);

impl Driver {
    pub fn open() -> Driver {
        // SAFETY: our own library; its initialisers only set up statics.
        Driver(unsafe { libloading::Library::new(library()) }.expect("loading the emulator"))
    }

    /// The driver the dynamic loader finds (`libcuda.so.1` on the library path): the emulator
    /// when its directory is on `LD_LIBRARY_PATH`, a GPU's driver otherwise.
    pub fn system() -> Driver {
        // SAFETY: the CUDA driver library; its initialisers only set up its own state.
        Driver(unsafe { libloading::Library::new("libcuda.so.1") }.expect("loading libcuda.so.1"))
    }

    /// The driver function `name` of type `F`.
    pub fn f<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller names a function of the driver API with its C signature.
        unsafe {
            *self
                .0
                .get::<F>(name.as_bytes())
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        }
    }

    /// cuInit, then device 0's primary context made current.
    pub fn ready(&self) {
        let init: unsafe extern "C" fn(u32) -> R = self.f("cuInit");
        let retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> R =
            self.f("cuDevicePrimaryCtxRetain");
        let set: unsafe extern "C" fn(*mut c_void) -> R = self.f("cuCtxSetCurrent");
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(init(0), SUCCESS);
            assert_eq!(retain(&mut ctx, 0), SUCCESS);
            assert_eq!(set(ctx), SUCCESS);
        }
    }
}

/// Runs `case` in a forked child with the emulator loaded, initialised and device 0's context
/// current; returns how it ended: `Ok(exit code)` or `Err(signal)`.
pub fn with_context(case: impl FnOnce(&Driver)) -> Result<i32, i32> {
    spawn_with_context(case).wait()
}

/// Starts `case` in a forked child with the emulator loaded, initialised and device 0's
/// context current.
pub fn spawn_with_context(case: impl FnOnce(&Driver)) -> Child {
    spawn(|| {
        let d = Driver::open();
        d.ready();
        case(&d);
    })
}

/// Runs `case` in a forked child; returns how it ended: `Ok(exit code)` or `Err(signal)`.
pub fn in_child(case: impl FnOnce()) -> Result<i32, i32> {
    spawn(case).wait()
}

/// A forked child running a case.
pub struct Child(libc::pid_t);

/// Starts `case` in a forked child (the emulator is not loaded in this process, so the child
/// starts without its state).
pub fn spawn(case: impl FnOnce()) -> Child {
    library();
    // SAFETY: the child runs only `case` and exits; the test harness's threads are not used in it.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // A case that hangs ends by SIGALRM instead of holding the test forever.
        // SAFETY: alarm only schedules a signal.
        unsafe { libc::alarm(120) };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(case)).is_ok();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 101 }) }
    }
    Child(pid)
}

impl Child {
    pub fn pid(&self) -> libc::pid_t {
        self.0
    }

    /// How the child ended: `Ok(exit code)` or `Err(signal)`.
    pub fn wait(self) -> Result<i32, i32> {
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.0, &mut status, 0) };
        if libc::WIFEXITED(status) {
            Ok(libc::WEXITSTATUS(status))
        } else {
            Err(libc::WTERMSIG(status))
        }
    }
}

pub type Alloc = unsafe extern "C" fn(*mut u64, usize) -> R;
pub type Free = unsafe extern "C" fn(u64) -> R;
pub type HtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> R;
pub type DtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> R;

/// CUmemAllocationProp: pinned device memory on device 0, optionally exportable as a POSIX fd.
#[repr(C)]
pub struct Prop {
    pub kind: i32,
    pub handle_types: i32,
    pub location: [i32; 2],
    pub win32: *mut c_void,
    pub flags: [u8; 8],
}

pub fn prop(shareable: bool) -> Prop {
    Prop {
        kind: 1,
        handle_types: i32::from(shareable),
        location: [1, 0],
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    }
}

/// CUmemAccessDesc: read and write for device 0.
#[repr(C)]
pub struct Access {
    pub location: [i32; 2],
    pub flags: i32,
}

pub const READ_WRITE: Access = Access {
    location: [1, 0],
    flags: 3,
};

pub type Granularity = unsafe extern "C" fn(*mut usize, *const Prop, i32) -> R;
pub type Create = unsafe extern "C" fn(*mut u64, usize, *const Prop, u64) -> R;
pub type Release = unsafe extern "C" fn(u64) -> R;
pub type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> R;
pub type AddressFree = unsafe extern "C" fn(u64, usize) -> R;
pub type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> R;
pub type Unmap = unsafe extern "C" fn(u64, usize) -> R;
pub type SetAccess = unsafe extern "C" fn(u64, usize, *const Access, usize) -> R;
pub type Export = unsafe extern "C" fn(*mut c_void, u64, i32, u64) -> R;
pub type Import = unsafe extern "C" fn(*mut u64, *mut c_void, i32) -> R;
pub const POSIX_FD: i32 = 1;
