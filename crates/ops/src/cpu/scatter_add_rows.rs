//! `out[rows[i]] += weights[i] * y[i]` (see `Device::scatter_add_rows`).

use anyhow::{ensure, Result};

use super::CpuTensor;

pub fn scatter_add_rows(out: &mut CpuTensor, y: &CpuTensor, rows: &[u32], weights: &[f32]) -> Result<()> {
    ensure!(y.cols == out.cols, "scatter_add_rows: rows of {} added to rows of {}", y.cols, out.cols);
    ensure!(rows.len() == y.rows && weights.len() == y.rows, "scatter_add_rows: {} rows, {} targets, {} weights", y.rows, rows.len(), weights.len());
    if let Some(&bad) = rows.iter().find(|&&r| r as usize >= out.rows) {
        anyhow::bail!("scatter_add_rows: target row {bad} is past the output's {} rows", out.rows);
    }
    for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
        for (d, s) in out.row_mut(r as usize).iter_mut().zip(y.row(i)) {
            *d += w * s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::cpu::Cpu;
    use crate::{Device, MoeOps};

    #[test]
    fn adds_weighted_rows_and_checks_targets() {
        let dev = Cpu::new(None);
        let mut out = dev.upload(&[1.0, 1.0, 2.0, 2.0, 3.0, 3.0], 3, 2).unwrap();
        let y = dev.upload(&[1.0, 2.0, 10.0, 20.0], 2, 2).unwrap();
        dev.scatter_add_rows(&mut out, &y, &[2, 0], &[0.5, 2.0]).unwrap();
        assert_eq!(out.data, vec![21.0, 41.0, 2.0, 2.0, 3.5, 4.0]);
        assert!(dev.scatter_add_rows(&mut out, &y, &[3, 0], &[1.0, 1.0]).is_err());
        assert!(dev.scatter_add_rows(&mut out, &y, &[0], &[1.0]).is_err());
    }
}
