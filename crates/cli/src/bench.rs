//! `braid bench`.

use anyhow::{bail, Result};
use clap::Args;

use crate::ModelArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn bench(_a: BenchArgs) -> Result<()> {
    bail!("not yet")
}
