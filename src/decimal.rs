//! Exact decimal numbers: what a JSON or TOML number's text writes, compared by value, and the
//! micro-unit fixed point sums are kept in. Pure.
//!
//! A [`Decimal`] is `±mantissa × 10^exp` normalised (no trailing zeros in the mantissa, zero is
//! `+0 × 10^0`), so equal values have equal representations: `1`, `1.0` and `100e-2` are one
//! value, `1.0000000000000001` another. Mantissas hold up to 19 significant digits (a u64, so
//! parsing and comparing stay cheap); a longer number keeps its first 19 — nobody writes an
//! amount, a threshold or an id with more, and a double holds fewer than 18.

use std::cmp::Ordering;
use std::fmt;

/// Micro-units per unit: sums are kept as integers of 10^-6.
pub const MICROS_PER_UNIT: i64 = 1_000_000;

/// An exact decimal value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decimal {
    negative: bool,
    mantissa: u64,
    exp: i32,
}

/// Most significant digits kept (a u64 holds any 19-digit mantissa).
const MAX_DIGITS: u32 = 19;

/// 10^0 ..= 10^38 (products of a mantissa and a power of ten are taken in u128).
const POW10: [u128; 39] = {
    let mut table = [1u128; 39];
    let mut i = 1;
    while i < 39 {
        table[i] = table[i - 1] * 10;
        i += 1;
    }
    table
};

/// Decimal digits of `m` (1 for 0), without dividing.
fn digits(m: u64) -> u32 {
    let m = u128::from(m);
    POW10[1..]
        .iter()
        .position(|&p| m < p)
        .map_or(39, |i| i as u32 + 1)
}

impl Decimal {
    pub const ZERO: Decimal = Decimal {
        negative: false,
        mantissa: 0,
        exp: 0,
    };

    fn normalised(negative: bool, mut mantissa: u64, mut exp: i64) -> Decimal {
        if mantissa == 0 {
            return Decimal::ZERO;
        }
        while mantissa % 10 == 0 {
            mantissa /= 10;
            exp += 1;
        }
        // Exponents beyond i32 are far outside anything a value can mean; clamp them.
        let exp = exp.clamp(i32::MIN as i64 / 2, i32::MAX as i64 / 2) as i32;
        Decimal {
            negative,
            mantissa,
            exp,
        }
    }

    pub fn from_i64(v: i64) -> Decimal {
        Decimal::normalised(v < 0, v.unsigned_abs(), 0)
    }

    /// A value held in micro-units (`micros × 10^-6`).
    pub fn from_micros(micros: i64) -> Decimal {
        Decimal::normalised(micros < 0, micros.unsigned_abs(), -6)
    }

    /// Parses JSON number syntax (`-?int(.frac)?([eE][+-]?digits)?`); TOML integers and floats
    /// (underscores removed first) parse the same way. `None` for anything else.
    pub fn parse(text: &str) -> Option<Decimal> {
        let bytes = text.as_bytes();
        // Fast path: a plain non-negative integer that fits (timestamps, ids, counts).
        if !bytes.is_empty() && bytes.len() <= 19 && bytes.iter().all(u8::is_ascii_digit) {
            let v = bytes
                .iter()
                .fold(0u64, |v, &b| v * 10 + u64::from(b - b'0'));
            return Some(Decimal::normalised(false, v, 0));
        }
        let mut i = 0;
        let negative = bytes.first() == Some(&b'-');
        if negative || bytes.first() == Some(&b'+') {
            i += 1;
        }
        let mut mantissa: u64 = 0;
        let mut kept = 0u32;
        let mut exp: i64 = 0;
        let mut any = false;
        let mut push = |d: u8, fraction: bool, mantissa: &mut u64, exp: &mut i64| {
            if *mantissa == 0 && d == 0 {
                if fraction {
                    *exp -= 1;
                }
                return;
            }
            if kept < MAX_DIGITS {
                *mantissa = *mantissa * 10 + d as u64;
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

    /// The nearest double (correctly rounded).
    pub fn to_f64(self) -> f64 {
        // Exact when the mantissa and the power of ten are both exact doubles: one IEEE
        // operation then rounds correctly (the classic fast path of decimal parsing).
        const EXACT_POW10: [f64; 23] = [
            1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
            1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
        ];
        if self.mantissa < (1 << 53) && self.exp.unsigned_abs() <= 22 {
            let m = self.mantissa as f64;
            let v = if self.exp >= 0 {
                m * EXACT_POW10[self.exp as usize]
            } else {
                m / EXACT_POW10[(-self.exp) as usize]
            };
            return if self.negative { -v } else { v };
        }
        self.to_string().parse().unwrap_or(f64::NAN)
    }

    /// `floor(self × 10^scale)`, saturating to the i64 range: for an integer `m`,
    /// `m > self × 10^scale` exactly when `m > floor(self × 10^scale)`.
    pub fn floor_scaled(self, scale: i32) -> i64 {
        let exp = self.exp as i64 + scale as i64;
        let mantissa = u128::from(self.mantissa);
        let magnitude: Option<u128> = if exp >= 0 {
            POW10
                .get(exp as usize)
                .and_then(|p| mantissa.checked_mul(*p))
        } else {
            Some(POW10.get((-exp) as usize).map_or(0, |p| mantissa / p))
        };
        // Normalised: a negative exponent means a fractional part.
        let integral = exp >= 0 || self.mantissa == 0;
        match (magnitude.and_then(|m| i64::try_from(m).ok()), self.negative) {
            (Some(m), false) => m,
            // floor of a negative non-integer goes one further down.
            (Some(m), true) if integral => -m,
            (Some(m), true) => -m - 1,
            (None, false) => i64::MAX,
            (None, true) => i64::MIN,
        }
    }

    /// The exact decimal of a finite double (its shortest round-trip text), `None` for NaN or
    /// an infinity.
    pub fn from_f64(x: f64) -> Option<Decimal> {
        if !x.is_finite() {
            return None;
        }
        Decimal::parse(&format!("{x:e}"))
    }

    pub fn is_negative(self) -> bool {
        self.negative
    }

    /// The value as an integer, if it is one and fits.
    pub fn as_i128(self) -> Option<i128> {
        if self.exp < 0 {
            return None;
        }
        let mut v = i128::from(self.mantissa);
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
        let mantissa = u128::from(self.mantissa);
        let magnitude: u128 = if exp >= 0 {
            mantissa.checked_mul(*POW10.get(exp as usize)?)?
        } else {
            let drop = (-exp) as u32;
            if drop > 38 {
                0
            } else {
                let div = POW10[drop as usize];
                let (q, r) = (mantissa / div, mantissa % div);
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
        let sign = |d: &Decimal| {
            if d.mantissa == 0 {
                0
            } else if d.negative {
                -1
            } else {
                1
            }
        };
        match sign(self).cmp(&sign(other)) {
            Ordering::Equal => {}
            unequal => return unequal,
        }
        if self.mantissa == 0 {
            return Ordering::Equal;
        }
        if self.exp == other.exp {
            let magnitude = self.mantissa.cmp(&other.mantissa);
            return if self.negative {
                magnitude.reverse()
            } else {
                magnitude
            };
        }
        // Same sign: compare magnitudes by their leading digit's position, then digit by digit.
        let (da, db) = (digits(self.mantissa), digits(other.mantissa));
        let (ea, eb) = (self.exp as i64 + da as i64, other.exp as i64 + db as i64);
        let magnitude = ea.cmp(&eb).then_with(|| {
            let (a, b) = (u128::from(self.mantissa), u128::from(other.mantissa));
            let (a, b) = if da < db {
                (a * POW10[(db - da) as usize], b)
            } else {
                (a, b * POW10[(da - db) as usize])
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

/// The value with its sign flipped (zero stays zero).
impl std::ops::Neg for Decimal {
    type Output = Decimal;
    fn neg(self) -> Decimal {
        if self.mantissa == 0 {
            self
        } else {
            Decimal {
                negative: !self.negative,
                ..self
            }
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
        let raw = serde_json::value::RawValue::from_string(self.to_string())
            .map_err(serde::ser::Error::custom)?;
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
        assert_eq!(
            serde_json::to_string(&d("999999999994.499999")).unwrap(),
            "999999999994.499999"
        );
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
    fn floor_scaled_is_the_exact_threshold() {
        assert_eq!(d("5").floor_scaled(0), 5);
        assert_eq!(d("2.5").floor_scaled(0), 2);
        assert_eq!(d("10000").floor_scaled(6), 10_000_000_000);
        assert_eq!(d("0.0000015").floor_scaled(6), 1);
        assert_eq!(d("-2.5").floor_scaled(0), -3);
        assert_eq!(d("-2").floor_scaled(0), -2);
        assert_eq!(d("1e30").floor_scaled(0), i64::MAX);
        assert_eq!(d("0").floor_scaled(6), 0);
    }

    #[test]
    fn doubles_round_trip() {
        for text in [
            "0.1",
            "2.5",
            "1e22",
            "123456789.125",
            "-0.3",
            "1e-300",
            "9007199254740993",
            "0.30000000000000004",
        ] {
            assert_eq!(d(text).to_f64(), text.parse::<f64>().unwrap(), "{text}");
        }
        assert_eq!(d("0.1").to_f64(), 0.1);
        assert_eq!(
            Decimal::from_f64(0.30000000000000004),
            Some(d("0.30000000000000004"))
        );
        assert_eq!(Decimal::from_f64(f64::NAN), None);
        // Beyond 19 significant digits the rest are dropped (the scale is kept).
        assert_eq!(d("12345678901234567890123"), d("12345678901234567890000"));
        assert_eq!(d("1.00000000000000000001"), d("1"));
    }
}
