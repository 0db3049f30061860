//! rust_loader: the token-shard format and a batch loader for LLM pretraining.
//!
//! The pure-Rust core (everything but `python`) knows nothing of Python; the `python`
//! feature adds the PyO3 bindings that maturin builds as `pytrain._loader`.
pub mod block;
pub mod dataset;
#[cfg(feature = "encode")]
pub mod encode;
pub mod error;
pub mod format;
pub mod loader;
pub mod order;
pub mod pack;
#[cfg(feature = "s3")]
pub mod remote;
pub mod robustness;
pub mod rows;
pub mod shard_reader;
pub mod shard_writer;
pub mod storage;
pub mod synthetic;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
