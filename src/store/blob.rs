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

fn chunks<'a, const N: usize>(b: &'a [u8], what: &str) -> Result<impl Iterator<Item = [u8; N]> + 'a> {
    if b.len() % N != 0 {
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
        assert_eq!(from_i32_blob(&i32_blob(&[1, -2, 49151])).unwrap(), vec![1, -2, 49151]);
        assert_eq!(from_f32_blob(&f32_blob(&[0.5, -3.25])).unwrap(), vec![0.5, -3.25]);
        // 1/3 in f16 is 0.33325195
        let h = from_f16_blob(&f16_blob(&[1.0 / 3.0, 2.0])).unwrap();
        assert!((h[0] - 0.333_251_95).abs() < 1e-7 && h[1] == 2.0);
        assert!(from_i32_blob(&[1, 2, 3]).is_err());
        assert!(from_f16_blob(&[1]).is_err());
    }
}
