//! Exact decimal numbers: what a JSON or TOML number's text writes, compared by value, and the
//! micro-unit fixed point sums are kept in. Pure.
//!
//! A [`Decimal`] is `±mantissa × 10^exp` normalised (no trailing zeros in the mantissa, zero is
//! `+0 × 10^0`), so equal values have equal representations: `1`, `1.0` and `100e-2` are one
//! value, `1.0000000000000001` another. Mantissas hold up to 38 significant digits; a longer
//! number keeps its first 38 (nobody writes an amount or an id with more).

use std::cmp::Ordering;
use std::fmt;

/// Micro-units per unit: sums are kept as integers of 10^-6.
pub const MICROS_PER_UNIT: i64 = 1_000_000;

/// An exact decimal value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decimal {
    negative: bool,
    mantissa: u128,
    exp: i32,
}

/// Most significant digits kept (u128 holds any 38-digit mantissa).
const MAX_DIGITS: u32 = 38;

fn digits(mut m: u128) -> u32 {
    let mut n = 1;
    while m >= 10 {
        m /= 10;
        n += 1;
    }
    n
}

impl Decimal {
    pub const ZERO: Decimal = Decimal { negative: false, mantissa: 0, exp: 0 };

    fn normalised(negative: bool, mut mantissa: u128, mut exp: i64) -> Decimal {
        if mantissa == 0 {
            return Decimal::ZERO;
        }
        while mantissa % 10 == 0 {
            mantissa /= 10;
            exp += 1;
        }
        // Exponents beyond i32 are far outside anything a value can mean; clamp them.
        let exp = exp.clamp(i32::MIN as i64 / 2, i32::MAX as i64 / 2) as i32;
        Decimal { negative, mantissa, exp }
    }

    pub fn from_i64(v: i64) -> Decimal {
        Decimal::normalised(v < 0, v.unsigned_abs() as u128, 0)
    }

    /// A value held in micro-units (`micros × 10^-6`).
    pub fn from_micros(micros: i64) -> Decimal {
        Decimal::normalised(micros < 0, micros.unsigned_abs() as u128, -6)
    }

    /// Parses JSON number syntax (`-?int(.frac)?([eE][+-]?digits)?`); TOML integers and floats
    /// (underscores removed first) parse the same way. `None` for anything else.
    pub fn parse(text: &str) -> Option<Decimal> {
        let bytes = text.as_bytes();
        let mut i = 0;
        let negative = bytes.first() == Some(&b'-');
        if negative || bytes.first() == Some(&b'+') {
            i += 1;
        }
        let mut mantissa: u128 = 0;
        let mut kept = 0u32;
        let mut exp: i64 = 0;
        let mut any = false;
        let mut push = |d: u8, fraction: bool, mantissa: &mut u128, exp: &mut i64| {
            if *mantissa == 0 && d == 0 {
                if fraction {
                    *exp -= 1;
                }
                return;
            }
            if kept < MAX_DIGITS {
                *mantissa = *mantissa * 10 + d as u128;
                kept += 1;
                if fraction {
                    *exp -= 1;
                }
            } else if !fraction {
                // A dropped integer digit still scales the value.
                *exp += 1;
            }
        };
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            push(bytes[i] - b'0', false, &mut mantissa, &mut exp);
            any = true;
            i += 1;
        }
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                push(bytes[i] - b'0', true, &mut mantissa, &mut exp);
                i += 1;
            }
            if i == start {
                return None;
            }
        }
        if !any {
            return None;
        }
        if i < bytes.len() && (bytes[i] == b'e' || bytes[i] == b'E') {
            i += 1;
            let sign: i64 = match bytes.get(i) {
                Some(b'-') => {
                    i += 1;
                    -1
                }
                Some(b'+') => {
                    i += 1;
                    1
                }
                _ => 1,
            };
            let start = i;
            let mut e: i64 = 0;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                e = (e * 10 + (bytes[i] - b'0') as i64).min(1 << 40);
                i += 1;
            }
            if i == start {
                return None;
            }
            exp += sign * e;
        }
        if i != bytes.len() {
            return None;
        }
        Some(Decimal::normalised(negative, mantissa, exp))
    }

    /// The nearest double (correctly rounded from the exact text).
    pub fn to_f64(self) -> f64 {
        self.to_string().parse().unwrap_or(f64::NAN)
    }

    /// The exact decimal of a finite double (its shortest round-trip text), `None` for NaN or
    /// an infinity.
    pub fn from_f64(x: f64) -> Option<Decimal> {
        if !x.is_finite() {
            return None;
        }
        Decimal::parse(&format!("{x:e}"))
    }

    /// The value with its sign flipped.
    pub fn neg(self) -> Decimal {
        if self.mantissa == 0 {
            self
        } else {
            Decimal { negative: !self.negative, ..self }
        }
    }

    pub fn is_negative(self) -> bool {
        self.negative
    }

    /// The value as an integer, if it is one and fits.
    pub fn as_i128(self) -> Option<i128> {
        if self.exp < 0 {
            return None;
        }
        let mut v = i128::try_from(self.mantissa).ok()?;
        for _ in 0..self.exp {
            v = v.checked_mul(10)?;
        }
        Some(if self.negative { -v } else { v })
    }

    pub fn as_i64(self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// The value in micro-units, rounded half to even at the sixth fractional digit, if it fits
    /// an i64.
    pub fn to_micros_half_even(self) -> Option<i64> {
        let exp = self.exp as i64 + 6;
        let magnitude: u128 = if exp >= 0 {
            if exp > 38 {
                return None;
            }
            self.mantissa.checked_mul(10u128.checked_pow(exp as u32)?)?
        } else {
            let drop = (-exp) as u32;
            if drop > 38 {
                0
            } else {
                let div = 10u128.pow(drop);
                let (q, r) = (self.mantissa / div, self.mantissa % div);
                let twice = r * 2;
                match twice.cmp(&div) {
                    Ordering::Less => q,
                    Ordering::Greater => q + 1,
                    Ordering::Equal => q + (q & 1),
                }
            }
        };
        let v = i64::try_from(magnitude).ok()?;
        Some(if self.negative { -v } else { v })
    }
}

impl Ord for Decimal {
    fn cmp(&self, other: &Self) -> Ordering {
        let sign = |d: &Decimal| if d.mantissa == 0 { 0 } else if d.negative { -1 } else { 1 };
        match sign(self).cmp(&sign(other)) {
            Ordering::Equal => {}
            unequal => return unequal,
        }
        if self.mantissa == 0 {
            return Ordering::Equal;
        }
        // Same sign: compare magnitudes by their leading digit's position, then digit by digit.
        let (da, db) = (digits(self.mantissa), digits(other.mantissa));
        let (ea, eb) = (self.exp as i64 + da as i64, other.exp as i64 + db as i64);
        let magnitude = ea.cmp(&eb).then_with(|| {
            let (a, b) = if da < db {
                (self.mantissa * 10u128.pow(db - da), other.mantissa)
            } else {
                (self.mantissa, other.mantissa * 10u128.pow(da - db))
            };
            a.cmp(&b)
        });
        if self.negative {
            magnitude.reverse()
        } else {
            magnitude
        }
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The shortest exact decimal text: `2711.64`, `0.000002`, `1e+400` only for huge exponents.
impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.negative {
            f.write_str("-")?;
        }
        let m = self.mantissa.to_string();
        let exp = self.exp as i64;
        if exp >= 0 {
            if exp <= 21 {
                f.write_str(&m)?;
                for _ in 0..exp {
                    f.write_str("0")?;
                }
                Ok(())
            } else {
                write!(f, "{m}e{exp}")
            }
        } else {
            let frac = (-exp) as usize;
            if frac < m.len() {
                write!(f, "{}.{}", &m[..m.len() - frac], &m[m.len() - frac..])
            } else if frac - m.len() <= 20 {
                write!(f, "0.{}{m}", "0".repeat(frac - m.len()))
            } else {
                write!(f, "{m}e{exp}")
            }
        }
    }
}

impl serde::Serialize for Decimal {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if let Some(v) = self.as_i64() {
            return s.serialize_i64(v);
        }
        // The exact text as a JSON number token (serde_json writes a raw value verbatim).
        let raw = serde_json::value::RawValue::from_string(self.to_string()).map_err(serde::ser::Error::custom)?;
        raw.serialize(s)
    }
}

/// Formats micro-units as the shortest exact decimal.
pub fn format_micros(micros: i64) -> String {
    Decimal::from_micros(micros).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap_or_else(|| panic!("{s}"))
    }

    #[test]
    fn equal_values_have_one_form() {
        assert_eq!(d("1"), d("1.0"));
        assert_eq!(d("1"), d("100e-2"));
        assert_eq!(d("-0"), d("0.000"));
        assert_ne!(d("1"), d("1.0000000000000001"));
        assert_eq!(d("2.50E-1"), d("0.25"));
        for bad in ["", "-", ".5", "1.", "1e", "0x10", "1 ", "--1", "1e+"] {
            assert_eq!(Decimal::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ordering_is_exact() {
        assert!(d("1.0000000000000001") > d("1"));
        assert!(d("-2") < d("-1.5"));
        assert!(d("0.3") < d("0.30000000000000004"));
        assert!(d("1e3") > d("999.999"));
        assert!(d("-1e3") < d("-999.999"));
        assert_eq!(d("10").cmp(&d("1e1")), Ordering::Equal);
        assert!(d("0") > d("-0.0001"));
    }

    #[test]
    fn prints_the_shortest_exact_text() {
        assert_eq!(format_micros(2_711_640_000), "2711.64");
        assert_eq!(format_micros(2), "0.000002");
        assert_eq!(format_micros(-500_000), "-0.5");
        assert_eq!(format_micros(0), "0");
        assert_eq!(d("1.2345e2").to_string(), "123.45");
        assert_eq!(d("1e400").to_string(), "1e400");
        assert_eq!(serde_json::to_string(&d("999999999994.499999")).unwrap(), "999999999994.499999");
        assert_eq!(serde_json::to_string(&d("6.0")).unwrap(), "6");
    }

    #[test]
    fn micro_units_round_half_to_even() {
        let m = |s: &str| d(s).to_micros_half_even();
        assert_eq!(m("0.0000005"), Some(0));
        assert_eq!(m("0.0000015"), Some(2));
        assert_eq!(m("0.0000025"), Some(2));
        assert_eq!(m("1.2345675"), Some(1_234_568));
        assert_eq!(m("1.2345665"), Some(1_234_566));
        assert_eq!(m("-1.2345665"), Some(-1_234_566));
        assert_eq!(m("999999999999.9999996"), Some(1_000_000_000_000_000_000));
        assert_eq!(m("1e30"), None);
        assert_eq!(m("1e-300"), Some(0));
    }

    #[test]
    fn doubles_round_trip() {
        assert_eq!(d("0.1").to_f64(), 0.1);
        assert_eq!(Decimal::from_f64(0.30000000000000004), Some(d("0.30000000000000004")));
        assert_eq!(Decimal::from_f64(f64::NAN), None);
        // Beyond 38 significant digits the rest are dropped (the scale is kept).
        assert_eq!(d("12345678901234567890123456789012345678901234567890"), d("12345678901234567890123456789012345678000000000000"));
    }
}
