//! Kubernetes resource quantities (`4Gi`, `4096Mi`, `4294967296`, `4.5G`,
//! `1e9`), as the API server writes them in DRA's `consumedCapacity` and
//! `requestPolicy` and users write them in pod limits and `exec --mem`. The
//! server canonicalises them (`1024Mi` comes back as `1Gi`), so they are
//! compared by value, never as text.

/// The quantity `text` in bytes, rounded down; `None` if it does not parse,
/// is negative, or does not fit.
pub fn bytes(text: &str) -> Option<u128> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number = number.strip_prefix('+').unwrap_or(number);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if !whole
        .bytes()
        .chain(fraction.bytes())
        .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // value = digits / 10^decimals * 2^shift * 10^exp10
    let digits: u128 = format!("{whole}{fraction}").parse().ok()?;
    let decimals = u32::try_from(fraction.len()).ok()?;
    let (shift, exp10): (u32, i32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        exp => {
            let exp = exp.strip_prefix(['e', 'E'])?;
            (0, exp.parse().ok()?)
        }
    };
    let mut value = digits.checked_mul(1u128.checked_shl(shift)?)?;
    let exp10 = exp10 - i32::try_from(decimals).ok()?;
    if exp10 >= 0 {
        value = value.checked_mul(10u128.checked_pow(exp10.unsigned_abs())?)?;
    } else {
        value /= 10u128.checked_pow(exp10.unsigned_abs())?;
    }
    Some(value)
}

/// The quantity in whole MiB, rounded down.
pub fn mib(text: &str) -> Option<u64> {
    u64::try_from(bytes(text)? >> 20).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_the_api_server_writes() {
        assert_eq!(bytes("4Gi"), Some(4 << 30));
        assert_eq!(bytes("4096Mi"), Some(4 << 30));
        assert_eq!(bytes("4294967296"), Some(4 << 30));
        assert_eq!(bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(bytes("4G"), Some(4_000_000_000));
        assert_eq!(bytes("4e9"), Some(4_000_000_000));
        assert_eq!(bytes("1500m"), Some(1));
        assert_eq!(bytes("+2Ki"), Some(2048));
        assert_eq!(mib("15079Mi"), Some(15079));
        assert_eq!(mib("14Gi"), Some(14336));
    }

    #[test]
    fn refuses_what_is_not_a_quantity() {
        for bad in [
            "",
            "Gi",
            "-1Gi",
            "4GB",
            "4 Gi",
            "1..2",
            "x",
            "9999999999999999999999Ei",
        ] {
            assert_eq!(bytes(bad), None, "{bad:?}");
        }
    }
}
