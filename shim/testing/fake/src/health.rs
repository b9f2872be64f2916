//! Health as NVML reports it, from `FAKEGPU_HEALTH_FILE`: XID events through
//! event sets, row remapping and page retirement, and devices that are lost,
//! need a reset or fail. The file is read on every call, so a test edits it
//! while a daemon watches.
//!
//! One statement per line, `UUID WHAT`:
//!
//! - `xid N`: an XID event on that GPU. Each line is delivered once, in file
//!   order, to event sets created before it was added (as NVML delivers only
//!   events that happen after registering), so append lines;
//! - `remap pending`, `remap failure`: what `nvmlDeviceGetFieldValues` reports
//!   for `NVML_FI_DEV_REMAPPED_PENDING` / `_FAILURE`;
//! - `retirement pending`: what `nvmlDeviceGetRetiredPagesPendingStatus` says;
//! - `lost`, `reset-required`: device queries fail with `GPU_IS_LOST` /
//!   `RESET_REQUIRED` (a lost device's UUID does not read either);
//! - `unknown-error [N]`: device queries fail with `UNKNOWN`, the next N times
//!   or (no N) every time;
//! - `xid-events unsupported`: the device's supported event types lack
//!   critical XIDs and registering for them answers `NOT_SUPPORTED`;
//!   `xid-events refused`: they list them, yet registering answers `UNKNOWN`
//!   (after which NVML's set is in an undefined state).
//!
//! Replace the file whole (write another, rename it over) so that no reader
//! sees half a line. `FAKEGPU_MEMORY_REPAIR=retirement` makes the devices
//! pre-Ampere ones, which answer page retirement and not row remapping; by
//! default they remap rows and answer `NOT_SUPPORTED` for page retirement, as
//! A100 and H100 do.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::nvml::{
    device_query, nvml_device, NvmlReturn, NVML_ERROR_UNKNOWN, NVML_GPU_IS_LOST,
    NVML_INVALID_ARGUMENT, NVML_NOT_SUPPORTED, NVML_RESET_REQUIRED, NVML_SUCCESS, NVML_TIMEOUT,
};
use crate::{config, node};

/// `nvmlEventTypeXidCriticalError`.
const XID_CRITICAL_ERROR: c_ulonglong = 0x8;
const FI_REMAPPED_COR: c_uint = 142;
const FI_REMAPPED_UNC: c_uint = 143;
const FI_REMAPPED_PENDING: c_uint = 144;
const FI_REMAPPED_FAILURE: c_uint = 145;
/// `NVML_VALUE_TYPE_UNSIGNED_INT`.
const VALUE_UNSIGNED_INT: c_uint = 1;
/// How often a waiting event set looks at the file again.
const WAIT_STEP: Duration = Duration::from_millis(10);

#[derive(Debug, Default, PartialEq, Eq)]
struct Device {
    remap_pending: bool,
    remap_failure: bool,
    retirement_pending: bool,
    lost: bool,
    reset_required: bool,
    /// `Some(None)`: every query fails; `Some(Some(n))`: the first n do.
    unknown: Option<Option<u64>>,
    xid_events: XidEvents,
}

/// Whether a device takes critical XID events.
#[derive(Debug, Default, PartialEq, Eq)]
enum XidEvents {
    #[default]
    Supported,
    Unsupported,
    Refused,
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Health {
    /// Per device index.
    devices: HashMap<usize, Device>,
    /// (device, XID) in file order.
    xids: Vec<(usize, u64)>,
}

/// Parses the file's text; lines naming no configured GPU, or saying
/// nothing this understands, are skipped.
fn parse(text: &str, uuids: &[String]) -> Health {
    let mut health = Health::default();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(dev) = words
            .first()
            .and_then(|uuid| uuids.iter().position(|u| u == uuid))
        else {
            continue;
        };
        if let ["xid", n] = words[1..] {
            if let Ok(xid) = n.parse() {
                health.xids.push((dev, xid));
            }
            continue;
        }
        let device = health.devices.entry(dev).or_default();
        match words[1..] {
            ["remap", "pending"] => device.remap_pending = true,
            ["remap", "failure"] => device.remap_failure = true,
            ["retirement", "pending"] => device.retirement_pending = true,
            ["lost"] => device.lost = true,
            ["reset-required"] => device.reset_required = true,
            ["unknown-error"] => device.unknown = Some(None),
            ["unknown-error", n] => device.unknown = n.parse().ok().map(Some),
            ["xid-events", "unsupported"] => device.xid_events = XidEvents::Unsupported,
            ["xid-events", "refused"] => device.xid_events = XidEvents::Refused,
            _ => {}
        }
    }
    health
}

fn read() -> Health {
    let Some(path) = std::env::var_os("FAKEGPU_HEALTH_FILE") else {
        return Health::default();
    };
    parse(
        &std::fs::read_to_string(path).unwrap_or_default(),
        &config().uuids,
    )
}

fn row_remapping() -> bool {
    static REMAP: OnceLock<bool> = OnceLock::new();
    *REMAP
        .get_or_init(|| std::env::var("FAKEGPU_MEMORY_REPAIR").map_or(true, |v| v != "retirement"))
}

/// Whether the file says `dev` is lost: then even its UUID does not read,
/// as NVML documents for a GPU that fell off the bus.
pub(crate) fn lost(dev: usize) -> bool {
    read().devices.get(&dev).is_some_and(|d| d.lost)
}

/// How a query about `dev` fails, if the file says it does. Each `UNKNOWN`
/// answer spends one of a counted `unknown-error`'s failures.
pub(crate) fn query_error(dev: usize) -> Option<NvmlReturn> {
    static UNKNOWN_ANSWERS: Mutex<[u64; node::MAX_DEVICES]> = Mutex::new([0; node::MAX_DEVICES]);
    let health = read();
    let device = health.devices.get(&dev)?;
    if device.lost {
        return Some(NVML_GPU_IS_LOST);
    }
    if device.reset_required {
        return Some(NVML_RESET_REQUIRED);
    }
    let limit = device.unknown?;
    let mut answered = UNKNOWN_ANSWERS.lock().unwrap_or_else(|e| e.into_inner());
    if limit.is_some_and(|n| answered[dev] >= n) {
        return None;
    }
    answered[dev] += 1;
    Some(NVML_ERROR_UNKNOWN)
}

#[repr(C)]
pub struct NvmlFieldValue {
    field_id: c_uint,
    scope_id: c_uint,
    timestamp: i64,
    latency_usec: i64,
    value_type: c_uint,
    nvml_return: NvmlReturn,
    /// `nvmlValue_t`, a union of at most eight bytes.
    value: u64,
}

/// The row remapper's fields on Ampere and newer; every other field, and
/// these on a pre-Ampere device, is `NOT_SUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    handle: *mut c_void,
    count: c_int,
    values: *mut NvmlFieldValue,
) -> NvmlReturn {
    let Some(dev) = nvml_device(handle) else {
        return NVML_INVALID_ARGUMENT;
    };
    let Ok(count) = usize::try_from(count) else {
        return NVML_INVALID_ARGUMENT;
    };
    if values.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    if let Some(error) = query_error(dev) {
        return error;
    }
    let health = read();
    let device = health.devices.get(&dev);
    let flag = |f: fn(&Device) -> bool| u64::from(device.is_some_and(f));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    for i in 0..count {
        // SAFETY: the caller passes `count` field values at `values` (NVML's contract).
        let value = unsafe { &mut *values.add(i) };
        let answer = match value.field_id {
            FI_REMAPPED_COR | FI_REMAPPED_UNC if row_remapping() => Some(0),
            FI_REMAPPED_PENDING if row_remapping() => Some(flag(|d| d.remap_pending)),
            FI_REMAPPED_FAILURE if row_remapping() => Some(flag(|d| d.remap_failure)),
            _ => None,
        };
        value.timestamp = now;
        value.latency_usec = 0;
        match answer {
            Some(v) => {
                value.value_type = VALUE_UNSIGNED_INT;
                value.nvml_return = NVML_SUCCESS;
                value.value = v;
            }
            None => value.nvml_return = NVML_NOT_SUPPORTED,
        }
    }
    NVML_SUCCESS
}

/// `NOT_SUPPORTED` on devices that remap rows instead, as on A100 and H100.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    handle: *mut c_void,
    pending: *mut c_uint,
) -> NvmlReturn {
    let dev = match device_query(handle, pending) {
        Ok(dev) => dev,
        Err(error) => return error,
    };
    if row_remapping() {
        return NVML_NOT_SUPPORTED;
    }
    let flag = read()
        .devices
        .get(&dev)
        .is_some_and(|d| d.retirement_pending);
    // SAFETY: checked non-null; the caller's out parameter.
    unsafe { *pending = c_uint::from(flag) };
    NVML_SUCCESS
}

struct EventSet {
    /// Devices registered for critical XID events, by index.
    devices: [bool; node::MAX_DEVICES],
    /// XID lines of the file already seen (delivered or not for us).
    seen: usize,
}

#[repr(C)]
pub struct NvmlEventData {
    device: *mut c_void,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// # Safety
/// `set` is one this library created and has not freed.
unsafe fn event_set<'a>(set: *mut c_void) -> Option<&'a Mutex<EventSet>> {
    // SAFETY: null or a live set from `nvmlEventSetCreate` (the caller's promise).
    unsafe { set.cast::<Mutex<EventSet>>().as_ref() }
}

/// Lines already in the file are history: the set sees only later ones.
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut *mut c_void) -> NvmlReturn {
    if set.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    let created = Box::new(Mutex::new(EventSet {
        devices: [false; node::MAX_DEVICES],
        seen: read().xids.len(),
    }));
    // SAFETY: checked non-null; the caller's out parameter.
    unsafe { *set = Box::into_raw(created).cast() };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    handle: *mut c_void,
    types: c_ulonglong,
    set: *mut c_void,
) -> NvmlReturn {
    // SAFETY: `set` is the caller's, from `nvmlEventSetCreate`.
    let (Some(dev), Some(set)) = (nvml_device(handle), unsafe { event_set(set) }) else {
        return NVML_INVALID_ARGUMENT;
    };
    if types & XID_CRITICAL_ERROR != 0 {
        match read().devices.get(&dev).map(|d| &d.xid_events) {
            Some(XidEvents::Unsupported) => return NVML_NOT_SUPPORTED,
            Some(XidEvents::Refused) => return NVML_ERROR_UNKNOWN,
            _ => {}
        }
        set.lock().unwrap_or_else(|e| e.into_inner()).devices[dev] = true;
    }
    NVML_SUCCESS
}

/// Critical XIDs and the other types every GPU since Fermi reports, less
/// XIDs where the file says so.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    handle: *mut c_void,
    types: *mut c_ulonglong,
) -> NvmlReturn {
    /// `nvmlEventTypeSingleBitEccError | DoubleBitEccError | PState | Clock`.
    const OTHER_TYPES: c_ulonglong = 0x1 | 0x2 | 0x4 | 0x10;
    let dev = match device_query(handle, types) {
        Ok(dev) => dev,
        Err(error) => return error,
    };
    let unsupported = read()
        .devices
        .get(&dev)
        .is_some_and(|d| d.xid_events == XidEvents::Unsupported);
    let xids = if unsupported { 0 } else { XID_CRITICAL_ERROR };
    // SAFETY: checked non-null; the caller's out parameter.
    unsafe { *types = OTHER_TYPES | xids };
    NVML_SUCCESS
}

/// The next XID line for a registered device, waiting up to `timeout_ms`.
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: *mut c_void,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    // SAFETY: `set` is the caller's, from `nvmlEventSetCreate`.
    let Some(set) = (unsafe { event_set(set) }) else {
        return NVML_INVALID_ARGUMENT;
    };
    if data.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
    loop {
        let xids = read().xids;
        {
            let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
            while let Some(&(dev, xid)) = xids.get(set.seen) {
                set.seen += 1;
                if set.devices[dev] {
                    // SAFETY: checked non-null; the caller's out parameter.
                    unsafe {
                        data.write(NvmlEventData {
                            device: crate::nvml::handle_of(dev),
                            event_type: XID_CRITICAL_ERROR,
                            event_data: xid,
                            gpu_instance_id: u32::MAX,
                            compute_instance_id: u32::MAX,
                        })
                    };
                    return NVML_SUCCESS;
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return NVML_TIMEOUT;
        }
        std::thread::sleep(WAIT_STEP.min(deadline - now));
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetFree(set: *mut c_void) -> NvmlReturn {
    if set.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    // SAFETY: made by `Box::into_raw` in `nvmlEventSetCreate`; freed once (NVML's contract).
    drop(unsafe { Box::from_raw(set.cast::<Mutex<EventSet>>()) });
    NVML_SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_says_what_each_gpu_reports() {
        let uuids = ["GPU-a".to_owned(), "GPU-b".to_owned()];
        let health = parse(
            "GPU-a xid 48\nGPU-b remap pending\nGPU-c xid 79\n\nGPU-a unknown-error 2\n\
             GPU-b xid 94\nGPU-b lost\nGPU-a xid x\nGPU-a remap\nGPU-b xid-events refused\n",
            &uuids,
        );
        assert_eq!(health.xids, [(0, 48), (1, 94)]);
        let b = &health.devices[&1];
        assert!(b.remap_pending && b.lost && !b.remap_failure);
        assert_eq!(b.xid_events, XidEvents::Refused);
        assert_eq!(health.devices[&0].xid_events, XidEvents::Supported);
        assert_eq!(health.devices[&0].unknown, Some(Some(2)));
        assert_eq!(
            parse("GPU-a unknown-error", &uuids).devices[&0].unknown,
            Some(None)
        );
    }
}
