//! `braid run`: one prompt, streamed to the terminal.

use anyhow::{bail, Result};
use clap::Args;

use crate::ModelArgs;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt.
    pub prompt: String,
}

pub fn run(_a: RunArgs) -> Result<()> {
    bail!("not yet")
}
