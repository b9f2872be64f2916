//! Placement: which GPU a container's units come from. Pure functions over
//! the inventory and kubelet's view of free devices; no state of our own.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::node::inventory::{DeviceId, Inventory};

/// How GetPreferredAllocation picks among GPUs that can hold a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// The GPU with the fewest free units that still fits: keeps whole GPUs
    /// free for large requests.
    #[default]
    Binpack,
    /// The GPU with the most free units: spreads load and memory bandwidth.
    Spread,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Binpack => "binpack",
            Policy::Spread => "spread",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown placement policy {0:?}: expected binpack or spread")]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "binpack" => Ok(Policy::Binpack),
            "spread" => Ok(Policy::Spread),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// Why a request cannot be placed. Bad requests and requests that do not
/// fit are told apart so the gRPC layer can pick the status code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("no device IDs in the request")]
    Empty,
    #[error("allocation_size {0} is not a positive number of units")]
    BadSize(i64),
    #[error("unknown device IDs (not advertised by this plugin): {0}")]
    Unknown(IdSample),
    #[error("device IDs listed more than once: {0}")]
    Duplicate(IdSample),
    #[error("device IDs span GPUs ({}); all units of a container must be on one GPU", describe_spread(.0))]
    SpansGpus(Vec<(u32, IdSample)>),
    #[error("{must} must-include device IDs exceed allocation_size {size}")]
    MustIncludeTooMany { must: usize, size: usize },
    #[error("no single GPU has {size} free units (free units per GPU: {})", describe_free(.free))]
    NoSingleGpu {
        size: usize,
        free: Vec<(u32, usize)>,
    },
}

impl PlacementError {
    /// True when the request itself is malformed, as opposed to not fitting.
    pub fn is_bad_request(&self) -> bool {
        !matches!(self, PlacementError::NoSingleGpu { .. })
    }
}

fn describe_spread(groups: &[(u32, IdSample)]) -> String {
    let parts: Vec<_> = groups
        .iter()
        .map(|(index, ids)| format!("GPU{index}: {ids}"))
        .collect();
    parts.join("; ")
}

/// Device IDs a message or log line names before it only counts the rest.
const NAMED_IDS: usize = 5;
/// Characters of one ID shown: ours are 19 at most, kubelet's 63.
const ID_CHARS: usize = 64;

/// The first few of a list of device IDs and how many it holds: what an
/// error or a log line says of a request's IDs. A request may name any
/// number of any length, and a gRPC status travels in an HTTP/2 trailer
/// that holds a few KiB, so naming them all turns InvalidArgument into a
/// protocol error (and writes a log line as long as the request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdSample {
    /// At most [`NAMED_IDS`], each cut to [`ID_CHARS`] characters with
    /// control characters escaped.
    pub named: Vec<String>,
    /// How many the whole list holds.
    pub count: usize,
}

impl IdSample {
    pub fn of<S: AsRef<str>>(ids: impl IntoIterator<Item = S>) -> Self {
        let mut named = Vec::new();
        let mut count = 0;
        for id in ids {
            if named.len() < NAMED_IDS {
                named.push(shown(id.as_ref()));
            }
            count += 1;
        }
        IdSample { named, count }
    }
}

/// `id` as a message shows it: escaped, so it cannot forge a log line,
/// and cut short.
fn shown(id: &str) -> String {
    let mut escaped = id.chars().flat_map(char::escape_debug);
    let mut text: String = escaped.by_ref().take(ID_CHARS).collect();
    if escaped.next().is_some() {
        text.push('…');
    }
    text
}

/// `a, b, c`, or `a, b, c, d, e and 95 more (100 in all)`.
impl fmt::Display for IdSample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.named.join(", "))?;
        let more = self.count.saturating_sub(self.named.len());
        if more > 0 {
            write!(f, " and {more} more ({} in all)", self.count)?;
        }
        Ok(())
    }
}

fn describe_free(free: &[(u32, usize)]) -> String {
    let parts: Vec<_> = free
        .iter()
        .map(|(index, n)| format!("GPU{index} {n}"))
        .collect();
    parts.join(", ")
}

/// A container's units, all on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    /// Position of the GPU in `Inventory::gpus()`.
    pub gpu: usize,
    pub units: u32,
}

/// Resolved IDs grouped by GPU position, each group sorted by unit.
type Groups = BTreeMap<usize, BTreeSet<DeviceId>>;

/// Resolves IDs, rejecting unknown ones; duplicates are rejected when
/// `strict`, merged otherwise (kubelet's sets never repeat, but be lenient
/// where leniency cannot hand out a unit twice).
fn group(inv: &Inventory, ids: &[String], strict: bool) -> Result<Groups, PlacementError> {
    let mut groups = Groups::new();
    let mut unknown = Vec::new();
    let mut duplicate = Vec::new();
    for text in ids {
        match inv.resolve(text) {
            Some((id, gpu)) => {
                if !groups.entry(gpu).or_default().insert(id) && strict {
                    duplicate.push(text.as_str());
                }
            }
            None => unknown.push(text.as_str()),
        }
    }
    if !unknown.is_empty() {
        return Err(PlacementError::Unknown(IdSample::of(unknown)));
    }
    if !duplicate.is_empty() {
        return Err(PlacementError::Duplicate(IdSample::of(duplicate)));
    }
    Ok(groups)
}

fn spans(inv: &Inventory, groups: &Groups) -> PlacementError {
    PlacementError::SpansGpus(
        groups
            .iter()
            .map(|(&gpu, ids)| {
                (
                    inv.gpus()[gpu].gpu.index,
                    IdSample::of(ids.iter().map(ToString::to_string)),
                )
            })
            .collect(),
    )
}

/// Checks an Allocate request: known IDs, no repeats, one GPU.
pub fn assign(inv: &Inventory, ids: &[String]) -> Result<Assignment, PlacementError> {
    if ids.is_empty() {
        return Err(PlacementError::Empty);
    }
    let groups = group(inv, ids, true)?;
    if groups.len() > 1 {
        return Err(spans(inv, &groups));
    }
    let (&gpu, units) = groups.iter().next().ok_or(PlacementError::Empty)?;
    Ok(Assignment {
        gpu,
        units: u32::try_from(units.len()).unwrap_or(u32::MAX),
    })
}

/// Answers GetPreferredAllocation: exactly `size` IDs from `available`, all
/// on one GPU, including every `must_include` ID, on the GPU `policy` picks.
pub fn prefer(
    inv: &Inventory,
    policy: Policy,
    available: &[String],
    must_include: &[String],
    size: i64,
) -> Result<Vec<String>, PlacementError> {
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .ok_or(PlacementError::BadSize(size))?;
    let must = group(inv, must_include, false)?;
    if must.len() > 1 {
        return Err(spans(inv, &must));
    }
    let must_count: usize = must.values().map(BTreeSet::len).sum();
    if must_count > size {
        return Err(PlacementError::MustIncludeTooMany {
            must: must_count,
            size,
        });
    }
    // kubelet puts must-include IDs in `available` too; accept them either way.
    let mut free = group(inv, available, false)?;
    for (&gpu, ids) in &must {
        free.entry(gpu).or_default().extend(ids.iter().copied());
    }

    let fits = |gpu: &usize| free.get(gpu).map_or(0, BTreeSet::len) >= size;
    let chosen = match must.keys().next() {
        Some(gpu) => Some(*gpu).filter(fits),
        None => {
            let candidates = free.keys().copied().filter(fits);
            let key = |&gpu: &usize| (free[&gpu].len(), inv.gpus()[gpu].gpu.index);
            match policy {
                Policy::Binpack => candidates.min_by_key(key),
                Policy::Spread => candidates.min_by_key(|gpu| {
                    (
                        std::cmp::Reverse(free[gpu].len()),
                        inv.gpus()[*gpu].gpu.index,
                    )
                }),
            }
        }
    };
    let Some(gpu) = chosen else {
        let mut per_gpu: Vec<(u32, usize)> = inv
            .gpus()
            .iter()
            .enumerate()
            .map(|(pos, g)| (g.gpu.index, free.get(&pos).map_or(0, BTreeSet::len)))
            .collect();
        per_gpu.sort_unstable();
        return Err(PlacementError::NoSingleGpu {
            size,
            free: per_gpu,
        });
    };

    let must_ids = must.get(&gpu);
    let picked = must_ids
        .into_iter()
        .flatten()
        .chain(
            free[&gpu]
                .iter()
                .filter(|id| !must_ids.is_some_and(|m| m.contains(id))),
        )
        .take(size)
        .map(ToString::to_string)
        .collect();
    Ok(picked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::gpu::Gpu;
    use crate::node::units::MemoryUnit;

    fn v100x2() -> Inventory {
        let gpus = (0..2)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-1a2b3c4d-0000-4000-8000-00000001000{i}"),
                name: "Tesla V100-SXM2-16GB".into(),
                memory_mib: 16160,
                healthy: true,
            })
            .collect();
        Inventory::new(gpus, MemoryUnit::GiB).unwrap()
    }

    fn ids(inv: &Inventory, gpu: usize, units: std::ops::Range<u32>) -> Vec<String> {
        units
            .map(|unit| {
                DeviceId {
                    gpu: inv.gpus()[gpu].key,
                    unit,
                }
                .to_string()
            })
            .collect()
    }

    fn gpu_of(inv: &Inventory, picked: &[String]) -> usize {
        assign(inv, picked).unwrap().gpu
    }

    #[test]
    fn binpack_takes_the_fullest_gpu_that_fits() {
        let inv = v100x2();
        // GPU0 has 5 free, GPU1 has 15 free.
        let available = [ids(&inv, 0, 10..15), ids(&inv, 1, 0..15)].concat();
        let picked = prefer(&inv, Policy::Binpack, &available, &[], 4).unwrap();
        assert_eq!(picked.len(), 4);
        assert_eq!(gpu_of(&inv, &picked), 0);
        // 6 units no longer fit GPU0.
        let picked = prefer(&inv, Policy::Binpack, &available, &[], 6).unwrap();
        assert_eq!(gpu_of(&inv, &picked), 1);
    }

    #[test]
    fn spread_takes_the_emptiest_gpu() {
        let inv = v100x2();
        let available = [ids(&inv, 0, 10..15), ids(&inv, 1, 0..15)].concat();
        let picked = prefer(&inv, Policy::Spread, &available, &[], 4).unwrap();
        assert_eq!(gpu_of(&inv, &picked), 1);
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        let inv = v100x2();
        let available = [ids(&inv, 0, 0..15), ids(&inv, 1, 0..15)].concat();
        for policy in [Policy::Binpack, Policy::Spread] {
            let picked = prefer(&inv, policy, &available, &[], 3).unwrap();
            assert_eq!(gpu_of(&inv, &picked), 0);
        }
    }

    #[test]
    fn picks_only_available_ids_and_honours_must_include() {
        let inv = v100x2();
        let available = [ids(&inv, 0, 3..9), ids(&inv, 1, 0..15)].concat();
        let must = ids(&inv, 0, 7..8);
        let picked = prefer(&inv, Policy::Spread, &available, &must, 4).unwrap();
        assert_eq!(picked.len(), 4);
        assert!(picked.contains(&must[0]));
        assert!(picked.iter().all(|id| available.contains(id)));
        assert_eq!(gpu_of(&inv, &picked), 0);
    }

    #[test]
    fn no_single_gpu_lists_free_units_per_gpu() {
        let inv = v100x2();
        let available = [ids(&inv, 0, 0..3), ids(&inv, 1, 0..2)].concat();
        let err = prefer(&inv, Policy::Binpack, &available, &[], 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no single GPU has 4 free units (free units per GPU: GPU0 3, GPU1 2)"
        );
        assert!(!err.is_bad_request());
    }

    #[test]
    fn malformed_preference_requests_are_rejected() {
        let inv = v100x2();
        let available = ids(&inv, 0, 0..15);
        assert_eq!(
            prefer(&inv, Policy::Binpack, &available, &[], 0),
            Err(PlacementError::BadSize(0))
        );
        assert!(matches!(
            prefer(&inv, Policy::Binpack, &["nope".into()], &[], 1),
            Err(PlacementError::Unknown(u)) if u.named == ["nope"] && u.count == 1
        ));
        let must = [ids(&inv, 0, 0..1), ids(&inv, 1, 0..1)].concat();
        assert!(matches!(
            prefer(&inv, Policy::Binpack, &available, &must, 2),
            Err(PlacementError::SpansGpus(_))
        ));
        assert!(matches!(
            prefer(&inv, Policy::Binpack, &available, &ids(&inv, 0, 0..3), 2),
            Err(PlacementError::MustIncludeTooMany { must: 3, size: 2 })
        ));
    }

    #[test]
    fn id_samples_name_a_few_ids_cut_short_and_count_them_all() {
        let few = IdSample::of(["a", "b"]);
        assert_eq!(few.to_string(), "a, b");
        let many: Vec<String> = (0..100).map(|i| format!("id-{i}")).collect();
        assert_eq!(
            IdSample::of(&many).to_string(),
            "id-0, id-1, id-2, id-3, id-4 and 95 more (100 in all)"
        );
        let long = "x".repeat(1000);
        assert_eq!(
            IdSample::of([long.as_str()]).to_string(),
            format!("{}…", "x".repeat(ID_CHARS))
        );
        assert_eq!(
            IdSample::of(["x".repeat(ID_CHARS)]).to_string(),
            "x".repeat(ID_CHARS)
        );
        // A newline cannot start a log line of its own.
        assert_eq!(
            IdSample::of(["a\nWARN forged"]).to_string(),
            "a\\nWARN forged"
        );
    }

    #[test]
    fn assign_checks_ids() {
        let inv = v100x2();
        assert_eq!(
            assign(&inv, &ids(&inv, 1, 2..6)),
            Ok(Assignment { gpu: 1, units: 4 })
        );
        assert_eq!(assign(&inv, &[]), Err(PlacementError::Empty));
        let twice = [ids(&inv, 0, 0..1), ids(&inv, 0, 0..1)].concat();
        assert!(matches!(
            assign(&inv, &twice),
            Err(PlacementError::Duplicate(_))
        ));
        let both = [ids(&inv, 0, 0..1), ids(&inv, 1, 0..1)].concat();
        let err = assign(&inv, &both).unwrap_err();
        assert!(
            err.to_string().contains("GPU0: ") && err.to_string().contains("GPU1: "),
            "{err}"
        );
        let err = assign(&inv, &["00000000-1".into()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown device IDs (not advertised by this plugin): 00000000-1"
        );
    }
}
