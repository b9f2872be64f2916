//! Every function the shim hooks: its exported name, our entry point, the
//! slot for the real one, and how cuGetProcAddress names map onto them.

use std::ffi::CStr;

use crate::hook::Real;
use crate::{cuda, nvml, procaddr};

/// A hooked function variant. Each has exactly one ABI; `_ptsz` variants
/// are separate entries because the driver gives them separate entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hooked {
    MemAlloc,
    MemAllocPitch,
    MemAllocManaged,
    MemFree,
    MemAllocAsync,
    MemAllocAsyncPtsz,
    MemAllocFromPoolAsync,
    MemAllocFromPoolAsyncPtsz,
    MemFreeAsync,
    MemFreeAsyncPtsz,
    MemCreate,
    MemRelease,
    PrimaryCtxRetain,
    CtxCreateV2,
    CtxCreateV3,
    CtxCreateV4,
    MemGetInfo,
    DeviceTotalMem,
    GetProcAddress,
    GetProcAddressV2,
    NvmlMemoryInfo,
    NvmlMemoryInfoV2,
}

const COUNT: usize = Hooked::NvmlMemoryInfoV2 as usize + 1;
static REALS: [Real; COUNT] = [const { Real::new() }; COUNT];

/// `cuGetProcAddress` flag asking for per-thread default stream variants.
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

impl Hooked {
    pub const ALL: [Hooked; COUNT] = [
        Hooked::MemAlloc,
        Hooked::MemAllocPitch,
        Hooked::MemAllocManaged,
        Hooked::MemFree,
        Hooked::MemAllocAsync,
        Hooked::MemAllocAsyncPtsz,
        Hooked::MemAllocFromPoolAsync,
        Hooked::MemAllocFromPoolAsyncPtsz,
        Hooked::MemFreeAsync,
        Hooked::MemFreeAsyncPtsz,
        Hooked::MemCreate,
        Hooked::MemRelease,
        Hooked::PrimaryCtxRetain,
        Hooked::CtxCreateV2,
        Hooked::CtxCreateV3,
        Hooked::CtxCreateV4,
        Hooked::MemGetInfo,
        Hooked::DeviceTotalMem,
        Hooked::GetProcAddress,
        Hooked::GetProcAddressV2,
        Hooked::NvmlMemoryInfo,
        Hooked::NvmlMemoryInfoV2,
    ];

    /// The exported symbol name of this exact variant.
    pub fn name(self) -> &'static CStr {
        match self {
            Hooked::MemAlloc => c"cuMemAlloc_v2",
            Hooked::MemAllocPitch => c"cuMemAllocPitch_v2",
            Hooked::MemAllocManaged => c"cuMemAllocManaged",
            Hooked::MemFree => c"cuMemFree_v2",
            Hooked::MemAllocAsync => c"cuMemAllocAsync",
            Hooked::MemAllocAsyncPtsz => c"cuMemAllocAsync_ptsz",
            Hooked::MemAllocFromPoolAsync => c"cuMemAllocFromPoolAsync",
            Hooked::MemAllocFromPoolAsyncPtsz => c"cuMemAllocFromPoolAsync_ptsz",
            Hooked::MemFreeAsync => c"cuMemFreeAsync",
            Hooked::MemFreeAsyncPtsz => c"cuMemFreeAsync_ptsz",
            Hooked::MemCreate => c"cuMemCreate",
            Hooked::MemRelease => c"cuMemRelease",
            Hooked::PrimaryCtxRetain => c"cuDevicePrimaryCtxRetain",
            Hooked::CtxCreateV2 => c"cuCtxCreate_v2",
            Hooked::CtxCreateV3 => c"cuCtxCreate_v3",
            Hooked::CtxCreateV4 => c"cuCtxCreate_v4",
            Hooked::MemGetInfo => c"cuMemGetInfo_v2",
            Hooked::DeviceTotalMem => c"cuDeviceTotalMem_v2",
            Hooked::GetProcAddress => c"cuGetProcAddress",
            Hooked::GetProcAddressV2 => c"cuGetProcAddress_v2",
            Hooked::NvmlMemoryInfo => c"nvmlDeviceGetMemoryInfo",
            Hooked::NvmlMemoryInfoV2 => c"nvmlDeviceGetMemoryInfo_v2",
        }
    }

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

    /// Address of our entry point for this variant.
    pub fn hook(self) -> usize {
        match self {
            Hooked::MemAlloc => cuda::cuMemAlloc_v2 as *const () as usize,
            Hooked::MemAllocPitch => cuda::cuMemAllocPitch_v2 as *const () as usize,
            Hooked::MemAllocManaged => cuda::cuMemAllocManaged as *const () as usize,
            Hooked::MemFree => cuda::cuMemFree_v2 as *const () as usize,
            Hooked::MemAllocAsync => cuda::cuMemAllocAsync as *const () as usize,
            Hooked::MemAllocAsyncPtsz => cuda::cuMemAllocAsync_ptsz as *const () as usize,
            Hooked::MemAllocFromPoolAsync => cuda::cuMemAllocFromPoolAsync as *const () as usize,
            Hooked::MemAllocFromPoolAsyncPtsz => {
                cuda::cuMemAllocFromPoolAsync_ptsz as *const () as usize
            }
            Hooked::MemFreeAsync => cuda::cuMemFreeAsync as *const () as usize,
            Hooked::MemFreeAsyncPtsz => cuda::cuMemFreeAsync_ptsz as *const () as usize,
            Hooked::MemCreate => cuda::cuMemCreate as *const () as usize,
            Hooked::MemRelease => cuda::cuMemRelease as *const () as usize,
            Hooked::PrimaryCtxRetain => cuda::cuDevicePrimaryCtxRetain as *const () as usize,
            Hooked::CtxCreateV2 => cuda::cuCtxCreate_v2 as *const () as usize,
            Hooked::CtxCreateV3 => cuda::cuCtxCreate_v3 as *const () as usize,
            Hooked::CtxCreateV4 => cuda::cuCtxCreate_v4 as *const () as usize,
            Hooked::MemGetInfo => cuda::cuMemGetInfo_v2 as *const () as usize,
            Hooked::DeviceTotalMem => cuda::cuDeviceTotalMem_v2 as *const () as usize,
            Hooked::GetProcAddress => procaddr::cuGetProcAddress as *const () as usize,
            Hooked::GetProcAddressV2 => procaddr::cuGetProcAddress_v2 as *const () as usize,
            Hooked::NvmlMemoryInfo => nvml::nvmlDeviceGetMemoryInfo as *const () as usize,
            Hooked::NvmlMemoryInfoV2 => nvml::nvmlDeviceGetMemoryInfo_v2 as *const () as usize,
        }
    }

    /// The slot holding the real function of this variant.
    pub fn real(self) -> &'static Real {
        &REALS[self as usize]
    }

    /// Variants `cuGetProcAddress` may return for a requested name.
    pub fn candidates(symbol: &[u8]) -> &'static [Hooked] {
        match symbol {
            b"cuMemAlloc" | b"cuMemAlloc_v2" => &[Hooked::MemAlloc],
            b"cuMemAllocPitch" | b"cuMemAllocPitch_v2" => &[Hooked::MemAllocPitch],
            b"cuMemAllocManaged" => &[Hooked::MemAllocManaged],
            b"cuMemFree" | b"cuMemFree_v2" => &[Hooked::MemFree],
            b"cuMemAllocAsync" => &[Hooked::MemAllocAsync, Hooked::MemAllocAsyncPtsz],
            b"cuMemAllocFromPoolAsync" => &[
                Hooked::MemAllocFromPoolAsync,
                Hooked::MemAllocFromPoolAsyncPtsz,
            ],
            b"cuMemFreeAsync" => &[Hooked::MemFreeAsync, Hooked::MemFreeAsyncPtsz],
            b"cuMemCreate" => &[Hooked::MemCreate],
            b"cuMemRelease" => &[Hooked::MemRelease],
            b"cuDevicePrimaryCtxRetain" => &[Hooked::PrimaryCtxRetain],
            b"cuCtxCreate" => &[
                Hooked::CtxCreateV2,
                Hooked::CtxCreateV3,
                Hooked::CtxCreateV4,
            ],
            b"cuMemGetInfo" | b"cuMemGetInfo_v2" => &[Hooked::MemGetInfo],
            b"cuDeviceTotalMem" | b"cuDeviceTotalMem_v2" => &[Hooked::DeviceTotalMem],
            b"cuGetProcAddress" => &[Hooked::GetProcAddress, Hooked::GetProcAddressV2],
            _ => &[],
        }
    }

    /// The variant CUDA's headers document for `(symbol, cudaVersion,
    /// flags)`, used only when the returned pointer is not one of the
    /// driver's exported entry points. Context creation has no entry: its
    /// ABI changed between versions, so an unidentified pointer is left alone.
    pub fn documented(symbol: &[u8], cuda_version: i32, flags: u64) -> Option<Hooked> {
        let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
        let v2_era = cuda_version >= 3020;
        let stream_ordered = cuda_version >= 11020;
        match symbol {
            b"cuMemAlloc" if v2_era => Some(Hooked::MemAlloc),
            b"cuMemAllocPitch" if v2_era => Some(Hooked::MemAllocPitch),
            b"cuMemFree" if v2_era => Some(Hooked::MemFree),
            b"cuMemGetInfo" if v2_era => Some(Hooked::MemGetInfo),
            b"cuDeviceTotalMem" if v2_era => Some(Hooked::DeviceTotalMem),
            b"cuMemAllocManaged" if cuda_version >= 6000 => Some(Hooked::MemAllocManaged),
            b"cuMemAllocAsync" if stream_ordered => Some(if per_thread {
                Hooked::MemAllocAsyncPtsz
            } else {
                Hooked::MemAllocAsync
            }),
            b"cuMemAllocFromPoolAsync" if stream_ordered => Some(if per_thread {
                Hooked::MemAllocFromPoolAsyncPtsz
            } else {
                Hooked::MemAllocFromPoolAsync
            }),
            b"cuMemFreeAsync" if stream_ordered => Some(if per_thread {
                Hooked::MemFreeAsyncPtsz
            } else {
                Hooked::MemFreeAsync
            }),
            b"cuMemCreate" if cuda_version >= 10020 => Some(Hooked::MemCreate),
            b"cuMemRelease" if cuda_version >= 10020 => Some(Hooked::MemRelease),
            b"cuDevicePrimaryCtxRetain" if cuda_version >= 7000 => Some(Hooked::PrimaryCtxRetain),
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
        for h in Hooked::ALL {
            if let Some(d) = Hooked::documented(h.name().to_bytes(), 13000, 0) {
                assert!(Hooked::candidates(h.name().to_bytes()).contains(&d));
            }
        }
    }
}
