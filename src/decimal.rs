//! Exact decimal numbers: what a JSON or TOML number's text writes, compared by value, and the
//! micro-unit fixed point sums are kept in. Pure.
//!
//! A [`Decimal`] is `±digits × 10^exp` normalised (no leading or trailing zeros in the digits,
//! zero is `+0 × 10^0`), so equal values have equal representations: `1`, `1.0` and `100e-2`
//! are one value, `1.0000000000000001` another. Any number of digits is exact: up to 19
//! significant digits (timestamps, amounts, signed 64-bit ids) live in a `u64` with no
//! allocation, in 16 bytes; a longer number (an unsigned 64-bit id, a crafted 40-digit one)
//! keeps all its digits on the heap, so no id can equal or hide behind another one. Exponents
//! saturate at ±2^30 (`1e1073741824` and anything larger are one value): no number anyone
//! writes comes near.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

/// Micro-units per unit: sums are kept as integers of 10^-6.
pub const MICROS_PER_UNIT: i64 = 1_000_000;

/// An exact decimal value (cheap to clone: at most a reference count for a long one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Decimal(Repr);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// Up to [`SMALL_DIGITS`] significant digits: `±mantissa × 10^exp`.
    Small {
        negative: bool,
        mantissa: u64,
        exp: i32,
    },
    /// More significant digits than a `u64` always holds.
    Long(Arc<LongDigits>),
}

/// `±digits × 10^exp`; `digits` are ASCII, more than [`SMALL_DIGITS`] of them, first and last
/// non-zero.
#[derive(Debug, PartialEq, Eq, Hash)]
struct LongDigits {
    negative: bool,
    digits: Box<str>,
    exp: i64,
}

/// Significant digits a `u64` mantissa always holds (10^19 - 1 < 2^64).
const SMALL_DIGITS: usize = 19;

/// Exponents saturate here: far beyond any number's meaning, within an i32.
const EXP_LIMIT: i64 = 1 << 30;

/// 10^0 ..= 10^38.
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

/// A view of a decimal's parts, whichever form holds it.
struct Parts<'d> {
    negative: bool,
    exp: i64,
    long: Option<&'d str>,
    mantissa: u64,
}

impl<'d> Parts<'d> {
    /// Number of significant digits (counted only where a caller needs it).
    fn len(&self) -> i64 {
        match self.long {
            Some(d) => d.len() as i64,
            None => i64::from(digits(self.mantissa)),
        }
    }

    /// Power of ten just above the value: `value < 10^adjusted` and `>= 10^(adjusted-1)`.
    fn adjusted(&self) -> i64 {
        self.exp + self.len()
    }

    fn digit_text(&self) -> std::borrow::Cow<'d, str> {
        match self.long {
            Some(d) => std::borrow::Cow::Borrowed(d),
            None => std::borrow::Cow::Owned(self.mantissa.to_string()),
        }
    }
}

impl Decimal {
    pub const ZERO: Decimal = Decimal(Repr::Small {
        negative: false,
        mantissa: 0,
        exp: 0,
    });

    fn small(negative: bool, mut mantissa: u64, mut exp: i64) -> Decimal {
        if mantissa == 0 {
            return Decimal::ZERO;
        }
        while mantissa % 10 == 0 {
            mantissa /= 10;
            exp += 1;
        }
        Decimal(Repr::Small {
            negative,
            mantissa,
            exp: exp.clamp(-EXP_LIMIT, EXP_LIMIT) as i32,
        })
    }

    fn parts(&self) -> Parts<'_> {
        match &self.0 {
            Repr::Small {
                negative,
                mantissa,
                exp,
            } => Parts {
                negative: *negative,
                exp: i64::from(*exp),
                long: None,
                mantissa: *mantissa,
            },
            Repr::Long(l) => Parts {
                negative: l.negative,
                exp: l.exp,
                long: Some(&l.digits),
                mantissa: 0,
            },
        }
    }

    /// Whether its canonical text may be long: a number of more than 19 significant digits
    /// (any other is at most a few dozen characters).
    pub fn may_be_long(&self) -> bool {
        matches!(self.0, Repr::Long(_))
    }

    fn is_zero(&self) -> bool {
        matches!(self.0, Repr::Small { mantissa: 0, .. })
    }

    pub fn from_i64(v: i64) -> Decimal {
        Decimal::small(v < 0, v.unsigned_abs(), 0)
    }

    pub fn small_int(v: u64) -> Decimal {
        Decimal::small(false, v, 0)
    }

    /// A value held in micro-units (`micros × 10^-6`).
    pub fn from_micros(micros: i64) -> Decimal {
        Decimal::small(micros < 0, micros.unsigned_abs(), -6)
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
            return Some(Decimal::small(false, v, 0));
        }
        let mut i = 0;
        let negative = bytes.first() == Some(&b'-');
        if negative || bytes.first() == Some(&b'+') {
            i += 1;
        }
        let int_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let integral = &bytes[int_start..i];
        if integral.is_empty() {
            return None;
        }
        let mut fraction: &[u8] = &[];
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return None;
            }
            fraction = &bytes[start..i];
        }
        let mut exp: i64 = 0;
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
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                // Wider than the final clamp, so the fraction's length still counts first.
                exp = (exp * 10 + i64::from(bytes[i] - b'0')).min(1 << 40);
                i += 1;
            }
            if i == start {
                return None;
            }
            exp *= sign;
        }
        if i != bytes.len() {
            return None;
        }
        if integral.len() + fraction.len() <= SMALL_DIGITS {
            // Fits a u64 whatever its zeros (amounts, times): one pass.
            let mantissa = integral
                .iter()
                .chain(fraction)
                .fold(0u64, |m, &b| m * 10 + u64::from(b - b'0'));
            return Some(Decimal::small(
                negative,
                mantissa,
                exp - fraction.len() as i64,
            ));
        }
        // The significant digits of integral ++ fraction: first to last non-zero.
        let at = |k: usize| {
            if k < integral.len() {
                integral[k]
            } else {
                fraction[k - integral.len()]
            }
        };
        let total = integral.len() + fraction.len();
        let Some(first) = (0..total).find(|&k| at(k) != b'0') else {
            return Some(Decimal::ZERO);
        };
        let last = (first..total)
            .rev()
            .find(|&k| at(k) != b'0')
            .expect("a non-zero digit");
        let exp =
            (exp - fraction.len() as i64 + (total - 1 - last) as i64).clamp(-EXP_LIMIT, EXP_LIMIT);
        if last - first < SMALL_DIGITS {
            let mantissa = (first..=last).fold(0u64, |m, k| m * 10 + u64::from(at(k) - b'0'));
            return Some(Decimal::small(negative, mantissa, exp));
        }
        let digits: String = (first..=last).map(|k| char::from(at(k))).collect();
        Some(Decimal(Repr::Long(Arc::new(LongDigits {
            negative,
            digits: digits.into_boxed_str(),
            exp,
        }))))
    }

    /// The nearest double (correctly rounded; ±infinity beyond the double range).
    pub fn to_f64(&self) -> f64 {
        // Exact when the mantissa and the power of ten are both exact doubles: one IEEE
        // operation then rounds correctly (the classic fast path of decimal parsing).
        const EXACT_POW10: [f64; 23] = [
            1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
            1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
        ];
        let p = self.parts();
        let v = if p.long.is_none() && p.mantissa < (1 << 53) && p.exp.unsigned_abs() <= 22 {
            let m = p.mantissa as f64;
            if p.exp >= 0 {
                m * EXACT_POW10[p.exp as usize]
            } else {
                m / EXACT_POW10[(-p.exp) as usize]
            }
        } else {
            // The standard library's parser rounds any number of digits correctly.
            format!("{}e{}", p.digit_text(), p.exp)
                .parse()
                .unwrap_or(f64::NAN)
        };
        if p.negative {
            -v
        } else {
            v
        }
    }

    /// Whether the value is within the range of a double (so JSON readers that parse numbers
    /// as doubles, serde_json among them, accept its text).
    pub fn fits_f64(&self) -> bool {
        match self.parts().adjusted() {
            a if a <= 308 => true,
            309 => self.to_f64().is_finite(),
            _ => false,
        }
    }

    /// `floor(self × 10^scale)`, saturating to the i64 range: for an integer `m`,
    /// `m > self × 10^scale` exactly when `m > floor(self × 10^scale)`.
    pub fn floor_scaled(&self, scale: i32) -> i64 {
        let p = self.parts();
        let exp = p.exp + i64::from(scale);
        let saturated = if p.negative { i64::MIN } else { i64::MAX };
        let (magnitude, integral) = match p.long {
            None => {
                let mantissa = u128::from(p.mantissa);
                let magnitude: Option<u128> = if exp >= 0 {
                    POW10
                        .get(exp as usize)
                        .and_then(|pow| mantissa.checked_mul(*pow))
                } else {
                    Some(POW10.get((-exp) as usize).map_or(0, |pow| mantissa / pow))
                };
                // Normalised: a negative exponent means a fractional part.
                (magnitude, exp >= 0 || p.mantissa == 0)
            }
            Some(digits) => {
                // More than 19 digits: an integer part short enough to fit leaves digits
                // behind it, so the value is never integral there.
                let whole = p.len() + exp;
                if whole > 19 {
                    return saturated;
                }
                let whole = whole.max(0) as usize;
                let m = digits[..whole]
                    .bytes()
                    .fold(0u128, |m, b| m * 10 + u128::from(b - b'0'));
                (Some(m), false)
            }
        };
        match (magnitude.and_then(|m| i64::try_from(m).ok()), p.negative) {
            (Some(m), false) => m,
            // floor of a negative non-integer goes one further down.
            (Some(m), true) if integral => -m,
            (Some(m), true) => -m - 1,
            (None, _) => saturated,
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

    pub fn is_negative(&self) -> bool {
        self.parts().negative
    }

    /// The value as an integer, if it is one and fits.
    pub fn as_i128(&self) -> Option<i128> {
        let Repr::Small {
            negative,
            mantissa,
            exp,
        } = self.0
        else {
            // Keys rely on one form per value: a long number is always keyed by its text,
            // even one an i128 could hold.
            return None;
        };
        if exp < 0 {
            return None;
        }
        let mut v = i128::from(mantissa);
        for _ in 0..exp {
            v = v.checked_mul(10)?;
        }
        Some(if negative { -v } else { v })
    }

    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// The value in micro-units, rounded half to even at the sixth fractional digit, if it fits
    /// an i64.
    pub fn to_micros_half_even(&self) -> Option<i64> {
        let p = self.parts();
        let exp = p.exp + 6;
        let magnitude: u128 = match p.long {
            None if exp >= 0 => u128::from(p.mantissa).checked_mul(*POW10.get(exp as usize)?)?,
            None => {
                let drop = (-exp) as u64;
                if drop > 38 {
                    0
                } else {
                    let div = POW10[drop as usize];
                    let mantissa = u128::from(p.mantissa);
                    let (q, r) = (mantissa / div, mantissa % div);
                    let twice = r * 2;
                    match twice.cmp(&div) {
                        Ordering::Less => q,
                        Ordering::Greater => q + 1,
                        Ordering::Equal => q + (q & 1),
                    }
                }
            }
            Some(digits) => {
                let whole = p.len() + exp;
                if whole > 19 {
                    return None;
                }
                if whole < 0 {
                    0
                } else {
                    let whole = whole as usize;
                    let q = digits[..whole]
                        .bytes()
                        .fold(0u128, |m, b| m * 10 + u128::from(b - b'0'));
                    // More than 19 digits, so at least one follows the integer part; a 5 is
                    // the exact half only as the last digit (the last digit is non-zero).
                    let next = digits.as_bytes()[whole];
                    let tie = next == b'5' && whole + 1 == digits.len();
                    let up = next > b'5' || (next == b'5' && (!tie || q & 1 == 1));
                    q + u128::from(up)
                }
            }
        };
        let v = i64::try_from(magnitude).ok()?;
        Some(if p.negative { -v } else { v })
    }
}

impl Ord for Decimal {
    fn cmp(&self, other: &Self) -> Ordering {
        // The common case, as before long numbers: same sign and exponent, compare mantissas.
        if let (
            Repr::Small {
                negative: na,
                mantissa: ma,
                exp: ea,
            },
            Repr::Small {
                negative: nb,
                mantissa: mb,
                exp: eb,
            },
        ) = (&self.0, &other.0)
        {
            if na == nb && ea == eb && *ma != 0 && *mb != 0 {
                let magnitude = ma.cmp(mb);
                return if *na { magnitude.reverse() } else { magnitude };
            }
        }
        let sign = |d: &Decimal| {
            if d.is_zero() {
                0
            } else if d.parts().negative {
                -1
            } else {
                1
            }
        };
        match sign(self).cmp(&sign(other)) {
            Ordering::Equal => {}
            unequal => return unequal,
        }
        if self.is_zero() {
            return Ordering::Equal;
        }
        let (a, b) = (self.parts(), other.parts());
        // Same sign: compare magnitudes by their leading digit's position, then digit by digit.
        let magnitude = a.adjusted().cmp(&b.adjusted()).then_with(|| {
            if a.long.is_none() && b.long.is_none() {
                let (da, db) = (a.len() as u32, b.len() as u32);
                let (x, y) = (u128::from(a.mantissa), u128::from(b.mantissa));
                let (x, y) = if da < db {
                    (x * POW10[(db - da) as usize], y)
                } else {
                    (x, y * POW10[(da - db) as usize])
                };
                x.cmp(&y)
            } else {
                // Same leading position: the digit strings compare as text, a longer one
                // (whose extra digits end non-zero) being larger when one prefixes the other.
                a.digit_text().as_bytes().cmp(b.digit_text().as_bytes())
            }
        });
        if a.negative {
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
        match self.0 {
            Repr::Small { mantissa: 0, .. } => self,
            Repr::Small {
                negative,
                mantissa,
                exp,
            } => Decimal(Repr::Small {
                negative: !negative,
                mantissa,
                exp,
            }),
            Repr::Long(l) => Decimal(Repr::Long(Arc::new(LongDigits {
                negative: !l.negative,
                digits: l.digits.clone(),
                exp: l.exp,
            }))),
        }
    }
}

impl std::ops::Neg for &Decimal {
    type Output = Decimal;
    fn neg(self) -> Decimal {
        -self.clone()
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The shortest exact decimal text: `2711.64`, `0.000002`, `1e400` only for huge exponents.
impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.parts();
        if p.negative {
            f.write_str("-")?;
        }
        let m = p.digit_text();
        let exp = p.exp;
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
            let frac = exp.unsigned_abs();
            let len = m.len() as u64;
            if frac < len {
                let point = (len - frac) as usize;
                write!(f, "{}.{}", &m[..point], &m[point..])
            } else if frac - len <= 20 {
                write!(f, "0.{}{m}", "0".repeat((frac - len) as usize))
            } else {
                write!(f, "{m}e{exp}")
            }
        }
    }
}

/// A JSON number with the exact text, or — beyond the range of a double, which serde_json and
/// most JSON readers refuse as a number — a JSON string of that text.
impl serde::Serialize for Decimal {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if let Some(v) = self.as_i64() {
            return s.serialize_i64(v);
        }
        if !self.fits_f64() {
            return s.serialize_str(&self.to_string());
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
        assert_eq!(m("99999999999999999999999999999999999999"), None);
        // Long numbers round half to even too: 20 digits whose last is the half.
        assert_eq!(m("1234567.8901234567895"), Some(1_234_567_890_123));
        assert_eq!(m("1234567.8901245678885"), Some(1_234_567_890_125));
        assert_eq!(m("1234567.8901235000000000005"), Some(1_234_567_890_124));
        assert_eq!(m("1000000000000.0000005"), Some(1_000_000_000_000_000_000));
        assert_eq!(m("1000000000001.0000015"), Some(1_000_000_000_001_000_002));
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
    }

    #[test]
    fn any_number_of_digits_is_exact() {
        // 64-bit ids, 128-bit ids, and numbers longer than any machine integer.
        assert_ne!(d("18446744073709551615"), d("18446744073709551614"));
        assert!(d("18446744073709551615") > d("18446744073709551614"));
        assert_ne!(d("12345678901234567890123"), d("12345678901234567890000"));
        assert_ne!(d("1.00000000000000000001"), d("1"));
        let long = "1234567890123456789012345678901234567890123456789";
        assert_eq!(d(long).to_string(), long);
        assert_eq!(d(&format!("{long}.000")), d(long));
        assert_eq!(
            d(&format!("{long}e-10")).to_string(),
            "123456789012345678901234567890123456789.0123456789"
        );
        assert!(d(&format!("{long}1")) > d(&format!("{long}0")));
        assert!(d(&format!("{long}0")) < d(&format!("{long}1")));
        assert!(d(&format!("-{long}1")) < d(&format!("-{long}0")));
        // Long against small at the same leading position, both ways.
        assert!(d("1.000000000000000000000000000000000000000001") > d("1"));
        assert!(d("1") < d("1.000000000000000000000000000000000000000001"));
        assert!(d("0.999999999999999999999999999999999999999999") < d("1"));
        assert_eq!(
            d("1.000000000000000000000000000000000000000001")
                .cmp(&d("1.000000000000000000000000000000000000000001")),
            Ordering::Equal
        );
        // Their doubles round correctly, and so do their thresholds and micro-units.
        assert_eq!(d(long).to_f64(), long.parse::<f64>().unwrap());
        let above_two = "2.0000000000000000000000000000000000000000001";
        assert_eq!(d(above_two).floor_scaled(0), 2);
        assert_eq!((-d(above_two)).floor_scaled(0), -3);
        assert_eq!(d(long).floor_scaled(0), i64::MAX);
        assert_eq!(
            d("0.00000250000000000000000000000000000000000001").to_micros_half_even(),
            Some(3)
        );
        assert_eq!(
            d("0.00000249999999999999999999999999999999999999").to_micros_half_even(),
            Some(2)
        );
        assert_eq!(d(long).to_micros_half_even(), None);
        assert_eq!(d(long).as_i128(), None);
    }

    #[test]
    fn numbers_beyond_a_double_serialize_as_strings_serde_json_can_read() {
        for text in ["1e400", "-1e309", &"9".repeat(400)] {
            let json = serde_json::to_string(&d(text)).unwrap();
            assert!(json.starts_with('"'), "{json}");
            assert!(serde_json::from_str::<serde_json::Value>(&json).is_ok());
        }
        assert!(d("1.7976931348623157e308").fits_f64());
        assert!(!d("1.7976931348623159e308").fits_f64());
        assert_eq!(serde_json::to_string(&d("1e-400")).unwrap(), "1e-400");
        assert!(serde_json::from_str::<f64>("1e-400").is_ok());
    }
}
