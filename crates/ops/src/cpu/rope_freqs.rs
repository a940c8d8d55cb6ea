//! RoPE from an explicit frequency table (see `Rope::freqs`).

use super::CpuTensor;

pub fn rope_freqs(x: &mut CpuTensor, positions: &[u32], head_dim: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    assert!(positions.len() == x.rows, "rope_freqs: {} positions for {} rows", positions.len(), x.rows);
    assert!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "rope_freqs: rows of {} are not whole heads of {head_dim}", x.cols);
    assert!(2 * half <= head_dim, "rope_freqs: {half} frequencies do not fit a head of {head_dim}");
    let cols = x.cols;
    for (r, &p) in positions.iter().enumerate() {
        let pos = p as f32;
        // One sin/cos per frequency, shared by every head of the row.
        let sc: Vec<(f32, f32)> = inv_freq.iter().map(|f| (pos * f).sin_cos()).collect();
        for head in x.data[r * cols..(r + 1) * cols].chunks_exact_mut(head_dim) {
            for (i, &(s, c)) in sc.iter().enumerate() {
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = x0 * c - x1 * s;
                head[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::Cpu;
    use crate::{Device, Rope};

    #[test]
    fn full_table_equals_neox_rope_and_zero_frequencies_pass() {
        let dev = Cpu::new(None);
        let (hd, heads, theta) = (8, 2, 500.0f32);
        let data: Vec<f32> = (0..3 * heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let pos = [0u32, 5, 17];
        let mut a = dev.upload(&data, 3, heads * hd).unwrap();
        let mut b = a.clone();
        dev.rope(&mut a, &pos, hd, &Rope::new(theta, hd, true));
        let inv: Vec<f32> = (0..hd / 2).map(|i| theta.powf(-((2 * i) as f32) / hd as f32)).collect();
        dev.rope(&mut b, &pos, hd, &Rope::table(inv));
        assert_eq!(a.data, b.data);

        // Zero frequencies leave their pairs exactly as they were.
        let mut c = dev.upload(&data, 3, heads * hd).unwrap();
        dev.rope(&mut c, &pos, hd, &Rope::table(vec![0.5, 0.0, 0.0, 0.0]));
        for (r, row) in c.data.chunks(heads * hd).enumerate() {
            for (h, head) in row.chunks(hd).enumerate() {
                let orig = &data[r * heads * hd + h * hd..][..hd];
                for i in [1, 2, 3, 5, 6, 7] {
                    assert_eq!(head[i], orig[i]);
                }
                if pos[r] != 0 {
                    assert_ne!(head[0], orig[0]);
                }
            }
        }
        let too_many = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dev.rope(&mut c, &pos, hd, &Rope::table(vec![0.0; 5]))));
        assert!(too_many.is_err());
    }
}
