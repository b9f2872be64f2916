//! Memory units: how a GPU's memory becomes countable kubelet units, and how
//! many MiB a container holding some of them may use.

use std::fmt;
use std::str::FromStr;

use crate::node::quantity;

/// Size of one advertised unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryUnit {
    /// 1 unit = 1 GiB, the gpushare convention (`aliyun.com/gpu-mem: 4` = 4 GiB).
    #[default]
    GiB,
    /// 1 unit = 1 MiB: finer requests, far more devices in ListAndWatch.
    MiB,
}

impl MemoryUnit {
    /// MiB in one unit.
    pub fn mib(self) -> u64 {
        match self {
            MemoryUnit::GiB => 1024,
            MemoryUnit::MiB => 1,
        }
    }

    /// Units advertised for a GPU of `memory_mib`: whole units only, so a
    /// 15079 MiB T4 gives 14 GiB units.
    pub fn units_for(self, memory_mib: u64) -> u32 {
        u32::try_from(memory_mib / self.mib()).unwrap_or(u32::MAX)
    }

    /// The name used in env and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryUnit::GiB => "GiB",
            MemoryUnit::MiB => "MiB",
        }
    }
}

impl fmt::Display for MemoryUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `--memory-unit` value that is neither `GiB` nor `MiB`.
#[derive(Debug, thiserror::Error)]
#[error("unknown memory unit {0:?}: expected GiB or MiB")]
pub struct UnknownUnit(pub String);

impl FromStr for MemoryUnit {
    type Err = UnknownUnit;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "gib" => Ok(MemoryUnit::GiB),
            "mib" => Ok(MemoryUnit::MiB),
            _ => Err(UnknownUnit(s.to_owned())),
        }
    }
}

/// A memory size given on the command line, in whole MiB: `4308MiB`,
/// `4GiB` or a bare number of MiB, as gpumem has always taken them, or a
/// Kubernetes quantity as a pod's limits are written (`4Gi`, `4096Mi`,
/// `4G`), rounded down to whole MiB as caps are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySize {
    pub mib: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BadMemorySize {
    #[error(
        "invalid memory size {0:?}: expected a number of MiB with an optional MiB or GiB suffix \
         (4308MiB, 4GiB) or a Kubernetes quantity (4Gi, 4096Mi, 4G)"
    )]
    Malformed(String),
    #[error("memory size {0:?} is zero: a cap must be greater than 0")]
    Zero(String),
    #[error("memory size {0:?} is less than 1 MiB: a cap is counted in whole MiB")]
    BelowOneMib(String),
    #[error("memory size {0:?} is too large to count in MiB")]
    TooLarge(String),
}

impl FromStr for MemorySize {
    type Err = BadMemorySize;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let (digits, unit) = if let Some(d) = lower.strip_suffix("gib") {
            (d, MemoryUnit::GiB)
        } else {
            (lower.strip_suffix("mib").unwrap_or(&lower), MemoryUnit::MiB)
        };
        let digits = digits.trim();
        // Digits only: `parse` alone would take "+4".
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return kubernetes_quantity(s);
        }
        let n: u64 = digits
            .parse()
            .map_err(|_| BadMemorySize::TooLarge(s.to_owned()))?;
        if n == 0 {
            return Err(BadMemorySize::Zero(s.to_owned()));
        }
        let mib = n
            .checked_mul(unit.mib())
            .ok_or_else(|| BadMemorySize::TooLarge(s.to_owned()))?;
        Ok(MemorySize { mib })
    }
}

/// `s` as Kubernetes writes a quantity (case matters there: `m` is milli,
/// `M` mega), in whole MiB rounded down.
fn kubernetes_quantity(s: &str) -> Result<MemorySize, BadMemorySize> {
    let bytes = quantity::bytes(s).ok_or_else(|| BadMemorySize::Malformed(s.to_owned()))?;
    if bytes == 0 {
        return Err(BadMemorySize::Zero(s.to_owned()));
    }
    match u64::try_from(bytes >> 20) {
        Ok(0) => Err(BadMemorySize::BelowOneMib(s.to_owned())),
        Ok(mib) => Ok(MemorySize { mib }),
        Err(_) => Err(BadMemorySize::TooLarge(s.to_owned())),
    }
}

/// The memory cap of a container holding `held` of a GPU's `units` units:
/// `floor(held * memory_mib / units)`. Caps are a share of the *whole* card,
/// so the memory left over by whole-unit rounding is spread over the units
/// (4 of 14 units on a 15079 MiB T4 = 4308 MiB, as Alibaba's cGPU reports)
/// and a container holding every unit gets all of it.
pub fn cap_mib(held: u32, units: u32, memory_mib: u64) -> u64 {
    if units == 0 {
        return 0;
    }
    let cap = u128::from(held) * u128::from(memory_mib) / u128::from(units);
    u64::try_from(cap).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t4_gives_14_gib_units_and_4308_mib_for_4() {
        let units = MemoryUnit::GiB.units_for(15079);
        assert_eq!(units, 14);
        assert_eq!(cap_mib(4, units, 15079), 4308);
        assert_eq!(cap_mib(14, units, 15079), 15079);
        assert_eq!(cap_mib(1, units, 15079), 1077);
    }

    #[test]
    fn cgpu_reference_point_matches() {
        // Alibaba cGPU caps 8 of 22 units on a 23028 MiB card at 8373 MiB.
        let units = MemoryUnit::GiB.units_for(23028);
        assert_eq!(units, 22);
        assert_eq!(cap_mib(8, units, 23028), 8373);
    }

    #[test]
    fn mib_units_are_one_to_one() {
        assert_eq!(MemoryUnit::MiB.units_for(81559), 81559);
        assert_eq!(cap_mib(4308, 81559, 81559), 4308);
    }

    #[test]
    fn small_and_empty_gpus() {
        assert_eq!(MemoryUnit::GiB.units_for(1023), 0);
        assert_eq!(cap_mib(0, 0, 1023), 0);
        assert_eq!(MemoryUnit::GiB.units_for(1024), 1);
    }

    #[test]
    fn caps_are_monotonic_and_never_exceed_the_card() {
        for memory_mib in [1024u64, 15079, 16160, 23028, 81559, 144_384] {
            let units = MemoryUnit::GiB.units_for(memory_mib);
            let mut last = 0;
            for held in 0..=units {
                let cap = cap_mib(held, units, memory_mib);
                assert!(cap >= last && cap <= memory_mib);
                assert!(cap >= u64::from(held) * 1024, "a unit is at least 1 GiB");
                last = cap;
            }
            assert_eq!(last, memory_mib);
        }
    }

    #[test]
    fn parses_memory_sizes() {
        let mib = |s: &str| s.parse::<MemorySize>().map(|m| m.mib).ok();
        assert_eq!(mib("4308MiB"), Some(4308));
        assert_eq!(mib("4GiB"), Some(4096));
        assert_eq!(mib("4308"), Some(4308));
        assert_eq!(mib(" 2 gib "), Some(2048));
        for bad in [
            "", "4GB", "-1MiB", "+4MiB", "1.5GiB", "MiB", "4gi", "-1Gi", "4 Gi",
        ] {
            let err = bad.parse::<MemorySize>().unwrap_err();
            assert!(matches!(err, BadMemorySize::Malformed(_)), "{bad}: {err}");
        }
        // 0 is a number of MiB: the message says what is wrong with it.
        for zero in ["0", "0GiB", "00MiB", "0Gi", "0.0Mi"] {
            let err = zero.parse::<MemorySize>().unwrap_err();
            assert!(err.to_string().contains("greater than 0"), "{err}");
        }
        for huge in [
            "99999999999999999999",
            "18014398509481984GiB",
            "17592186044416Ti",
        ] {
            let err = huge.parse::<MemorySize>().unwrap_err();
            assert!(err.to_string().contains("too large"), "{huge}: {err}");
        }
    }

    #[test]
    fn takes_kubernetes_quantities_rounded_down_to_whole_mib() {
        let mib = |s: &str| s.parse::<MemorySize>().map(|m| m.mib).ok();
        assert_eq!(mib("4Gi"), Some(4096));
        assert_eq!(mib("4096Mi"), Some(4096));
        assert_eq!(mib("4194304Ki"), Some(4096));
        assert_eq!(mib("1Ti"), Some(1 << 20));
        assert_eq!(mib("1.5Gi"), Some(1536));
        // Decimal suffixes: 4e9 bytes are 3814.7 MiB.
        assert_eq!(mib("4G"), Some(3814));
        assert_eq!(mib("4000M"), Some(3814));
        assert_eq!(mib("1536Ki"), Some(1));
        for small in ["512Ki", "1000k", "4096m"] {
            let err = small.parse::<MemorySize>().unwrap_err();
            assert!(
                matches!(err, BadMemorySize::BelowOneMib(_)),
                "{small}: {err}"
            );
        }
    }

    #[test]
    fn parses_units_case_insensitively() {
        assert_eq!("GiB".parse::<MemoryUnit>().unwrap(), MemoryUnit::GiB);
        assert_eq!("mib".parse::<MemoryUnit>().unwrap(), MemoryUnit::MiB);
        let err = "GB".parse::<MemoryUnit>().unwrap_err();
        assert!(err.to_string().contains("\"GB\""));
    }
}
