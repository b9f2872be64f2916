//! Reaching the CUDA driver as programs do: dlopen, then every function by
//! dlsym (exact `_v2` names) or through cuGetProcAddress (base names), as
//! the CUDA 12 and 11 runtimes do.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use crate::fail;

pub type CUresult = c_int;
pub type Ctx = *mut c_void;
pub const MIB: u64 = 1 << 20;

#[repr(C)]
pub struct Prop {
    pub type_: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32: *mut c_void,
    pub flags: [u8; 8],
}

#[repr(C)]
pub struct PoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

#[repr(C)]
pub struct AccessDesc {
    pub location_type: c_int,
    pub location_id: c_int,
    pub flags: c_int,
}

#[repr(C)]
pub struct ArrayDesc {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub channels: c_uint,
}

#[repr(C)]
pub struct Array3dDesc {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub channels: c_uint,
    pub flags: c_uint,
}

pub struct Api {
    pub mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    pub mem_free: unsafe extern "C" fn(u64) -> CUresult,
    pub alloc_async: unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> CUresult,
    pub alloc_pool: unsafe extern "C" fn(*mut u64, usize, *mut c_void, *mut c_void) -> CUresult,
    pub free_async: unsafe extern "C" fn(u64, *mut c_void) -> CUresult,
    pub managed: unsafe extern "C" fn(*mut u64, usize, c_uint) -> CUresult,
    pub pitch: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> CUresult,
    pub create: unsafe extern "C" fn(*mut u64, usize, *const Prop, u64) -> CUresult,
    pub release: unsafe extern "C" fn(u64) -> CUresult,
    pub get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    pub total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CUresult,
    pub retain: unsafe extern "C" fn(*mut Ctx, c_int) -> CUresult,
    pub set_current: unsafe extern "C" fn(Ctx) -> CUresult,
    pub ctx_create: unsafe extern "C" fn(*mut Ctx, c_uint, c_int) -> CUresult,
    pub ctx_destroy: unsafe extern "C" fn(Ctx) -> CUresult,
    pub primary_release: unsafe extern "C" fn(c_int) -> CUresult,
    pub primary_reset: unsafe extern "C" fn(c_int) -> CUresult,
    pub reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> CUresult,
    pub address_free: unsafe extern "C" fn(u64, usize) -> CUresult,
    pub map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> CUresult,
    pub unmap: unsafe extern "C" fn(u64, usize) -> CUresult,
    pub set_access: unsafe extern "C" fn(u64, usize, *const AccessDesc, usize) -> CUresult,
    pub retain_handle: unsafe extern "C" fn(*mut u64, *mut c_void) -> CUresult,
    pub export: unsafe extern "C" fn(*mut c_void, u64, c_int, u64) -> CUresult,
    pub import: unsafe extern "C" fn(*mut u64, *mut c_void, c_int) -> CUresult,
    pub array_create: unsafe extern "C" fn(*mut *mut c_void, *const ArrayDesc) -> CUresult,
    pub array3d_create: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc) -> CUresult,
    pub mipmap_create:
        unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc, c_uint) -> CUresult,
    pub array_destroy: unsafe extern "C" fn(*mut c_void) -> CUresult,
    pub mipmap_destroy: unsafe extern "C" fn(*mut c_void) -> CUresult,
    pub default_pool: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CUresult,
    pub pool_create: unsafe extern "C" fn(*mut *mut c_void, *const PoolProps) -> CUresult,
    /// CUDA 13's `cuMemGetDefaultMemPool` and `cuMemGetMemPool`, if the
    /// driver has them.
    pub location_pool: Option<LocationPoolFn>,
    pub current_pool: Option<LocationPoolFn>,
    pub stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CUresult,
    pub set_limit: unsafe extern "C" fn(c_int, usize) -> CUresult,
    pub get_limit: unsafe extern "C" fn(*mut usize, c_int) -> CUresult,
    pub launch: LaunchFn,
    /// The 32-bit-era (CUDA 2.0 ABI) `cuMemAlloc`, `cuMemAllocPitch` and
    /// `cuMemFree`: by those names, or asked for as CUDA 2.0; `None` where
    /// the driver has none.
    pub alloc_v1: Option<unsafe extern "C" fn(*mut c_uint, c_uint) -> CUresult>,
    pub pitch_v1: Option<PitchV1Fn>,
    pub free_v1: Option<unsafe extern "C" fn(c_uint) -> CUresult>,
}

pub type PitchV1Fn =
    unsafe extern "C" fn(*mut c_uint, *mut c_uint, c_uint, c_uint, c_uint) -> CUresult;

/// The CUDA version before 3.2's 64-bit device pointers.
const LEGACY_VERSION: c_int = 2000;

pub type LaunchFn = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;

#[repr(C)]
pub struct Location {
    pub location_type: c_int,
    pub id: c_int,
}

pub type LocationPoolFn =
    unsafe extern "C" fn(*mut *mut c_void, *const Location, c_int) -> CUresult;

pub fn open(name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap_or_else(|_| fail("NUL in library name"));
    // SAFETY: valid C string.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a C string after a failed dlopen.
        let why = unsafe { CStr::from_ptr(libc::dlerror()) };
        fail(&format!("dlopen {name}: {}", why.to_string_lossy()));
    }
    handle
}

pub fn sym(handle: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap_or_else(|_| fail("NUL in symbol name"));
    // SAFETY: valid handle and C string; goes through whatever dlsym is bound.
    let f = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if f.is_null() {
        fail(&format!("dlsym {name} not found"));
    }
    f
}

/// # Safety
/// `F` must be the function type of the symbol at `p`.
pub unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    // SAFETY: the caller names the function type of the symbol.
    unsafe { std::mem::transmute_copy(&p) }
}

type Gpa5 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
type Gpa4 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;

enum Resolver {
    Dlsym(*mut c_void),
    Gpa5(Gpa5, u64),
    Gpa4(Gpa4, u64),
}

/// The CUDA version the probe's lookups through cuGetProcAddress name, as
/// a CUDA 12.8 runtime does.
const RUNTIME_VERSION: c_int = 12080;

impl Resolver {
    /// `base` is the cuGetProcAddress name, `exported` the exact symbol.
    fn get(&self, base: &str, exported: &str) -> *mut c_void {
        self.find(base, exported, RUNTIME_VERSION)
            .unwrap_or_else(|why| fail(&why))
    }

    /// A function the driver may lack, looked up as a runtime of CUDA
    /// `version` would; null where the driver has none.
    fn optional(&self, base: &str, exported: &str, version: c_int) -> *mut c_void {
        self.find(base, exported, version)
            .unwrap_or(std::ptr::null_mut())
    }

    fn find(&self, base: &str, exported: &str, version: c_int) -> Result<*mut c_void, String> {
        match self {
            Resolver::Dlsym(h) => {
                let c = CString::new(exported).map_err(|_| "NUL in symbol name")?;
                // SAFETY: valid handle and C string; goes through whatever dlsym is bound.
                let f = unsafe { libc::dlsym(*h, c.as_ptr()) };
                (!f.is_null())
                    .then_some(f)
                    .ok_or_else(|| format!("dlsym {exported} not found"))
            }
            Resolver::Gpa5(gpa, flags) => {
                let c = CString::new(base).map_err(|_| "NUL in symbol name")?;
                let mut f = std::ptr::null_mut();
                let mut status = -1;
                // SAFETY: cuGetProcAddress_v2 contract.
                let r = unsafe { gpa(c.as_ptr(), &mut f, version, *flags, &mut status) };
                if r != 0 || f.is_null() || status != 0 {
                    return Err(format!("cuGetProcAddress_v2 {base}: {r} status {status}"));
                }
                Ok(f)
            }
            Resolver::Gpa4(gpa, flags) => {
                let c = CString::new(base).map_err(|_| "NUL in symbol name")?;
                let mut f = std::ptr::null_mut();
                // SAFETY: cuGetProcAddress contract; the 4-argument form is
                // the CUDA 11 runtime's, which asks as 11.8.
                let r = unsafe { gpa(c.as_ptr(), &mut f, version.min(11080), *flags) };
                if r != 0 || f.is_null() {
                    return Err(format!("cuGetProcAddress {base}: {r}"));
                }
                Ok(f)
            }
        }
    }
}

pub fn load(via: &str, ptsz: bool) -> Api {
    let cuda = open("libcuda.so.1");
    // SAFETY: cuInit(unsigned int)'s signature. The real driver refuses
    // everything before it; its result shows in the context line.
    unsafe {
        let init: unsafe extern "C" fn(c_uint) -> CUresult = cast(sym(cuda, "cuInit"));
        init(0);
    }
    let flags = if ptsz { 2 } else { 0 };
    let resolver = match via {
        "dlsym" => Resolver::Dlsym(cuda),
        // The CUDA 12 runtime: cuGetProcAddress_v2 through dlsym, then the
        // driver's own answer for "cuGetProcAddress", then everything else.
        "gpa" => {
            // SAFETY: cuGetProcAddress_v2's signature.
            let bootstrap: Gpa5 = unsafe { cast(sym(cuda, "cuGetProcAddress_v2")) };
            let first = Resolver::Gpa5(bootstrap, 0);
            // SAFETY: for version 12080 the driver returns the 5-argument form.
            let gpa: Gpa5 = unsafe { cast(first.get("cuGetProcAddress", "cuGetProcAddress_v2")) };
            Resolver::Gpa5(gpa, flags)
        }
        // The CUDA 11.x runtime: the 4-argument cuGetProcAddress.
        "gpa11" => {
            // SAFETY: cuGetProcAddress's signature.
            let bootstrap: Gpa4 = unsafe { cast(sym(cuda, "cuGetProcAddress")) };
            let first = Resolver::Gpa4(bootstrap, 0);
            // SAFETY: for version 11080 the driver returns the 4-argument form.
            let gpa: Gpa4 = unsafe { cast(first.get("cuGetProcAddress", "cuGetProcAddress")) };
            Resolver::Gpa4(gpa, flags)
        }
        other => fail(&format!("unknown --via {other}")),
    };
    let suffix = if ptsz { "_ptsz" } else { "" };
    let get = |base: &str, exported: &str| resolver.get(base, exported);
    // A symbol no version renamed: dlsym finds it under the name asked for.
    let plain = |name: &str| resolver.get(name, name);
    // SAFETY: each symbol is cast to its documented signature.
    unsafe {
        Api {
            mem_alloc: cast(get("cuMemAlloc", "cuMemAlloc_v2")),
            mem_free: cast(get("cuMemFree", "cuMemFree_v2")),
            alloc_async: cast(get("cuMemAllocAsync", &format!("cuMemAllocAsync{suffix}"))),
            alloc_pool: cast(get(
                "cuMemAllocFromPoolAsync",
                &format!("cuMemAllocFromPoolAsync{suffix}"),
            )),
            free_async: cast(get("cuMemFreeAsync", &format!("cuMemFreeAsync{suffix}"))),
            managed: cast(plain("cuMemAllocManaged")),
            pitch: cast(get("cuMemAllocPitch", "cuMemAllocPitch_v2")),
            create: cast(plain("cuMemCreate")),
            release: cast(plain("cuMemRelease")),
            get_info: cast(get("cuMemGetInfo", "cuMemGetInfo_v2")),
            total_mem: cast(get("cuDeviceTotalMem", "cuDeviceTotalMem_v2")),
            retain: cast(plain("cuDevicePrimaryCtxRetain")),
            set_current: cast(sym(cuda, "cuCtxSetCurrent")),
            // By its exact name, as code built against an old cuda.h links it.
            ctx_create: cast(sym(cuda, "cuCtxCreate_v2")),
            ctx_destroy: cast(get("cuCtxDestroy", "cuCtxDestroy_v2")),
            primary_release: cast(get(
                "cuDevicePrimaryCtxRelease",
                "cuDevicePrimaryCtxRelease_v2",
            )),
            primary_reset: cast(get("cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset_v2")),
            reserve: cast(plain("cuMemAddressReserve")),
            address_free: cast(plain("cuMemAddressFree")),
            map: cast(plain("cuMemMap")),
            unmap: cast(plain("cuMemUnmap")),
            set_access: cast(plain("cuMemSetAccess")),
            retain_handle: cast(plain("cuMemRetainAllocationHandle")),
            export: cast(plain("cuMemExportToShareableHandle")),
            import: cast(plain("cuMemImportFromShareableHandle")),
            array_create: cast(get("cuArrayCreate", "cuArrayCreate_v2")),
            array3d_create: cast(get("cuArray3DCreate", "cuArray3DCreate_v2")),
            mipmap_create: cast(plain("cuMipmappedArrayCreate")),
            array_destroy: cast(plain("cuArrayDestroy")),
            mipmap_destroy: cast(plain("cuMipmappedArrayDestroy")),
            default_pool: cast(plain("cuDeviceGetDefaultMemPool")),
            pool_create: cast(plain("cuMemPoolCreate")),
            location_pool: cast(resolver.optional(
                "cuMemGetDefaultMemPool",
                "cuMemGetDefaultMemPool",
                13000,
            )),
            current_pool: cast(resolver.optional("cuMemGetMemPool", "cuMemGetMemPool", 13000)),
            stream_create: cast(plain("cuStreamCreate")),
            set_limit: cast(plain("cuCtxSetLimit")),
            get_limit: cast(plain("cuCtxGetLimit")),
            launch: cast(plain("cuLaunchKernel")),
            alloc_v1: cast(resolver.optional("cuMemAlloc", "cuMemAlloc", LEGACY_VERSION)),
            pitch_v1: cast(resolver.optional("cuMemAllocPitch", "cuMemAllocPitch", LEGACY_VERSION)),
            free_v1: cast(resolver.optional("cuMemFree", "cuMemFree", LEGACY_VERSION)),
        }
    }
}

/// Retains `dev`'s primary context and makes it current, as the runtime does.
pub fn context_on(api: &Api, dev: c_int) -> CUresult {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let r = unsafe { (api.retain)(&mut ctx, dev) };
    if r != 0 {
        return r;
    }
    // SAFETY: ctx came from the driver.
    unsafe { (api.set_current)(ctx) }
}

pub fn context(api: &Api) -> CUresult {
    context_on(api, 0)
}
