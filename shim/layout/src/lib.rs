//! The per-container accounting file: one source of truth for its layout,
//! compiled into both the plugin (which creates it) and the shim (which maps it).
//!
//! ```text
//! header   64 B   magic, version, lengths, device and slot counts, slot high-water mark
//! devices  64 B × device_count    uuid, cap, context charge, daemon-observed extra, peak, OOMs
//! slots   192 B × slot_count      one per process: state word, pid, start time, used[device]
//! ```
//! Every field is a little-endian integer at a fixed offset; the shim reads
//! and writes the mutable ones as atomics in a shared mapping. Slots are
//! 64-byte aligned so each process writes its own cache lines. The rules
//! both sides follow on them are in [`protocol`].

#![forbid(unsafe_code)]

#[cfg(not(target_endian = "little"))]
compile_error!("the accounting file is little-endian; big-endian hosts are not supported");

pub mod protocol;

/// File name inside the per-container state directory.
pub const FILE_NAME: &str = "accounting";
/// Where the plugin mounts the per-container state directory in containers;
/// a DRA claim's directory is mounted directly inside it, under its own
/// name, and the shim reads the file in each.
pub const CONTAINER_DIR: &str = "/var/run/gpumem";
/// How a DRA claim's directory is named (`claim-<UID>`), on the host and
/// in containers alike.
pub const CLAIM_DIR_PREFIX: &str = "claim-";
/// `GPUMEMv1` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUMEMv1");
pub const VERSION: u32 = 1;

pub const HEADER_LEN: usize = 64;
pub const DEVICE_LEN: usize = 64;
pub const SLOT_LEN: usize = 192;
/// Devices one file can describe (a container normally has one).
pub const MAX_DEVICES: usize = 16;
/// Processes one file can track at once; a full file falls back to a
/// process-local cap in the shim.
pub const DEFAULT_SLOTS: u32 = 256;

/// Header field offsets.
pub mod header {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const HEADER_LEN: usize = 12;
    pub const DEVICE_COUNT: usize = 16;
    pub const SLOT_COUNT: usize = 20;
    /// u32, atomic: one past the highest slot ever claimed.
    pub const SLOT_HWM: usize = 24;
    pub const DEVICE_LEN: usize = 28;
    pub const SLOT_LEN: usize = 32;
}

/// Device record field offsets.
pub mod device {
    /// 16 raw UUID bytes, as `cuDeviceGetUuid` returns them.
    pub const UUID: usize = 0;
    pub const CAP: usize = 16;
    /// Charged once per process and device at the first context.
    pub const CONTEXT_CHARGE: usize = 24;
    /// u64: untracked usage the node daemon observed (contexts, libraries,
    /// pool reserves), folded into every check. Written only by the daemon,
    /// with plain file writes under the `OBSERVED_SEQ` seqlock.
    pub const OBSERVED_EXTRA: usize = 32;
    /// u64, atomic: highest total seen by a successful charge.
    pub const PEAK: usize = 40;
    /// u64, atomic: allocations refused for the cap.
    pub const OOM_COUNT: usize = 48;
    /// u64: odd while the daemon is rewriting `OBSERVED_EXTRA`, so a reader
    /// never takes a half-written value (a file write is not an atomic
    /// store to the shared page).
    pub const OBSERVED_SEQ: usize = 56;
}

/// Slot field offsets.
pub mod slot {
    /// u64, atomic: `generation << 8 | state`.
    pub const STATE: usize = 0;
    pub const PID: usize = 8;
    /// Process start time in clock ticks since boot (/proc/PID/stat field 22).
    pub const START_TIME: usize = 16;
    /// u64 × MAX_DEVICES, atomic, written only by the owner: bytes charged.
    pub const USED: usize = 24;
    /// u64, atomic, written only by the owner: bit `dev` set while it makes
    /// a context on the file's device `dev`, which the driver takes before
    /// the shim can charge it. Zero in files and shims from before it.
    pub const CREATING: usize = 24 + 8 * super::MAX_DEVICES;
}

/// Slot states (low byte of the state word).
pub mod state {
    /// Unused, or being claimed by the holder of its record lock.
    pub const FREE: u64 = 0;
    /// 1 is unused.
    pub const ALIVE: u64 = 2;
    pub const REAPING: u64 = 3;
}

const _: () = assert!(slot::USED + 8 * MAX_DEVICES <= slot::CREATING);
const _: () = assert!(slot::CREATING + 8 <= SLOT_LEN);
const _: () = assert!(device::OBSERVED_SEQ + 8 <= DEVICE_LEN);

/// Offset of device record `index`.
#[inline]
pub fn device_offset(index: usize) -> usize {
    HEADER_LEN + index * DEVICE_LEN
}

/// Offset of the first slot for a file with `devices` device records.
#[inline]
pub fn slots_offset(devices: usize) -> usize {
    (HEADER_LEN + devices * DEVICE_LEN).next_multiple_of(64)
}

/// Offset of slot `index`.
#[inline]
pub fn slot_offset(devices: usize, index: usize) -> usize {
    slots_offset(devices) + index * SLOT_LEN
}

/// Total file length.
pub fn file_len(devices: usize, slots: usize) -> usize {
    slot_offset(devices, slots)
}

/// One capped device, as the plugin writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub uuid: [u8; 16],
    pub cap_bytes: u64,
    pub context_charge_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    TooShort { len: usize, need: usize },
    BadMagic,
    UnsupportedVersion(u32),
    BadGeometry(&'static str),
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutError::TooShort { len, need } => write!(f, "file is {len} bytes, needs {need}"),
            LayoutError::BadMagic => f.write_str("not a gpumem accounting file (bad magic)"),
            LayoutError::UnsupportedVersion(v) => {
                write!(f, "layout version {v}, this build reads {VERSION}")
            }
            LayoutError::BadGeometry(what) => write!(f, "inconsistent header: {what}"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// The fixed part of a validated file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub devices: usize,
    pub slots: usize,
}

impl Geometry {
    pub fn file_len(&self) -> usize {
        file_len(self.devices, self.slots)
    }
}

/// Builds a fresh file: header, device records, all slots free.
pub fn encode(devices: &[DeviceSpec], slots: u32) -> Vec<u8> {
    let mut bytes = vec![0u8; file_len(devices.len(), slots as usize)];
    put_u64(&mut bytes, header::MAGIC, MAGIC);
    put_u32(&mut bytes, header::VERSION, VERSION);
    put_u32(&mut bytes, header::HEADER_LEN, HEADER_LEN as u32);
    put_u32(&mut bytes, header::DEVICE_COUNT, devices.len() as u32);
    put_u32(&mut bytes, header::SLOT_COUNT, slots);
    put_u32(&mut bytes, header::DEVICE_LEN, DEVICE_LEN as u32);
    put_u32(&mut bytes, header::SLOT_LEN, SLOT_LEN as u32);
    for (i, d) in devices.iter().enumerate() {
        let at = device_offset(i);
        bytes[at + device::UUID..at + device::UUID + 16].copy_from_slice(&d.uuid);
        put_u64(&mut bytes, at + device::CAP, d.cap_bytes);
        put_u64(
            &mut bytes,
            at + device::CONTEXT_CHARGE,
            d.context_charge_bytes,
        );
    }
    bytes
}

/// Checks a file's header against its length.
pub fn validate(bytes: &[u8]) -> Result<Geometry, LayoutError> {
    if bytes.len() < HEADER_LEN {
        return Err(LayoutError::TooShort {
            len: bytes.len(),
            need: HEADER_LEN,
        });
    }
    if get_u64(bytes, header::MAGIC) != MAGIC {
        return Err(LayoutError::BadMagic);
    }
    let version = get_u32(bytes, header::VERSION);
    if version != VERSION {
        return Err(LayoutError::UnsupportedVersion(version));
    }
    if get_u32(bytes, header::HEADER_LEN) as usize != HEADER_LEN
        || get_u32(bytes, header::DEVICE_LEN) as usize != DEVICE_LEN
        || get_u32(bytes, header::SLOT_LEN) as usize != SLOT_LEN
    {
        return Err(LayoutError::BadGeometry("record lengths"));
    }
    let devices = get_u32(bytes, header::DEVICE_COUNT) as usize;
    let slots = get_u32(bytes, header::SLOT_COUNT) as usize;
    if devices == 0 || devices > MAX_DEVICES {
        return Err(LayoutError::BadGeometry("device count"));
    }
    if slots == 0 || slots > 1 << 16 {
        return Err(LayoutError::BadGeometry("slot count"));
    }
    let geometry = Geometry { devices, slots };
    let need = geometry.file_len();
    if bytes.len() < need {
        return Err(LayoutError::TooShort {
            len: bytes.len(),
            need,
        });
    }
    Ok(geometry)
}

/// Reads the device records of a validated file.
pub fn devices(bytes: &[u8], geometry: Geometry) -> Vec<DeviceSpec> {
    (0..geometry.devices)
        .map(|i| {
            let at = device_offset(i);
            let mut uuid = [0u8; 16];
            uuid.copy_from_slice(&bytes[at..at + 16]);
            DeviceSpec {
                uuid,
                cap_bytes: get_u64(bytes, at + device::CAP),
                context_charge_bytes: get_u64(bytes, at + device::CONTEXT_CHARGE),
            }
        })
        .collect()
}

/// Parses `GPU-6b1c2d3e-0000-4000-8000-000000000400` (or the bare hex form)
/// into the 16 bytes CUDA reports.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let hex = text.strip_prefix("GPU-").unwrap_or(text);
    let mut out = [0u8; 16];
    let mut digits = hex.bytes().filter(|&b| b != b'-');
    for byte in &mut out {
        let hi = hex_value(digits.next()?)?;
        let lo = hex_value(digits.next()?)?;
        *byte = hi << 4 | lo;
    }
    if digits.next().is_some() || hex.bytes().filter(|&b| b == b'-').count() > 4 {
        return None;
    }
    Some(out)
}

/// The NVML spelling of a UUID: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, b) in uuid.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub fn get_u32(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

pub fn get_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

    #[test]
    fn uuid_round_trips() {
        let raw = parse_uuid(T4).unwrap();
        assert_eq!(raw[0], 0x6b);
        assert_eq!(format_uuid(&raw), T4);
        assert_eq!(parse_uuid("6b1c2d3e000040008000000000000400"), Some(raw));
        for bad in [
            "GPU-",
            "GPU-6b1c2d3e",
            "GPU-zz1c2d3e-0000-4000-8000-000000000400",
            &format!("{T4}00"),
        ] {
            assert_eq!(parse_uuid(bad), None, "{bad}");
        }
    }

    #[test]
    fn encode_then_validate() {
        let spec = DeviceSpec {
            uuid: parse_uuid(T4).unwrap(),
            cap_bytes: 4308 << 20,
            context_charge_bytes: 0,
        };
        let bytes = encode(&[spec], 8);
        assert_eq!(bytes.len() % 64, 0);
        let g = validate(&bytes).unwrap();
        assert_eq!(
            g,
            Geometry {
                devices: 1,
                slots: 8
            }
        );
        assert_eq!(devices(&bytes, g), [spec]);
        let file = protocol::AccountingFile::snapshot(&bytes).unwrap();
        assert_eq!(file.observed_extra(0), 0);
        assert!(file.slots().is_empty());
    }

    #[test]
    fn corrupt_files_are_rejected() {
        let spec = DeviceSpec {
            uuid: [1; 16],
            cap_bytes: 1,
            context_charge_bytes: 0,
        };
        let bytes = encode(&[spec], 4);
        assert!(matches!(
            validate(&bytes[..bytes.len() - 1]),
            Err(LayoutError::TooShort { .. })
        ));
        assert!(matches!(
            validate(&bytes[..10]),
            Err(LayoutError::TooShort { .. })
        ));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert_eq!(validate(&bad), Err(LayoutError::BadMagic));
        let mut bad = bytes.clone();
        put_u32(&mut bad, header::VERSION, 9);
        assert_eq!(validate(&bad), Err(LayoutError::UnsupportedVersion(9)));
        let mut bad = bytes;
        put_u32(&mut bad, header::DEVICE_COUNT, 0);
        assert!(matches!(validate(&bad), Err(LayoutError::BadGeometry(_))));
    }
}
