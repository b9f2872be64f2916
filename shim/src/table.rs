//! Every function the shim hooks, spelled once: adding a hook is its entry
//! point (written with `hook::real!`) and one line in `hooks!`.
//!
//! A line names the entry point; the variant, the exported symbol and the
//! name `cuGetProcAddress` is asked for all follow from it. `since V` is
//! the CUDA version from which CUDA's headers map that name to this
//! variant, used only when the driver answers with a pointer that is none
//! of its exports. A driver function without `since` is never guessed
//! (context creation: its ABI changed between versions).

use std::ffi::CStr;

use crate::hook::Real;
use crate::{array, context, cuda, nvml, pool, procaddr, vmm};

/// `cuGetProcAddress` flag asking for per-thread default stream variants.
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

macro_rules! hooks {
    ($($module:ident::$entry:ident $(since $since:literal)?;)*) => {
        /// A hooked function variant, named after its exported symbol. Each
        /// has exactly one ABI; `_ptsz` variants are separate entries
        /// because the driver gives them separate entry points.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Hooked {
            $($entry),*
        }

        const COUNT: usize = [$(Hooked::$entry),*].len();

        impl Hooked {
            pub const ALL: [Hooked; COUNT] = [$(Hooked::$entry),*];

            /// The exported symbol name of this exact variant.
            pub fn name(self) -> &'static CStr {
                match self {
                    $(Hooked::$entry => const { c_name(concat!(stringify!($entry), "\0")) }),*
                }
            }

            /// Address of our entry point for this variant.
            pub fn hook(self) -> usize {
                match self {
                    $(Hooked::$entry => $module::$entry as *const () as usize),*
                }
            }

            /// The CUDA version from which `cuGetProcAddress` documents
            /// this variant for its base name.
            fn since(self) -> Option<i32> {
                match self {
                    $(Hooked::$entry => None$(.or(Some($since)))?),*
                }
            }
        }
    };
}

hooks! {
    cuda::cuMemAlloc since 0;
    cuda::cuMemAlloc_v2 since 3020;
    cuda::cuMemAllocPitch since 0;
    cuda::cuMemAllocPitch_v2 since 3020;
    cuda::cuMemAllocManaged since 6000;
    cuda::cuMemFree since 0;
    cuda::cuMemFree_v2 since 3020;
    cuda::cuMemAllocAsync since 11020;
    cuda::cuMemAllocAsync_ptsz since 11020;
    cuda::cuMemAllocFromPoolAsync since 11020;
    cuda::cuMemAllocFromPoolAsync_ptsz since 11020;
    cuda::cuMemFreeAsync since 11020;
    cuda::cuMemFreeAsync_ptsz since 11020;
    cuda::cuMemGetInfo_v2 since 3020;
    cuda::cuDeviceTotalMem_v2 since 3020;
    vmm::cuMemCreate since 10020;
    vmm::cuMemRelease since 10020;
    vmm::cuMemMap since 10020;
    vmm::cuMemUnmap since 10020;
    vmm::cuMemRetainAllocationHandle since 11000;
    vmm::cuMemImportFromShareableHandle since 10020;
    array::cuArrayCreate_v2 since 3020;
    array::cuArray3DCreate_v2 since 3020;
    array::cuMipmappedArrayCreate since 5000;
    array::cuArrayDestroy since 0;
    array::cuMipmappedArrayDestroy since 5000;
    pool::cuMemPoolCreate since 11020;
    pool::cuMemPoolDestroy since 11020;
    pool::cuDeviceGetDefaultMemPool since 11020;
    pool::cuDeviceGetMemPool since 11020;
    pool::cuMemGetDefaultMemPool since 13000;
    pool::cuMemGetMemPool since 13000;
    context::cuDevicePrimaryCtxRetain since 7000;
    context::cuDevicePrimaryCtxRelease_v2 since 11000;
    context::cuDevicePrimaryCtxReset_v2 since 11000;
    context::cuCtxCreate_v2;
    context::cuCtxCreate_v3;
    context::cuCtxCreate_v4;
    context::cuCtxDestroy_v2 since 4000;
    context::cuCtxSetLimit since 3010;
    procaddr::cuGetProcAddress since 11030;
    procaddr::cuGetProcAddress_v2 since 12000;
    nvml::nvmlDeviceGetMemoryInfo;
    nvml::nvmlDeviceGetMemoryInfo_v2;
}

static REALS: [Real; COUNT] = [const { Real::new() }; COUNT];

/// A symbol name as a C string, checked when the table is compiled.
const fn c_name(with_nul: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(with_nul.as_bytes()) {
        Ok(name) => name,
        Err(_) => panic!("a hook's name is a C identifier"),
    }
}

/// A driver symbol without its ABI suffix (`_v2`, `_ptsz`): the base name
/// `cuGetProcAddress` is asked for, as CUDA spells it ("for the driver API
/// cuMemAlloc_v2, symbol would be cuMemAlloc").
fn base_name(name: &[u8]) -> &[u8] {
    let name = name.strip_suffix(b"_ptsz").unwrap_or(name);
    let digits = name.iter().rev().take_while(|b| b.is_ascii_digit()).count();
    match name[..name.len() - digits].strip_suffix(b"_v") {
        Some(base) if digits > 0 => base,
        _ => name,
    }
}

impl Hooked {
    /// Exact-name lookup for `dlsym` (no prefix matching: `curl_*` and
    /// friends must never be touched).
    pub fn from_name(name: &[u8]) -> Option<Hooked> {
        // Cheap reject for the vast majority of dlsym calls.
        if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
            return None;
        }
        Hooked::ALL
            .into_iter()
            .find(|h| h.name().to_bytes() == name)
    }

    /// The slot holding the real function of this variant.
    pub fn real(self) -> &'static Real {
        &REALS[self as usize]
    }

    /// The real function of this variant, found after this library if no
    /// path has supplied it yet; 0 when there is none.
    pub fn address(self) -> usize {
        self.real().get_or_next(self.name())
    }

    /// The name `cuGetProcAddress` is asked for this variant by; `None`
    /// for NVML, which the driver does not hand out.
    fn base(self) -> Option<&'static [u8]> {
        let name = self.name().to_bytes();
        (name.starts_with(b"cu")).then(|| base_name(name))
    }

    /// Whether this is the per-thread default stream (`_ptsz`) variant.
    fn per_thread(self) -> bool {
        self.name().to_bytes().ends_with(b"_ptsz")
    }

    /// Variants `cuGetProcAddress` may return for a requested name: those
    /// of that base name, or the one of that exact name.
    pub fn candidates(symbol: &[u8]) -> impl Iterator<Item = Hooked> + '_ {
        Hooked::ALL.into_iter().filter(move |h| {
            h.base()
                .is_some_and(|base| base == symbol || h.name().to_bytes() == symbol)
        })
    }

    /// The variant CUDA's headers document for `(symbol, cudaVersion,
    /// flags)`, used only when the returned pointer is not one of the
    /// driver's exported entry points: of the variants of that base name
    /// documented by `cuda_version`, the newest, and the `_ptsz` one when
    /// the flags ask for per-thread default streams.
    pub fn documented(symbol: &[u8], cuda_version: i32, flags: u64) -> Option<Hooked> {
        let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
        Hooked::ALL
            .into_iter()
            .filter(|h| h.base() == Some(symbol))
            .filter(|h| h.since().is_some_and(|since| cuda_version >= since))
            .filter(|h| per_thread || !h.per_thread())
            .max_by_key(|h| (h.per_thread(), h.since()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_exact_and_unique() {
        for h in Hooked::ALL {
            assert_eq!(Hooked::from_name(h.name().to_bytes()), Some(h));
        }
        for other in [
            &b"cuMemAlloc_v1"[..],
            b"cuMemAlloc_v2x",
            b"curl_easy_init",
            b"nvmlInit_v2",
            b"",
        ] {
            assert_eq!(Hooked::from_name(other), None);
        }
        let mut hooks: Vec<_> = Hooked::ALL.iter().map(|h| h.hook()).collect();
        hooks.sort_unstable();
        hooks.dedup();
        assert_eq!(hooks.len(), COUNT, "every variant has its own entry point");
    }

    #[test]
    fn base_names_drop_the_abi_suffix() {
        for (name, base) in [
            (&b"cuMemAlloc_v2"[..], &b"cuMemAlloc"[..]),
            (b"cuMemAllocAsync_ptsz", b"cuMemAllocAsync"),
            (b"cuCtxCreate_v4", b"cuCtxCreate"),
            (b"cuArray3DCreate_v2", b"cuArray3DCreate"),
            (b"cuArray3DCreate", b"cuArray3DCreate"),
            (b"cuMemAllocManaged", b"cuMemAllocManaged"),
            (b"cuFoo_v", b"cuFoo_v"),
        ] {
            assert_eq!(base_name(name), base, "{}", String::from_utf8_lossy(name));
        }
        assert_eq!(Hooked::nvmlDeviceGetMemoryInfo_v2.base(), None);
        assert_eq!(Hooked::candidates(b"nvmlDeviceGetMemoryInfo").count(), 0);
        let creation: Vec<_> = Hooked::candidates(b"cuCtxCreate").collect();
        assert_eq!(
            creation,
            [
                Hooked::cuCtxCreate_v2,
                Hooked::cuCtxCreate_v3,
                Hooked::cuCtxCreate_v4
            ]
        );
        assert_eq!(
            Hooked::candidates(b"cuMemAlloc_v2").collect::<Vec<_>>(),
            [Hooked::cuMemAlloc_v2]
        );
        // The 32-bit-era function keeps the base name as its own.
        assert_eq!(
            Hooked::candidates(b"cuMemAlloc").collect::<Vec<_>>(),
            [Hooked::cuMemAlloc, Hooked::cuMemAlloc_v2]
        );
        assert_eq!(
            Hooked::candidates(b"cuMemFree").collect::<Vec<_>>(),
            [Hooked::cuMemFree, Hooked::cuMemFree_v2]
        );
    }

    #[test]
    fn documented_variants_follow_version_and_stream_flag() {
        assert_eq!(
            Hooked::documented(b"cuMemAlloc", 12000, 0),
            Some(Hooked::cuMemAlloc_v2)
        );
        assert_eq!(
            Hooked::documented(b"cuMemAlloc", 12000, 2),
            Some(Hooked::cuMemAlloc_v2),
            "no _ptsz variant: the flag changes nothing"
        );
        // Before 3.2, the 32-bit-era ABI (PFN_cuMemAlloc_v2000).
        for (symbol, v1) in [
            (&b"cuMemAlloc"[..], Hooked::cuMemAlloc),
            (b"cuMemAllocPitch", Hooked::cuMemAllocPitch),
            (b"cuMemFree", Hooked::cuMemFree),
        ] {
            assert_eq!(Hooked::documented(symbol, 3010, 0), Some(v1));
            assert_eq!(Hooked::documented(symbol, 2000, 2), Some(v1));
            assert_ne!(Hooked::documented(symbol, 3020, 0), Some(v1));
        }
        assert_eq!(
            Hooked::documented(b"cuMemAlloc_v2", 12000, 0),
            None,
            "only base names are documented"
        );
        assert_eq!(
            Hooked::documented(b"cuMemAllocAsync", 12000, 2),
            Some(Hooked::cuMemAllocAsync_ptsz)
        );
        assert_eq!(
            Hooked::documented(b"cuMemFreeAsync", 12000, 1),
            Some(Hooked::cuMemFreeAsync)
        );
        assert_eq!(Hooked::documented(b"cuMemFreeAsync", 11000, 2), None);
        assert_eq!(
            Hooked::documented(b"cuArrayDestroy", 2000, 0),
            Some(Hooked::cuArrayDestroy)
        );
        assert_eq!(Hooked::documented(b"cuCtxCreate", 12000, 0), None);
        assert_eq!(
            Hooked::documented(b"cuGetProcAddress", 12080, 0),
            Some(Hooked::cuGetProcAddress_v2)
        );
        assert_eq!(
            Hooked::documented(b"cuGetProcAddress", 11080, 0),
            Some(Hooked::cuGetProcAddress)
        );
        assert_eq!(
            Hooked::documented(b"nvmlDeviceGetMemoryInfo", 13000, 0),
            None
        );
        // Every driver hook but context creation is documented, and no two
        // variants of one base name are documented alike.
        for h in Hooked::ALL {
            let Some(base) = h.base() else { continue };
            assert_eq!(h.since().is_none(), base == b"cuCtxCreate", "{h:?}");
            for other in Hooked::candidates(base).filter(|&o| o != h) {
                assert!(
                    (h.per_thread(), h.since()) != (other.per_thread(), other.since())
                        || h.since().is_none(),
                    "{h:?} and {other:?} are documented alike"
                );
            }
        }
    }
}
