//! Compact little-endian encodings of per-token arrays stored as BLOBs.

use crate::error::{Error, Result};

/// `i32` ids as little-endian bytes.
pub fn i32_blob(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `f32` values as little-endian bytes.
pub fn f32_blob(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `f32` values rounded to IEEE half precision, little-endian.
pub fn f16_blob(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

/// `f32` values (a multiple of 32) as Q8_0 blocks: per 32 values an f16 scale `d` and 32 `i8`
/// codes, value = `d · q`. Lossless for values that are already Q8_0/Q8_1-rounded (which is what
/// the CPU backend multiplies the output weight with), 34 bytes per 32 values.
///
/// # Errors
/// [`Error::Invalid`] when the length is not a multiple of 32.
pub fn q8_0_blob(v: &[f32]) -> Result<Vec<u8>> {
    if !v.len().is_multiple_of(32) {
        return Err(Error::Invalid(format!(
            "{} values do not fill Q8_0 blocks",
            v.len()
        )));
    }
    let mut out = Vec::with_capacity(v.len() / 32 * 34);
    for blk in v.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = half::f16::from_f32(amax / 127.0);
        out.extend_from_slice(&d.to_le_bytes());
        let df = d.to_f32();
        for &x in blk {
            let q = if df == 0.0 {
                0.0
            } else {
                (x / df).round().clamp(-127.0, 127.0)
            };
            out.push(q as i8 as u8);
        }
    }
    Ok(out)
}

/// Decodes [`q8_0_blob`].
///
/// # Errors
/// [`Error::Corrupt`] when the length is not a multiple of 34.
pub fn from_q8_0_blob(b: &[u8]) -> Result<Vec<f32>> {
    if !b.len().is_multiple_of(34) {
        return Err(Error::Corrupt(format!("q8_0 blob of {} bytes", b.len())));
    }
    let mut out = Vec::with_capacity(b.len() / 34 * 32);
    for blk in b.chunks_exact(34) {
        let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        out.extend(blk[2..].iter().map(|&q| d * f32::from(q as i8)));
    }
    Ok(out)
}

fn chunks<'a, const N: usize>(
    b: &'a [u8],
    what: &str,
) -> Result<impl Iterator<Item = [u8; N]> + 'a> {
    if !b.len().is_multiple_of(N) {
        return Err(Error::Corrupt(format!("{what} blob of {} bytes", b.len())));
    }
    Ok(b.chunks_exact(N).map(|c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        a
    }))
}

/// Decodes [`i32_blob`].
///
/// # Errors
/// [`Error::Corrupt`] when the length is not a multiple of 4.
pub fn from_i32_blob(b: &[u8]) -> Result<Vec<i32>> {
    Ok(chunks::<4>(b, "i32")?.map(i32::from_le_bytes).collect())
}

/// Decodes [`f32_blob`].
///
/// # Errors
/// [`Error::Corrupt`] when the length is not a multiple of 4.
pub fn from_f32_blob(b: &[u8]) -> Result<Vec<f32>> {
    Ok(chunks::<4>(b, "f32")?.map(f32::from_le_bytes).collect())
}

/// Decodes [`f16_blob`] to `f32`.
///
/// # Errors
/// [`Error::Corrupt`] when the length is odd.
pub fn from_f16_blob(b: &[u8]) -> Result<Vec<f32>> {
    Ok(chunks::<2>(b, "f16")?
        .map(|c| half::f16::from_le_bytes(c).to_f32())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_bad_lengths() {
        assert_eq!(
            from_i32_blob(&i32_blob(&[1, -2, 49151])).unwrap(),
            vec![1, -2, 49151]
        );
        assert_eq!(
            from_f32_blob(&f32_blob(&[0.5, -3.25])).unwrap(),
            vec![0.5, -3.25]
        );
        // 1/3 in f16 is 0.33325195
        let h = from_f16_blob(&f16_blob(&[1.0 / 3.0, 2.0])).unwrap();
        assert!((h[0] - 0.333_251_95).abs() < 1e-7 && h[1] == 2.0);
        assert!(from_i32_blob(&[1, 2, 3]).is_err());
        assert!(from_f16_blob(&[1]).is_err());
    }

    #[test]
    fn q8_0_is_lossless_on_quantised_values_and_hand_checked() {
        // block: d = 0.5, codes -127..=127 step 8 and a few more
        let d = 0.5f32;
        let v: Vec<f32> = (0..32)
            .map(|i| d * ((i * 8 % 255) as f32 - 127.0))
            .collect();
        let b = q8_0_blob(&v).unwrap();
        assert_eq!(b.len(), 34);
        assert_eq!(half::f16::from_le_bytes([b[0], b[1]]).to_f32(), 0.5);
        assert_eq!(b[2] as i8, -127);
        assert_eq!(from_q8_0_blob(&b).unwrap(), v);
        // arbitrary values round to the nearest code: amax 1.27 -> d ~ 0.01
        let w: Vec<f32> = (0..32).map(|i| if i == 0 { 1.27 } else { 0.004 }).collect();
        let back = from_q8_0_blob(&q8_0_blob(&w).unwrap()).unwrap();
        assert!((back[0] - 1.27).abs() < 1e-3 && back[1] == 0.0);
        assert!(q8_0_blob(&[0.0; 31]).is_err());
        assert!(from_q8_0_blob(&[0; 33]).is_err());
    }
}
