//! The DRA front end: kubelet's Dynamic Resource Allocation plugin API
//! (`resource.k8s.io/v1`), beside the device plugin. Each GPU is one device
//! whose memory is consumable capacity; the scheduler places each claim, and
//! kubelet asks this driver to prepare it. It shares the node model, the
//! shim, the accounting directories and reconciliation with the device
//! plugin; only the kubelet-facing layer differs. A node runs one front end.

pub mod api;
pub mod checkpoint;
pub mod claims;
pub mod health;
pub mod prepare;
pub mod recovery;
pub mod registration;
pub mod service;
pub mod sharing;
pub mod slice;

/// The driver's default name: in ResourceSlices, DeviceClasses, and the
/// names of kubelet's sockets.
pub const DEFAULT_DRIVER_NAME: &str = "gpumem.io";

/// A driver name as the API server accepts it: a DNS subdomain (lower-case
/// letters, digits, '-' and '.', each label beginning and ending with a
/// letter or digit) of at most 63 characters (`resource.k8s.io/v1`
/// DriverNameMaxLength, as for CSI drivers).
pub fn validate_driver_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 63 {
        return Err("a driver name is 1 to 63 characters long");
    }
    let labels_ok = name.split('.').all(|label| {
        let bytes = label.as_bytes();
        let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
            return false;
        };
        label.len() <= 63
            && first.is_ascii_alphanumeric()
            && last.is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    });
    if !labels_ok {
        return Err(
            "a driver name is a DNS subdomain: lower-case letters, digits, '-' and '.', \
                    each part beginning and ending with a letter or digit (e.g. gpumem.io)",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn driver_names_are_dns_subdomains() {
        let longest = format!("{}.example.com", "a".repeat(51));
        for good in ["gpumem.io", "gpu.example.com", "a", &longest] {
            assert_eq!(super::validate_driver_name(good), Ok(()), "{good}");
        }
        // The API server refuses every ResourceSlice of a longer name.
        let too_long = format!("{}.example.com", "a".repeat(52));
        for bad in [
            &too_long,
            "",
            "GPUmem.io",
            "gpumem..io",
            "-gpumem.io",
            "gpumem.io-",
            "gpu_mem.io",
        ] {
            assert!(super::validate_driver_name(bad).is_err(), "{bad}");
        }
    }
}
