//! Every function the shim hooks, spelled once: its exported name, our
//! entry point, and the names `cuGetProcAddress` may be asked for it by.
//! Adding a hook is one line in `hooks!` (plus, for a driver function, its
//! documented version in `documented`).

use std::ffi::CStr;

use crate::hook::Real;
use crate::{array, context, cuda, nvml, pool, procaddr, vmm};

/// `cuGetProcAddress` flag asking for per-thread default stream variants.
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

macro_rules! hooks {
    ($($variant:ident: $name:literal => $entry:path, [$($asked:literal),*];)*) => {
        /// A hooked function variant. Each has exactly one ABI; `_ptsz`
        /// variants are separate entries because the driver gives them
        /// separate entry points.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Hooked {
            $($variant),*
        }

        const COUNT: usize = [$(Hooked::$variant),*].len();

        impl Hooked {
            pub const ALL: [Hooked; COUNT] = [$(Hooked::$variant),*];

            /// The exported symbol name of this exact variant.
            pub fn name(self) -> &'static CStr {
                match self {
                    $(Hooked::$variant => $name),*
                }
            }

            /// Address of our entry point for this variant.
            pub fn hook(self) -> usize {
                match self {
                    $(Hooked::$variant => $entry as *const () as usize),*
                }
            }

            /// Names `cuGetProcAddress` may return this variant for.
            fn asked_as(self) -> &'static [&'static [u8]] {
                match self {
                    $(Hooked::$variant => &[$($asked),*]),*
                }
            }
        }
    };
}

hooks! {
    MemAlloc: c"cuMemAlloc_v2" => cuda::cuMemAlloc_v2, [b"cuMemAlloc", b"cuMemAlloc_v2"];
    MemAllocPitch: c"cuMemAllocPitch_v2" => cuda::cuMemAllocPitch_v2, [b"cuMemAllocPitch", b"cuMemAllocPitch_v2"];
    MemAllocManaged: c"cuMemAllocManaged" => cuda::cuMemAllocManaged, [b"cuMemAllocManaged"];
    MemFree: c"cuMemFree_v2" => cuda::cuMemFree_v2, [b"cuMemFree", b"cuMemFree_v2"];
    MemAllocAsync: c"cuMemAllocAsync" => cuda::cuMemAllocAsync, [b"cuMemAllocAsync"];
    MemAllocAsyncPtsz: c"cuMemAllocAsync_ptsz" => cuda::cuMemAllocAsync_ptsz, [b"cuMemAllocAsync"];
    MemAllocFromPoolAsync: c"cuMemAllocFromPoolAsync" => cuda::cuMemAllocFromPoolAsync, [b"cuMemAllocFromPoolAsync"];
    MemAllocFromPoolAsyncPtsz: c"cuMemAllocFromPoolAsync_ptsz" => cuda::cuMemAllocFromPoolAsync_ptsz, [b"cuMemAllocFromPoolAsync"];
    MemFreeAsync: c"cuMemFreeAsync" => cuda::cuMemFreeAsync, [b"cuMemFreeAsync"];
    MemFreeAsyncPtsz: c"cuMemFreeAsync_ptsz" => cuda::cuMemFreeAsync_ptsz, [b"cuMemFreeAsync"];
    MemCreate: c"cuMemCreate" => vmm::cuMemCreate, [b"cuMemCreate"];
    MemRelease: c"cuMemRelease" => vmm::cuMemRelease, [b"cuMemRelease"];
    MemMap: c"cuMemMap" => vmm::cuMemMap, [b"cuMemMap"];
    MemUnmap: c"cuMemUnmap" => vmm::cuMemUnmap, [b"cuMemUnmap"];
    MemRetainAllocationHandle: c"cuMemRetainAllocationHandle" => vmm::cuMemRetainAllocationHandle, [b"cuMemRetainAllocationHandle"];
    MemImportFromShareableHandle: c"cuMemImportFromShareableHandle" => vmm::cuMemImportFromShareableHandle, [b"cuMemImportFromShareableHandle"];
    ArrayCreate: c"cuArrayCreate_v2" => array::cuArrayCreate_v2, [b"cuArrayCreate", b"cuArrayCreate_v2"];
    Array3DCreate: c"cuArray3DCreate_v2" => array::cuArray3DCreate_v2, [b"cuArray3DCreate", b"cuArray3DCreate_v2"];
    MipmappedArrayCreate: c"cuMipmappedArrayCreate" => array::cuMipmappedArrayCreate, [b"cuMipmappedArrayCreate"];
    ArrayDestroy: c"cuArrayDestroy" => array::cuArrayDestroy, [b"cuArrayDestroy"];
    MipmappedArrayDestroy: c"cuMipmappedArrayDestroy" => array::cuMipmappedArrayDestroy, [b"cuMipmappedArrayDestroy"];
    MemPoolCreate: c"cuMemPoolCreate" => pool::cuMemPoolCreate, [b"cuMemPoolCreate"];
    MemPoolDestroy: c"cuMemPoolDestroy" => pool::cuMemPoolDestroy, [b"cuMemPoolDestroy"];
    DeviceGetDefaultMemPool: c"cuDeviceGetDefaultMemPool" => pool::cuDeviceGetDefaultMemPool, [b"cuDeviceGetDefaultMemPool"];
    DeviceGetMemPool: c"cuDeviceGetMemPool" => pool::cuDeviceGetMemPool, [b"cuDeviceGetMemPool"];
    PrimaryCtxRetain: c"cuDevicePrimaryCtxRetain" => context::cuDevicePrimaryCtxRetain, [b"cuDevicePrimaryCtxRetain"];
    PrimaryCtxRelease: c"cuDevicePrimaryCtxRelease_v2" => context::cuDevicePrimaryCtxRelease_v2, [b"cuDevicePrimaryCtxRelease", b"cuDevicePrimaryCtxRelease_v2"];
    PrimaryCtxReset: c"cuDevicePrimaryCtxReset_v2" => context::cuDevicePrimaryCtxReset_v2, [b"cuDevicePrimaryCtxReset", b"cuDevicePrimaryCtxReset_v2"];
    CtxCreateV2: c"cuCtxCreate_v2" => context::cuCtxCreate_v2, [b"cuCtxCreate"];
    CtxCreateV3: c"cuCtxCreate_v3" => context::cuCtxCreate_v3, [b"cuCtxCreate"];
    CtxCreateV4: c"cuCtxCreate_v4" => context::cuCtxCreate_v4, [b"cuCtxCreate"];
    CtxDestroy: c"cuCtxDestroy_v2" => context::cuCtxDestroy_v2, [b"cuCtxDestroy", b"cuCtxDestroy_v2"];
    MemGetInfo: c"cuMemGetInfo_v2" => cuda::cuMemGetInfo_v2, [b"cuMemGetInfo", b"cuMemGetInfo_v2"];
    DeviceTotalMem: c"cuDeviceTotalMem_v2" => cuda::cuDeviceTotalMem_v2, [b"cuDeviceTotalMem", b"cuDeviceTotalMem_v2"];
    GetProcAddress: c"cuGetProcAddress" => procaddr::cuGetProcAddress, [b"cuGetProcAddress"];
    GetProcAddressV2: c"cuGetProcAddress_v2" => procaddr::cuGetProcAddress_v2, [b"cuGetProcAddress"];
    NvmlMemoryInfo: c"nvmlDeviceGetMemoryInfo" => nvml::nvmlDeviceGetMemoryInfo, [];
    NvmlMemoryInfoV2: c"nvmlDeviceGetMemoryInfo_v2" => nvml::nvmlDeviceGetMemoryInfo_v2, [];
}

static REALS: [Real; COUNT] = [const { Real::new() }; COUNT];

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

    /// Variants `cuGetProcAddress` may return for a requested name.
    pub fn candidates(symbol: &[u8]) -> impl Iterator<Item = Hooked> + '_ {
        Hooked::ALL
            .into_iter()
            .filter(move |h| h.asked_as().contains(&symbol))
    }

    /// The variant CUDA's headers document for `(symbol, cudaVersion,
    /// flags)`, used only when the returned pointer is not one of the
    /// driver's exported entry points. Context creation has no entry: its
    /// ABI changed between versions, so an unidentified pointer is left alone.
    pub fn documented(symbol: &[u8], cuda_version: i32, flags: u64) -> Option<Hooked> {
        let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
        let v2_era = cuda_version >= 3020;
        let stream_ordered = cuda_version >= 11020;
        let vmm = cuda_version >= 10020;
        let stream = |legacy, ptsz| Some(if per_thread { ptsz } else { legacy });
        match symbol {
            b"cuMemAlloc" if v2_era => Some(Hooked::MemAlloc),
            b"cuMemAllocPitch" if v2_era => Some(Hooked::MemAllocPitch),
            b"cuMemFree" if v2_era => Some(Hooked::MemFree),
            b"cuMemGetInfo" if v2_era => Some(Hooked::MemGetInfo),
            b"cuDeviceTotalMem" if v2_era => Some(Hooked::DeviceTotalMem),
            b"cuArrayCreate" if v2_era => Some(Hooked::ArrayCreate),
            b"cuArray3DCreate" if v2_era => Some(Hooked::Array3DCreate),
            b"cuArrayDestroy" => Some(Hooked::ArrayDestroy),
            b"cuMipmappedArrayCreate" if cuda_version >= 5000 => Some(Hooked::MipmappedArrayCreate),
            b"cuMipmappedArrayDestroy" if cuda_version >= 5000 => {
                Some(Hooked::MipmappedArrayDestroy)
            }
            b"cuMemAllocManaged" if cuda_version >= 6000 => Some(Hooked::MemAllocManaged),
            b"cuMemAllocAsync" if stream_ordered => {
                stream(Hooked::MemAllocAsync, Hooked::MemAllocAsyncPtsz)
            }
            b"cuMemAllocFromPoolAsync" if stream_ordered => stream(
                Hooked::MemAllocFromPoolAsync,
                Hooked::MemAllocFromPoolAsyncPtsz,
            ),
            b"cuMemFreeAsync" if stream_ordered => {
                stream(Hooked::MemFreeAsync, Hooked::MemFreeAsyncPtsz)
            }
            b"cuMemPoolCreate" if stream_ordered => Some(Hooked::MemPoolCreate),
            b"cuMemPoolDestroy" if stream_ordered => Some(Hooked::MemPoolDestroy),
            b"cuDeviceGetDefaultMemPool" if stream_ordered => Some(Hooked::DeviceGetDefaultMemPool),
            b"cuDeviceGetMemPool" if stream_ordered => Some(Hooked::DeviceGetMemPool),
            b"cuMemCreate" if vmm => Some(Hooked::MemCreate),
            b"cuMemRelease" if vmm => Some(Hooked::MemRelease),
            b"cuMemMap" if vmm => Some(Hooked::MemMap),
            b"cuMemUnmap" if vmm => Some(Hooked::MemUnmap),
            b"cuMemRetainAllocationHandle" if cuda_version >= 11000 => {
                Some(Hooked::MemRetainAllocationHandle)
            }
            b"cuMemImportFromShareableHandle" if vmm => Some(Hooked::MemImportFromShareableHandle),
            b"cuDevicePrimaryCtxRetain" if cuda_version >= 7000 => Some(Hooked::PrimaryCtxRetain),
            b"cuDevicePrimaryCtxRelease" if cuda_version >= 11000 => {
                Some(Hooked::PrimaryCtxRelease)
            }
            b"cuDevicePrimaryCtxReset" if cuda_version >= 11000 => Some(Hooked::PrimaryCtxReset),
            b"cuCtxDestroy" if cuda_version >= 4000 => Some(Hooked::CtxDestroy),
            b"cuGetProcAddress" if cuda_version >= 12000 => Some(Hooked::GetProcAddressV2),
            b"cuGetProcAddress" if cuda_version >= 11030 => Some(Hooked::GetProcAddress),
            _ => None,
        }
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
            &b"cuMemAlloc"[..],
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
    fn documented_variants_follow_version_and_stream_flag() {
        assert_eq!(
            Hooked::documented(b"cuMemAlloc", 12000, 0),
            Some(Hooked::MemAlloc)
        );
        assert_eq!(
            Hooked::documented(b"cuMemAlloc", 3000, 0),
            None,
            "v1 ABI left alone"
        );
        assert_eq!(
            Hooked::documented(b"cuMemAllocAsync", 12000, 2),
            Some(Hooked::MemAllocAsyncPtsz)
        );
        assert_eq!(
            Hooked::documented(b"cuMemFreeAsync", 12000, 1),
            Some(Hooked::MemFreeAsync)
        );
        assert_eq!(Hooked::documented(b"cuCtxCreate", 12000, 0), None);
        assert_eq!(
            Hooked::documented(b"cuGetProcAddress", 12080, 0),
            Some(Hooked::GetProcAddressV2)
        );
        assert_eq!(
            Hooked::documented(b"cuGetProcAddress", 11080, 0),
            Some(Hooked::GetProcAddress)
        );
        // Every documented answer is one of the names' candidates, and
        // every driver hook but context creation has a documented answer.
        for h in Hooked::ALL {
            for &asked in h.asked_as() {
                if let Some(d) = Hooked::documented(asked, 13000, 0) {
                    assert!(Hooked::candidates(asked).any(|c| c == d), "{asked:?}");
                }
            }
            let creation = matches!(
                h,
                Hooked::CtxCreateV2 | Hooked::CtxCreateV3 | Hooked::CtxCreateV4
            );
            if !h.asked_as().is_empty() && !creation {
                assert!(
                    h.asked_as()
                        .iter()
                        .any(|a| Hooked::documented(a, 13000, 0).is_some()),
                    "{h:?} has no documented variant"
                );
            }
        }
    }
}
